"""Measuring: timers, the memory bandwidth, the models, and the prefill / decode / kernel-count
runners of the end-to-end benchmark (``Measure``, one per run and device).

Decode variants (``Point.variant``):
  eager-dynamic    original, eager, DynamicCache: what ``model.generate()`` does by default
  eager-default    converted, eager, LinearizeCache: the same for a converted model
  graph-static     one step captured by ``linearize.DecodeGraph`` over a static cache (StaticCache for
                   the original, StaticLinearizeCache for a preset), replayed
  compiled-static  ``torch.compile(model.forward, mode="reduce-overhead")`` over the same static cache:
                   what ``generate(cache_implementation="static")`` does on CUDA (on CPU --smoke:
                   dynamo with the eager backend, a code-path test)
  compiled-graph   ``linearize.DecodeGraph(..., compile=True)``: the forward compiled by Inductor in its
                   default mode, one step of it captured in a CUDA graph and replayed (no per-step
                   guards or CUDA-graph-tree checks on the host); on CPU --smoke as compiled-static
"""

from __future__ import annotations

import copy
import gc
import time

import torch

from .plan import SHAPES, preset_config

GiB = 2**30
DECODE_WARMUP = 4
COMPILED = ("compiled-static", "compiled-graph")  # decode variants whose step is checked against an eager one
CACHE_MARGIN = 16  # static KV slots beyond T + warm-up + timed steps
LAYER_RANGE = "linearize_bench::attention"  # profiler range around every attention module


class Timer:
    """Wall time of GPU work (CUDA events) or of CPU work (perf_counter), in ms."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t) * 1e3


def free_memory(device) -> None:
    """Return the last point's GPU memory before the next one (a no-op on CPU: nothing to measure)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the best of 5: the memory floor's rate."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    timer = Timer(device)
    best = float("inf")
    for _ in range(5):
        timer.start()
        dst.copy_(src)
        best = min(best, timer.stop())
    del src, dst
    free_memory(device)
    return 2 * n / (best / 1e3)


def versions() -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {"torch": torch.__version__, "triton": tv, "transformers": transformers.__version__, "cuda": torch.version.cuda}


# ----------------------------------------------------------------------------- models


def build_original(shape_name: str, seed: int, max_positions: int, device, dtype):
    """A random-weight LlamaForCausalLM of the shape, in ``dtype`` on ``device``, eval mode, sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[shape_name])
    rope = {"rope_type": "default", "rope_theta": shape.pop("rope_theta")}  # the transformers 5 spelling
    cfg = LlamaConfig(**shape, rope_parameters=rope, max_position_embeddings=max_positions,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...): parameters in dtype, RoPE inv_freq in fp32
    try:
        with torch.device(device):
            original = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    original.generation_config.eos_token_id = None  # random weights: no end of text, always the asked tokens
    original.generation_config.pad_token_id = 0
    return original


def convert(original, preset: str, shape_name: str, smoke: bool, device, dtype):
    """The preset's conversion of ``original``, sharing every original parameter and buffer: the
    converted layers reuse the very same q/k/v/o tensors (as linearize does in place), so only the
    new parameters add memory."""
    import linearize

    shared = {id(t): t for t in [*original.parameters(), *original.buffers()]}
    converted = copy.deepcopy(original, shared)
    linearize.linearize(converted, preset_config(preset, shape_name, smoke))
    converted.to(device).eval()
    for p in converted.parameters():  # only the new ones could differ; buffers (inv_freq) stay as they are
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return converted


def unique_params(model) -> list[torch.Tensor]:
    return list({id(p): p for p in model.parameters()}.values())


def weight_bytes(model) -> int:
    """Bytes of every parameter, once (a tied embedding is one matrix)."""
    return sum(p.numel() * p.element_size() for p in unique_params(model))


def model_record(model, preset: str | None) -> dict:
    rec = {"params": sum(p.numel() for p in unique_params(model)), "weight_bytes": weight_bytes(model)}
    conv = getattr(model.config, "linearize", None)
    if conv:
        rec["conversion"] = {k: v for k, v in conv.items() if k not in ("base_model",)}
        rec["converted_layers"] = len(conv["layers"])
    return rec


# ----------------------------------------------------------------------------- prefill and decode helpers


def positions(start: int, length: int, B: int, device):
    return torch.arange(start, start + length, device=device).expand(B, -1)


def prefill(model, ids, cache, chunk: int | None = None):
    """Feed ``ids`` (B, T) through ``cache`` in chunks (one call if None); returns last logits (B, V)."""
    B, T = ids.shape
    step = chunk or T
    for s in range(0, T, step):
        e = min(T, s + step)
        out = model(input_ids=ids[:, s:e], position_ids=positions(s, e - s, B, ids.device), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        del out
    return logits


def eager_stepper(model, cache):
    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    return step


def dynamic_cache_random(model, B: int, T: int, gen):
    """A DynamicCache holding T random keys/values per layer (decode speed does not depend on them)."""
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    p = next(model.parameters())
    for i in range(c.num_hidden_layers):
        k = torch.empty(B, c.num_key_value_heads, T, c.head_dim, device=p.device, dtype=p.dtype).normal_(generator=gen)
        v = torch.empty_like(k).normal_(generator=gen)
        cache.update(k, v, i)
        del k, v
    return cache


def static_cache_random(model, B: int, T: int, max_len: int, gen):
    """transformers' StaticCache of max_len slots whose first T hold random keys/values."""
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=max_len)
    p = next(model.parameters())
    probe = torch.zeros(B, c.num_key_value_heads, 1, c.head_dim, device=p.device, dtype=p.dtype)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
        layer.keys[:, :, :T].normal_(generator=gen)
        layer.values[:, :, :T].normal_(generator=gen)
        layer.cumulative_length.fill_(T)
    return cache


def kv_bytes_per_token(config, layers: int, B: int, dtype) -> int:
    return 2 * layers * config.num_key_value_heads * config.head_dim * B * dtype.itemsize


def step_bytes(model, cache, T: int, B: int, dtype) -> int:
    """What one decode step must move at least: every weight once, plus the state (converted layers)
    and the keys/values of T tokens (softmax layers) read once."""
    c = model.config
    conv = getattr(c, "linearize", None)
    softmax_layers = c.num_hidden_layers - (len(conv["layers"]) if conv else 0)
    state = cache.nbytes(linear_only=True) if conv else 0
    return weight_bytes(model) + state + T * kv_bytes_per_token(c, softmax_layers, B, dtype)


# ----------------------------------------------------------------------------- kernels per step


def attention_modules(model) -> list[tuple[int, torch.nn.Module, bool]]:
    """(layer index, attention module, converted?) of every decoder layer."""
    from linearize.arch import get_arch, get_submodule
    from linearize.modeling_linearize import CONVERTED

    spec = get_arch(model.config.model_type)
    return [(i, getattr(block, spec.attention), isinstance(getattr(block, spec.attention), CONVERTED))
            for i, block in enumerate(get_submodule(model, spec.layers))]


def count_kernels(run_step, model, cuda: bool) -> dict:
    """CUDA kernels (on CPU: top-level aten ops, a stand-in) of one call of ``run_step``, in total and
    inside each attention module (softmax or converted), counted with torch.profiler.

    Every attention module runs inside a ``record_function`` range (hooks added for the count only);
    a kernel belongs to a layer when the CPU op that launched it lies inside that layer's range."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    mods = attention_modules(model)
    handles, ranges = [], {}

    def enter(i):
        def hook(mod, args, kwargs=None):
            ranges[i] = record_function(f"{LAYER_RANGE}{i}")
            ranges[i].__enter__()
        return hook

    def leave(i):
        def hook(mod, args, out):
            ranges.pop(i).__exit__(None, None, None)
        return hook

    for i, m, _ in mods:
        handles += [m.register_forward_pre_hook(enter(i)), m.register_forward_hook(leave(i))]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            run_step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    events = list(prof.events())
    if cuda and not hasattr(events[0] if events else None, "linked_correlation_id"):
        # older profilers (torch <= 2.11) hang each kernel on the CPU event that launched it instead
        units = [(k, e) for e in events if e.device_type == DeviceType.CPU for k in getattr(e, "kernels", [])]
    elif cuda:
        by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0}
        units = [(e, by_id.get(e.linked_correlation_id)) for e in events if _is_kernel(e, DeviceType)]
    else:
        units = [(e, e) for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
                 and not _has_aten_ancestor(e)]
    per_layer = {i: 0 for i, _, _ in mods}
    for _, anchor in units:
        layer = _layer_of(anchor)
        if layer is not None:
            per_layer[layer] += 1
    conv = [per_layer[i] for i, _, c in mods if c]
    soft = [per_layer[i] for i, _, c in mods if not c]
    rec = {"unit": "CUDA kernels" if cuda else "aten ops (CPU stand-in for kernels)", "total": len(units),
           "per_layer": [per_layer[i] for i, _, _ in mods],
           "per_converted_layer": round(sum(conv) / len(conv), 1) if conv else None,
           "per_softmax_layer": round(sum(soft) / len(soft), 1) if soft else None,
           "unattributed": sum(1 for _, a in units if a is None)}
    if units and not any(rec["per_layer"]):
        # the profiler linked no kernel to the op that launched it: a per-layer count of 0 would read
        # as a target met, so there is none
        rec.update(status="fail", per_converted_layer=None, per_softmax_layer=None,
                   message=f"{len(units)} kernels seen, none attributed to a layer (profiler without correlation ids)")
    return rec


def _has_aten_ancestor(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def _layer_of(e) -> int | None:
    while e is not None:
        if e.name.startswith(LAYER_RANGE):
            return int(e.name[len(LAYER_RANGE):])
        e = e.cpu_parent
    return None


def kernels_in_replay(step, ids, pos) -> int | None:
    """Device kernels the profiler sees in one call of a captured / compiled step (None if it sees
    none: a CUDA graph's kernels are not reported by every profiler build)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids, pos)
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if _is_kernel(e, DeviceType))
    return n or None


def _is_kernel(e, DeviceType) -> bool:
    """A device event that is a kernel: not a copy or fill, not the GPU side of an annotation range."""
    return (e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("Memcpy", "Memset", LAYER_RANGE)))


# ----------------------------------------------------------------------------- the runners


class Measure:
    """Prefill, decode and kernel-count measurements on one device and dtype. Each returns the
    point's record (a dict); the caller adds the peak memory and the bookkeeping."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, steps: int, prefill_chunk: int,
                 decode_prefill: int | None, check_prompt: int):
        self.device, self.dtype, self.seed = device, dtype, seed
        self.cuda = device.type == "cuda"
        self.steps, self.prefill_chunk, self.decode_prefill = steps, prefill_chunk, decode_prefill
        self.check_prompt = check_prompt
        self.bandwidth = None  # bytes/s, measured by the runner once per run
        self._compiled = {}  # id(model) -> compiled forward (one per model: its guards and graphs reused)

    def generator(self, salt: int):
        return torch.Generator(device=self.device).manual_seed(self.seed * 1000 + salt)

    def random_ids(self, B, T, vocab, salt):
        return torch.randint(0, vocab, (B, T), device=self.device, generator=self.generator(salt))

    def converted_cache(self, model, B, max_len, static: bool):
        from linearize import LinearizeCache, StaticLinearizeCache

        if static:
            return StaticLinearizeCache(model.config, max_batch_size=B, max_cache_len=max_len, device=self.device,
                                        dtype=self.dtype)
        return LinearizeCache(model.config)

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def forget_compiled(self):
        """Drop the last model's compiled steps: its guards, graphs and CUDA-graph memory pools."""
        self._compiled.clear()
        torch._dynamo.reset()
        if self.cuda:
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()

    # -- prefill

    def prefill_point(self, p, model) -> dict:
        """tokens/s of B x T random tokens in one call or in chunks (``chunkN`` variants), the median of
        up to 3 runs within ~1 s after a warm-up at a shorter length; the cache is freed between runs."""
        from transformers import DynamicCache

        if p.variant.startswith(("graph", "cgraph")):
            return self.prefill_graph_point(p, model)
        chunk = int(p.variant.removeprefix("chunk")) if p.variant.startswith("chunk") else None
        vocab = model.config.vocab_size

        def once(T):
            cache = self.converted_cache(model, p.B, T, static=False) if p.converted else DynamicCache(config=model.config)
            ids = self.random_ids(p.B, T, vocab, salt=T)
            with torch.no_grad():
                prefill(model, ids, cache, chunk)
            del cache, ids

        once(min(p.T, 2 * chunk if chunk else 4096))  # warm-up: kernels compiled, allocator primed
        # each run's cache and activations are freed on return (no reference cycles)
        ms, repeats = self.median_ms(lambda: once(p.T))
        return {"ms": round(ms, 3), "tokens_per_s": round(p.B * p.T / ms * 1e3, 1), "repeats": repeats,
                "cache": "LinearizeCache" if p.converted else "DynamicCache", "chunk": chunk}

    def median_ms(self, run, setup=None) -> tuple[float, int]:
        """(median ms, runs) of ``run()``: up to 3 runs within ~1 s, peak memory counted from the first;
        ``setup()`` runs untimed before each."""
        timer = Timer(self.device)
        self.reset_peak()
        times = []
        while len(times) < 3 and (not times or sum(times) < 1000):
            if setup is not None:
                setup()
            timer.start()
            run()
            times.append(timer.stop())
        return sorted(times)[len(times) // 2], len(times)

    def prefill_graph_point(self, p, model) -> dict:
        """tokens/s of a chunked prefill whose full chunks replay one captured chunk
        (``linearize.PrefillGraph`` over a ``StaticLinearizeCache``), the graph captured once before
        the timed runs (as a server would, once per batch size and chunk length; its capture time is
        recorded) and the cache reset between runs. ``cgraphN``: the captured chunk is the forward
        compiled by Inductor (``PrefillGraph(..., compile=True)``). Either way the last logits are
        checked against an eager chunked prefill's. On CPU (``--smoke``) the same chunks run eagerly
        over the static cache."""
        from linearize.graphs import PrefillGraph

        compiled = p.variant.startswith("cgraph")
        chunk = int(p.variant.removeprefix("cgraph" if compiled else "graph"))
        cache = self.converted_cache(model, p.B, p.T, static=True)
        ids = self.random_ids(p.B, p.T, model.config.vocab_size, salt=p.T)
        t = time.perf_counter()
        if self.cuda:
            run = PrefillGraph(model, cache, p.B, chunk, compile=compiled)
        else:
            def run(x):
                with torch.no_grad():
                    return prefill(model, x, cache, chunk)
        capture_s = time.perf_counter() - t
        ms, repeats = self.median_ms(lambda: run(ids), setup=cache.reset)
        rec = {"ms": round(ms, 3), "tokens_per_s": round(p.B * p.T / ms * 1e3, 1), "repeats": repeats,
               "cache": "StaticLinearizeCache", "chunk": chunk, "capture_s": round(capture_s, 2), "graph": self.cuda}
        # a fast prefill that computes something else is no result, captured or compiled (the captured
        # chunks of lolcats with sinks once ran on a wrongly reset cache, unchecked: 2026-11-29e)
        cache.reset()
        with torch.no_grad():
            got = run(ids).float()
            ref = prefill(model, ids, self.converted_cache(model, p.B, p.T, static=False), chunk).float()
            # the same logits by another valid eager path (one call): how far rounding alone moves
            # them on this model and length, which the compiled chunks may also differ by
            one = prefill(model, ids, self.converted_cache(model, p.B, p.T, static=False)).float()
        what = "compiled" if compiled else "captured"
        verdict = judge_graph_prefill(got, ref, one, self.dtype, what=what)
        if verdict.pop("needs_float32", False):  # beyond the 16-bit tolerance: a float32 copy decides
            exact = float32_prefill(self, model, ids, p.T, chunk)
            verdict = judge_graph_prefill(got, ref, one, self.dtype, exact, what=what)
        if compiled:
            rec["compile"] = "inductor, default mode, captured by PrefillGraph" if self.cuda else "none (CPU smoke)"
        rec.update(verdict)
        del run, cache, ids
        return rec

    # -- decode

    def decode_setup(self, p, model, max_len: int):
        """(step function, cache, note on the state) for a decode point at context p.T."""
        gen = self.generator(p.T + p.B)
        if not p.converted:
            if p.variant == "eager-dynamic":
                cache = dynamic_cache_random(model, p.B, p.T, gen)
                return eager_stepper(model, cache), cache, "random K/V of T tokens"
            cache = static_cache_random(model, p.B, p.T, max_len, gen)
        else:
            cache = self.converted_cache(model, p.B, max_len, static=p.variant != "eager-default")
            P = self.state_tokens(model, p.T)
            with torch.no_grad():
                prefill(model, self.random_ids(p.B, P, model.config.vocab_size, salt=7), cache, self.prefill_chunk)
        note = ("random K/V of T tokens" if not p.converted else "real prefill of all T tokens" if
                self.state_tokens(model, p.T) == p.T else
                f"real prefill of {self.state_tokens(model, p.T)} tokens, positions from T")
        if p.variant == "eager-default":
            return eager_stepper(model, cache), cache, note
        if p.variant == "compiled-static" or (p.variant == "compiled-graph" and not self.cuda):
            return self.compiled_stepper(model, cache), cache, note
        return self.graph_or_eager(model, cache, p.B, compile=p.variant == "compiled-graph"), cache, note

    def state_tokens(self, model, T: int) -> int:
        """Tokens of real prefill behind a preset's decode state at context T: ``--decode-prefill``
        (a linear state's size and cost do not grow with T), but all T where softmax layers remain
        (a hybrid's keys/values must hold the whole context, as the original's do)."""
        c = model.config
        if len(c.linearize["layers"]) < c.num_hidden_layers:
            return T
        return min(T, self.decode_prefill or T)

    def graph_or_eager(self, model, cache, B, compile: bool = False):
        if not self.cuda:
            return eager_stepper(model, cache)  # --smoke on CPU: the static cache, stepped eagerly
        from linearize.graphs import DecodeGraph

        with torch.no_grad():
            graph = DecodeGraph(model, cache, B, compile=compile)
        return graph.step

    def compiled_stepper(self, model, cache):
        """What ``generate(cache_implementation="static")`` runs on CUDA: the forward under
        ``torch.compile(fullgraph=True, dynamic=False, mode="reduce-overhead")`` (transformers'
        CompileConfig defaults). On CPU: dynamo with the eager backend (the trace, not the speed)."""
        fwd = self._compiled.get(id(model))
        if fwd is None:
            kw = {"mode": "reduce-overhead"} if self.cuda else {"backend": "eager"}
            fwd = self._compiled[id(model)] = torch.compile(model.forward, fullgraph=True, dynamic=False, **kw)

        def step(ids, pos):
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
            return fwd(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

        return step

    def decode_point(self, p, model) -> dict:
        from linearize.graphs import CacheSnapshot

        max_len = p.T + DECODE_WARMUP + self.steps + CACHE_MARGIN
        t = time.perf_counter()
        ids = self.random_ids(p.B, 1, model.config.vocab_size, salt=11)
        pos = torch.full((p.B, 1), p.T, dtype=torch.long, device=self.device)
        step, cache, note = self.decode_setup(p, model, max_len)
        compiled_diff = None
        if p.variant in COMPILED:
            # the compiled step must compute what an eager step computes from the same state
            snap = CacheSnapshot(cache)
            with torch.no_grad():
                ref = eager_stepper(model, cache)(ids, pos).float()
                for _ in range(2 if self.cuda else 1):  # on CUDA the first call compiles, the second records
                    snap.restore()
                    got = step(ids, pos).float()
            snap.restore()
            compiled_diff = float((got - ref).abs().max() / ref.abs().max())
            del snap, ref, got
        setup_s = time.perf_counter() - t
        bytes_moved = step_bytes(model, cache, p.T, p.B, self.dtype)
        self.reset_peak()  # peak memory of decoding: the cache as set up, plus the steps
        timer = Timer(self.device)
        with torch.no_grad():
            for i in range(DECODE_WARMUP + self.steps):
                if i == DECODE_WARMUP:
                    timer.start()
                logits = step(ids, pos)
                ids = logits.argmax(-1, keepdim=True)
                pos = pos + 1
            total = timer.stop()
            seen = None
            if self.cuda and p.variant in ("graph-static", *COMPILED):
                try:
                    seen = kernels_in_replay(step, ids, pos)
                except Exception:  # noqa: BLE001 - an informative count, never worth the point
                    seen = None
        ms = total / self.steps
        floor_ms = bytes_moved / self.bandwidth * 1e3 if self.bandwidth else None
        rec = {"ms": round(ms, 4), "tokens_per_s": round(p.B * 1e3 / ms, 1), "steps": self.steps, "state": note,
               "cache": type(cache).__name__, "graph": self.cuda and p.variant == "graph-static",
               "setup_s": round(setup_s, 2), "bytes_per_step": bytes_moved,
               "floor_ms": round(floor_ms, 4) if floor_ms else None,
               "x_floor": round(ms / floor_ms, 1) if floor_ms else None}
        if p.variant in COMPILED:
            rec["compile"] = (("inductor, mode=reduce-overhead" if p.variant == "compiled-static" else
                               "inductor, default mode, captured by DecodeGraph") if self.cuda else
                              "dynamo, backend=eager (CPU smoke)")
            rec["rel_logit_diff_vs_eager"] = compiled_diff
            # bf16: Inductor fuses and rounds differently from eager; the original's own compiled step
            # differs from its eager step by ~4% of the largest logit on random weights (H200, torch 2.11)
            tol = 1e-4 if self.dtype.itemsize == 4 else 1e-1
            if not compiled_diff <= tol:  # a fast step that computes something else is no result
                rec.update(status="fail", message=f"the compiled step's logits differ from an eager step's from the "
                                                  f"same state by {compiled_diff:.3g} of the largest (tol {tol})")
        if seen is not None:
            rec["kernels_seen_in_step"] = seen
        return rec

    # -- kernels

    def kernels_point(self, p, model) -> dict:
        """Kernels of one eager decode step over the static cache: the kernels a DecodeGraph captures."""
        max_len = p.T + 8 + CACHE_MARGIN
        gen = self.generator(p.T + p.B)
        if p.converted:
            cache = self.converted_cache(model, p.B, max_len, static=True)
            P = min(p.T, self.decode_prefill or p.T, 256)  # the state's size does not depend on it
            with torch.no_grad():
                prefill(model, self.random_ids(p.B, P, model.config.vocab_size, salt=7), cache)
        else:
            cache = static_cache_random(model, p.B, p.T, max_len, gen)
        step = eager_stepper(model, cache)
        ids = self.random_ids(p.B, 1, model.config.vocab_size, salt=11)
        pos = torch.full((p.B, 1), p.T, dtype=torch.long, device=self.device)
        with torch.no_grad():
            for _ in range(2):  # warm: lazy allocations and Triton compilation are not a step's kernels
                step(ids, pos)
                pos = pos + 1
            rec = count_kernels(lambda: step(ids, pos), model, self.cuda)
        rec["cache"] = type(cache).__name__
        return rec


def float32_prefill(m, model, ids, max_len: int, chunk: int | None = None) -> torch.Tensor:
    """Last logits of an eager prefill of ``ids`` through a float32 copy of ``model`` (one call, or
    ``chunk`` tokens at a time): the reference a 16-bit result's rounding is measured against."""
    import copy

    exact = copy.deepcopy(model).float()
    with torch.no_grad():
        return prefill(exact, ids, m.converted_cache(exact, ids.shape[0], max_len, False), chunk).float()


NOISE_FACTOR = 1.5  # chunked may be this much further from float32 than the 16-bit one call


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def _within_rounding(rec: dict, name: str) -> bool:
    """Whether the 16-bit result ``rec[name]`` (its distance from the float32 one call) is within
    NOISE_FACTOR of the 16-bit one call's own distance; False without a float32 reference."""
    return "one_call_vs_float32" in rec and rec[name] <= NOISE_FACTOR * rec["one_call_vs_float32"]


def judge_graph_prefill(got, ref, one, dtype, exact=None, what: str = "compiled") -> dict:
    """The check of a captured chunked prefill (``graphN``, ``what="captured"``) or a compiled one
    (``cgraphN``): its last logits ``got`` against an eager
    chunked prefill's ``ref``. Within the tolerance (the dtype's, or twice how far the eager one
    call ``one`` is from ``ref``: rounding alone moves them that much) it passes. Beyond it, in 16
    bits, ``exact`` (a float32 copy's eager chunks) decides as ``check_chunked`` does: the
    compiled chunks may be at most ``NOISE_FACTOR`` times as far from it as the eager 16-bit chunks
    are. Returns the record's fields: "status": "fail" with a message when it fails, and
    "needs_float32": True when only ``exact``, not given, can decide."""
    rel, eager_spread = _rel(got, ref), _rel(one, ref)
    tol = max(1e-4 if dtype.itemsize == 4 else 1e-1, 2 * eager_spread)
    out = {"rel_logit_diff_vs_eager": rel, "rel_logit_diff_one_call_vs_chunks": eager_spread}
    if rel <= tol:
        return out
    why = (f"the {what} chunks' last logits differ from an eager chunked prefill's by {rel:.3g} (relative; "
           f"tol {tol:.3g}: the larger of the dtype's and twice the eager one call's {eager_spread:.3g})")
    if dtype.itemsize == 4:
        return {**out, "status": "fail", "message": why}
    if exact is None:
        return {**out, "needs_float32": True}
    mine, eager = _rel(got, exact), _rel(ref, exact)
    out.update(compiled_vs_float32=mine, eager_chunks_vs_float32=eager)
    if mine <= NOISE_FACTOR * eager:
        return {**out, "judged_by": "float32"}
    return {**out, "status": "fail", "message": f"{why}, and {mine:.3g} from a float32 copy's, more than "
                                                f"{NOISE_FACTOR}x the eager 16-bit chunks' {eager:.3g}"}
