"""Normalized feature-map linear attention in plain PyTorch: parallel, recurrent and chunkwise forms.

Notation (one batch row and head; all math in float32 or float64):

    S(u) = sum_{s <= u} G(s, u) phi(k_s)^T [v_s, 1]         state at key position u, (F, Dv + 1)
    G(s, u) = exp(cum_u - cum_s),  cum_u = sum_{r <= u} log_g_r  decay over (s, u]; 1 without a gate

The last column of S is the normalizer z = sum phi(k_s): carrying ``[v, 1]`` gets numerator and
denominator from one product. For a query at position t:

    no window:   o_t = phi(q_t) S(t)[:, :Dv] / (phi(q_t) S(t)[:, Dv] + eps)
    window W:    the newest W keys (t-W, t] enter through softmax of a_ts = scale * q_t . k_s,
                 the older ones (s <= t-W) through phi(q_t) S(t-W) decayed to t, under one normalizer
                 (the LoLCATs layer):
                 o_t = (sum_w exp(a_ts - m) v_s + gamma lin_num) / (sum_w exp(a_ts - m) + gamma lin_den),
                 m = max_w a_ts, gamma > 0 a learned weight per head. As in LoLCATs the linear terms
                 are read on the scale of the window's shifted scores (each <= 1), which suits
                 normalised features like Hedgehog's; the denominator is >= 1, so it never blows up.
    sinks S:     the document's first S keys (attention sinks) join the softmax set w where they are
                 not in the window already: w = {t-W < s <= t} u {d_t <= s < d_t + S, s <= t}, d_t
                 the start of t's document (0 without packing); the linear part is unchanged (it
                 still covers every key s <= t-W, sinks included).

The key "timeline" may start with ``prefix`` keys that have no query: the cache passes its window
buffer that way. ``key_valid`` marks padding: a pad key adds nothing to the state, does not decay
it and is masked out of the window. The final state covers every key except the newest W-1 (which
stay in the window buffer); ``initial_state`` covers everything before the timeline.

Shapes: qf (B, Tq, H, F); kf (B, N, H, F); v (B, N, H, Dv); log_g (B, N, H) or (B, N, H, F);
q_sm (B, Tq, H, D); k_sm (B, N, H, D); key_valid (B, N) bool; Tq = N - prefix.
State: a tuple (S (B, H, F, Dv), z (B, H, F)), float32 (or float64 in tests).
"""

from __future__ import annotations

import os
import warnings

import torch

try:  # optional: remote-code checkpoints run without the kernels (the PyTorch path below)
    from linearize.kernels import linear_attn as _la_kernels
    from linearize.kernels import decode_linear as _gemv
    from linearize.kernels import ops as _ops  # noqa: F401  (registers torch.ops.linearize.*)
except Exception as _e:  # triton missing, or no linearize.kernels next to these files
    _la_kernels, _gemv, _KERNELS_ERROR = None, None, _e
else:
    _KERNELS_ERROR = None

State = tuple[torch.Tensor, torch.Tensor]


# The log decay that resets a state at a document restart on the chunk kernels: exp(-128) is 0 in
# float32 (below its smallest subnormal), and every exp the kernels take of a cumulative log decay
# has a non-positive argument, so nothing overflows. A power of two: for layers without a decay the
# kernels' in-chunk cumulative sums stay exact; with a real decay they carry ~1e-5 absolute rounding
# (the float32 spacing at 128 times the restarts in the chunk), float32 noise next to bf16 training.
RESET_LOG_DECAY = 128.0

def linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    log_g: torch.Tensor | None = None,
    initial_state: State | None = None,
    key_valid: torch.Tensor | None = None,
    window: int = 0,
    q_sm: torch.Tensor | None = None,
    k_sm: torch.Tensor | None = None,
    sm_scale: float = 1.0,
    softcap: float | None = None,
    window_weight: torch.Tensor | float = 1.0,
    prefix: int = 0,
    eps: float = 1e-6,
    form: str = "chunk",
    chunk_size: int = 64,
    state_in_place: bool = False,
    doc: torch.Tensor | None = None,
    sinks: int = 0,
    sink_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, State]:
    """Returns ``o (B, Tq, H, Dv)`` in v's dtype and the final state (S, z) in the compute dtype.

    ``state_in_place``: a decode step on the kernels may advance ``initial_state`` (contiguous fp32)
    in place and return it as the final state (a static cache's storage: no copy in and out).
    ``doc``: (B, N) long, packed rows' document index of each key position (``PackedDocs.doc``,
    non-decreasing along a row; position -1, the initial state, belongs to document 0): no query
    reads a key, a state or a window slot of another document, with shapes that do not depend on
    the packing. The final state holds the row's last document only.
    ``sinks``: the number of attention sinks (window > 0): without ``sink_cache`` the first
    ``sinks`` valid keys of each query's document in the timeline (no prefix or initial state).
    ``sink_cache``: the sinks as a cache holds them, for a call that continues a cached state:
    keys (B, S, H, D), values (B, S, H, Dv) and (B, Tq, S) bool, which sinks each query reads."""
    if form not in _FORMS:
        raise ValueError(f"form must be one of {sorted(_FORMS)}, got {form!r}")
    if doc is not None and prefix:
        raise ValueError("doc (packed documents) takes no prefix: packed rows run without a cache")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if sinks and not window:
        raise ValueError(f"sinks need a window > 0 (they join its softmax part); pass window >= 1 or sinks=0, "
                         f"got sinks={sinks}")
    if sink_cache is not None:
        sinks = sink_cache[0].shape[1]
    if sinks and (prefix or initial_state is not None) and sink_cache is None:
        raise ValueError("sinks with a cached prefix (or an initial_state) need the cached sinks: pass sink_cache")
    channel = log_g is not None and log_g.dim() == 4
    if form == "chunk" and channel and use_kernels(qf) and (window or prefix):
        # not silent: the math below holds (chunk x chunk x feature) decays, several times slower than a kernel
        _warn_once("per-channel decay gates (decay='channel') have no Triton kernel beside a window: the "
                   "PyTorch math runs, several times slower; decay='scalar' runs on the kernels")
    if form == "chunk" and prefix == 0 and not (channel and window) and use_kernels(qf):
        if not window:
            if doc is not None:  # a document restart resets the state: a decay of 0 there
                log_g = _reset_gate(doc, log_g, qf.shape[:3] if log_g is None else log_g.shape)
            return _triton_chunk(qf, kf, v, log_g, initial_state, key_valid, eps, state_in_place)
        if (initial_state is None and softcap is None and sink_cache is None
                and (key_valid is None or bool(key_valid.all()))):
            return _triton_window(qf, kf, v, log_g, q_sm, k_sm, sm_scale, window, window_weight, doc, sinks)
    if window and (q_sm is None or k_sm is None):
        raise ValueError("window > 0 needs q_sm and k_sm (the raw queries and keys for the softmax part)")
    out_dtype = v.dtype
    dt = torch.float64 if qf.dtype == torch.float64 else torch.float32
    B, N, H, Dv = v.shape
    Tq = qf.shape[1]
    if Tq != N - prefix:
        raise ValueError(f"queries ({Tq}) must cover the timeline ({N}) minus the prefix ({prefix})")

    # (B, H, T, *) layout for the math
    q = qf.to(dt).transpose(1, 2)
    k = kf.to(dt).transpose(1, 2)
    v1 = torch.cat([v.to(dt), v.new_ones(B, N, H, 1, dtype=dt)], dim=-1).transpose(1, 2)
    lg = None if log_g is None else log_g.to(dt).transpose(1, 2)
    valid = None
    if key_valid is not None:
        valid = key_valid.to(torch.bool)[:, None, :]  # (B, 1, N)
        k = torch.where(valid[..., None], k, 0.0)
        v1 = torch.where(valid[..., None], v1, 0.0)
        if lg is not None:
            lg = torch.where(valid[..., None] if lg.dim() == 4 else valid, lg, 0.0)
    if lg is None:
        cum = None
    else:
        cum = torch.cumsum(lg, dim=2)
        # cum_pad[:, :, u + 1] = cum_u, with cum_{-1} = 0
        cum = torch.cat([torch.zeros_like(cum[:, :, :1]), cum], dim=2)
    F = q.shape[-1]
    if initial_state is None:
        S0 = q.new_zeros(B, H, F, Dv + 1)
    else:
        S0 = torch.cat([initial_state[0].to(dt), initial_state[1].to(dt)[..., None]], dim=-1)

    ctx = _Ctx(q, k, v1, cum, S0, window, prefix, N, Dv, doc)
    lin, S_final = _FORMS[form](ctx, chunk_size)  # lin: (B, H, Tq, Dv + 1)

    lin_num, lin_den = lin[..., :Dv], lin[..., Dv]
    if window:
        qs = q_sm.to(dt).transpose(1, 2)
        ks = k_sm.to(dt).transpose(1, 2)
        vv = v1[..., :Dv]
        # (1, H or 1, 1); a number becomes a tensor by a fill on the device, not a copy from the host (a CUDA graph
        # capturing a chunked prefill cannot copy)
        gamma = (q.new_full((1,), float(window_weight), dtype=dt) if isinstance(window_weight, (int, float)) else
                 torch.as_tensor(window_weight, dtype=dt, device=q.device)).reshape(-1)[None, :, None]
        if sink_cache is not None:
            sk, sv, sok = sink_cache
            sink_cache = (sk.to(dt).transpose(1, 2), sv.to(dt).transpose(1, 2), sok)
        out = _window_combine(qs, ks, vv, valid, lin_num, lin_den, window, prefix, sm_scale, softcap, gamma, chunk_size,
                              doc, sinks, sink_cache)
    else:
        out = lin_num / (lin_den[..., None] + eps)
    return out.transpose(1, 2).to(out_dtype), (S_final[..., :Dv], S_final[..., Dv])


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run this call. ``LINEARIZE_KERNELS``: ``auto`` (default: on CUDA,
    or on CPU under ``TRITON_INTERPRET=1``), ``triton`` (always; fails if they cannot load) or
    ``torch`` (never). The kernels are torch.library ops, so compiled code (``torch.compile``,
    transformers' static-cache generate) runs them too."""
    mode = os.environ.get("LINEARIZE_KERNELS", "auto")
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"LINEARIZE_KERNELS must be auto, triton or torch, got {mode!r}")
    if mode == "torch" or (mode == "auto" and not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    if _la_kernels is None:
        message = (f"the Triton kernels cannot be imported ({_KERNELS_ERROR!r}): install triton and linearize, "
                   "or set LINEARIZE_KERNELS=torch to run the PyTorch math on purpose")
        if mode == "triton":
            raise RuntimeError(message)
        if x.is_cuda:  # not silent: the PyTorch math is several times slower on a GPU
            _warn_once(message + "; running the PyTorch math")
        return False
    return True


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is a decode step's projection the decode GEMV takes: at most
    MAX_ROWS rows, gradients off, the kernels on, x in the weight's dtype."""
    return (not torch.is_grad_enabled() and x.dim() >= 2 and x.dtype == weight.dtype and use_kernels(x)
            and x.numel() // x.shape[-1] <= _gemv.MAX_ROWS)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a decode step's (a few rows, no gradients, the kernels on) on
    the decode GEMV (kernels/decode_linear.py): cuBLAS gives a batch-1 projection of a small model
    a handful of thread blocks, the GEMV spreads it over the SMs. ``weight``: a module's parameter
    or a copy of parameters built before the forward's layers run (``refresh_decode_weights``),
    never the output of the op just before, so the GEMV may read it early (``weight_ready``)."""
    if _few_rows(x, weight):
        return _gemv.decode_linear(x, weight, bias, weight_ready=True)
    return torch.nn.functional.linear(x, weight, bias)


def project_with(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through :func:`project` when the module is a plain ``nn.Linear`` (a LoRA
    adapter or any other module runs itself)."""
    if type(module) is torch.nn.Linear:
        return project(x, module.weight, module.bias)
    return module(x)


def gated_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``down(silu(gate(x)) * up(x))`` of a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``
    plain nn.Linear, no bias on the first two, SiLU) on two decode GEMVs, or None where the GEMVs do
    not apply (see :func:`project`) or the module is not such an MLP."""
    g, u, d = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    act = type(getattr(mlp, "act_fn", None))
    silu = act is torch.nn.SiLU or (act.__name__ == "SiLUActivation" and act.__module__ == "transformers.activations")
    if not (silu and type(g) is type(u) is type(d) is torch.nn.Linear and g.bias is None and u.bias is None
            and _few_rows(x, g.weight)):
        return None
    return project(_gemv.decode_gated(x, g.weight, u.weight, weight_ready=True), d.weight, d.bias)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


_WARNED: set[str] = set()


def kernel_dtype(x: torch.Tensor, activation_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels are fed (they accumulate and keep states in fp32 either way). On CUDA a
    bf16/fp16 model, or an fp32 model under autocast (training), feeds its half dtype: the matmuls
    then run on tensor cores. An fp32 model keeps exact fp32 (``input_precision="ieee"``: several
    times slower on the GPU, bit-for-bit closer to the PyTorch path), and so does the CPU interpreter."""
    if x.is_cuda:
        if torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda")
        if activation_dtype in (torch.bfloat16, torch.float16):
            return activation_dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


DECODE_TOKENS = 16  # calls with a state and at most this many tokens take the recurrent decode kernels


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def hedgehog_decode(q, k, v, wq, wk, log_g, valid, state, eps, state_in_place=False, cos=None, sin=None):
    """A decode step of Hedgehog linear attention with the feature maps inside the kernel (one launch
    instead of the maps' matmuls, softmaxes and casts). q (B, T, H, D), k and v (B, T, Hkv, D) raw
    (after RoPE, or before it when ``cos``/``sin`` are given: the kernel rotates them), possibly
    strided views of one projection output; wq/wk (H, D, F/2); returns o (B, T, H, Dv) in v's dtype
    and the new (S, z)."""
    S, z = state
    if not (state_in_place and S.dtype == z.dtype == torch.float32 and S.is_contiguous() and z.is_contiguous()):
        S, z = (x.float().clone(memory_format=torch.contiguous_format) for x in state)
    dt = kernel_dtype(q, v.dtype)
    o = _la_kernels.fused_recurrent_hedgehog(q.to(dt), k.to(dt), v.to(dt), wq.to(dt), wk.to(dt), log_g=log_g,
                                              valid=valid, eps=eps, state=(S, z), cos=cos, sin=sin)
    return o.to(v.dtype), (S, z)


def hedgehog_window_decode(q, k, v, wq, wk, **kwargs):
    """A decode step of the window hybrid with Hedgehog's feature maps inside the kernel: one launch
    reads q (B, T, H, D), k and v (B, T, Hkv, D) raw (after RoPE), the maps' weights wq/wk (H, D, F/2)
    and ``log_gamma``, advances the ring and the state in place and returns o (B, T, H, Dv) in v's
    dtype (see kernels/linear_attn/window_decode.py for the arguments)."""
    dt = kernel_dtype(q, v.dtype)
    return _la_kernels.fused_window_decode_hedgehog(q.to(dt), k.to(dt), v.to(dt), wq, wk, **kwargs).to(v.dtype)


def window_decode(q_sm, qf, k_sm, kf, v, **kwargs):
    """Decode step(s) of the window hybrid on the kernel: the ring buffer of the W-1 newest keys and
    the state (S, z) are advanced in place (see kernels/linear_attn/window_decode.py for the arguments)."""
    return _la_kernels.window_decode(q_sm, qf, k_sm, kf, v, **kwargs)


def window_prefill(q_sm, qf, k_sm, kf, v, **kwargs):
    """A chunk of the window hybrid continuing from a cached state, on the kernels (no loop over
    tokens); returns o and the new (S, z) (see kernels/linear_attn/window_decode.py)."""
    return _la_kernels.window_prefill(q_sm, qf, k_sm, kf, v, **kwargs)


def _triton_chunk(qf, kf, v, log_g, initial_state, key_valid, eps, state_in_place=False):
    """The fused chunkwise kernel (normalizer inside). Padding: a pad key is zeroed and does not decay.
    Per-channel gates (log_g (B, T, H, F)) run their own chunk kernel; their decode steps, as the
    scalar gate's, the fused recurrent step."""
    channel = log_g is not None and log_g.dim() == 4
    if key_valid is not None:
        m = key_valid.to(torch.bool)[:, :, None]
        kf = torch.where(m[..., None], kf, 0.0)
        v = torch.where(m[..., None], v, 0.0)
        log_g = None if log_g is None else torch.where(m[..., None] if channel else m, log_g, 0.0)
    dt = kernel_dtype(qf, v.dtype)
    decode = initial_state is not None and qf.shape[1] <= DECODE_TOKENS and not _needs_grad(qf, kf, v, log_g)
    if channel and not decode:
        o, state = _la_kernels.chunk_linear_attn_channel(qf.to(dt), kf.to(dt), v.to(dt), log_g.float(), normalize=True,
                                                         eps=eps, initial_state=initial_state, output_final_state=True)
        return o.to(v.dtype), state
    if decode:
        # decode: the fused recurrent step (it updates the state it is given: hand it a copy)
        S, z = initial_state
        if not (state_in_place and S.dtype == z.dtype == torch.float32 and S.is_contiguous() and z.is_contiguous()):
            S, z = (x.float().clone(memory_format=torch.contiguous_format) for x in initial_state)
        o = _la_kernels.fused_recurrent_linear_attn(qf.to(dt), kf.to(dt), v.to(dt), log_g=log_g, normalize=True,
                                                   eps=eps, state=(S, z))
        return o.to(v.dtype), (S, z)
    init = None if initial_state is None else (initial_state[0].float().contiguous(), initial_state[1].float().contiguous())
    o, state = _la_kernels.chunk_linear_attn(
        qf.to(dt), kf.to(dt), v.to(dt), log_g=log_g, normalize=True, eps=eps, initial_state=init, output_final_state=True
    )
    return o.to(v.dtype), state


def _triton_window(qf, kf, v, log_g, q_sm, k_sm, sm_scale, window, window_weight, doc=None, sinks=0):
    """Window hybrid from an empty state, linear part and window both on the kernels. ``doc`` (B, T):
    packed documents, static form: each token's document start (``_doc_start``) masks the window's
    older keys, and the kernels reset the linear state at every start (``chunk._window_attn``)."""
    dt = kernel_dtype(qf, v.dtype)
    H = qf.shape[2]
    gamma = torch.as_tensor(window_weight, dtype=dt, device=qf.device).reshape(-1).expand(H)
    o, state = _la_kernels.chunk_linear_attn(
        qf.to(dt), kf.to(dt), v.to(dt), log_g=log_g, window=window, q_sm=q_sm.to(dt), k_sm=k_sm.to(dt),
        sm_scale=sm_scale, window_weight=gamma, output_final_state=True,
        q_lo=None if doc is None else _doc_start(doc), sinks=sinks,
    )
    return o.to(v.dtype), state


def _doc_start(doc: torch.Tensor) -> torch.Tensor:
    """(B, T) int32: the position in its row where each token's document starts (``doc`` (B, T)
    non-decreasing along a row); tensor ops only, no host read."""
    T = doc.shape[1]
    idx = torch.arange(T, device=doc.device).expand_as(doc)
    first = torch.cat([torch.ones_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
    return torch.cummax(torch.where(first, idx, 0), dim=1).values.to(torch.int32)


def reset_log_decay(restart: torch.Tensor, log_g: torch.Tensor | None, shape) -> torch.Tensor:
    """The float32 log decay of ``shape`` ((B, T, H) or (B, T, H, F)) with -RESET_LOG_DECAY where
    ``restart`` (B, T) bool marks a packed document's first token: the state before it is multiplied
    by 0, as if the document ran alone. ``log_g`` None: zeros elsewhere."""
    r = restart.view(*restart.shape, *[1] * (len(shape) - 2))
    base = torch.zeros(shape, dtype=torch.float32, device=restart.device) if log_g is None else log_g.float()
    return torch.where(r, -RESET_LOG_DECAY, base)


def _reset_gate(doc: torch.Tensor, log_g: torch.Tensor | None, shape) -> torch.Tensor:
    """``reset_log_decay`` where ``doc`` (B, T), the packed documents' index, moves to the next document."""
    restart = torch.cat([torch.zeros_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
    return reset_log_decay(restart, log_g, shape)


class _Ctx:
    def __init__(self, q, k, v1, cum, S0, window, prefix, N, Dv, doc=None):
        self.q, self.k, self.v1, self.cum, self.S0 = q, k, v1, cum, S0
        self.lag = window  # query t reads the state at t - lag
        self.keep = max(window - 1, 0)  # newest keys left out of the final state
        self.prefix, self.N, self.Dv = prefix, N, Dv
        self.doc = doc  # (B, N) or None

    def doc_at(self, u: int) -> torch.Tensor:
        """(B,) document of key position u >= -1 (the initial state, u = -1, is document 0's)."""
        return self.doc[:, u] if u >= 0 else torch.zeros_like(self.doc[:, 0])

    def same(self, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
        """(B, 1, len(t), len(s)) bool: key position s is in query position t's document."""
        if self.doc is None:
            return None
        return (self.doc[:, t][:, :, None] == self.doc[:, s][:, None, :])[:, None]

    def reads(self, t: torch.Tensor, u: int) -> torch.Tensor | float:
        """(B, 1, len(t), 1): 1 where query position t may read the state at key position u (same
        document), 0 elsewhere; 1.0 without documents."""
        if self.doc is None:
            return 1.0
        return (self.doc[:, t] == self.doc_at(u)[:, None]).to(self.q.dtype)[:, None, :, None]

    def cum_at(self, u: int) -> torch.Tensor | None:
        """cum at key position u >= -1: (B, H) or (B, H, F)."""
        return None if self.cum is None else self.cum[:, :, max(u, -1) + 1]

    def cum_range(self, a: int, b: int) -> torch.Tensor | None:
        """cum at positions a..b-1 (each >= -1): (B, H, b-a) or (B, H, b-a, F)."""
        return None if self.cum is None else self.cum[:, :, a + 1 : b + 1]


def _decay(cum_to, cum_from):
    """exp(cum_to - cum_from) with broadcasting; 1.0 when there is no gate."""
    if cum_to is None:
        return 1.0
    return torch.exp(cum_to - cum_from)


def _advance(ctx: _Ctx, S: torch.Tensor, u_from: int, u_to: int) -> torch.Tensor:
    """State at key position u_from -> state at u_to (>= u_from), folding keys (u_from, u_to]."""
    lo, hi = max(u_from + 1, 0), min(u_to, ctx.N - 1)
    if u_to <= u_from:
        return S
    c_to, c_from = ctx.cum_at(u_to), ctx.cum_at(u_from)
    S = _scale_state(S, _decay(c_to, c_from))
    if ctx.doc is not None:  # a document restart in (u_from, u_to] drops what came before it
        S = S * (ctx.doc_at(u_to) == ctx.doc_at(u_from)).to(S.dtype)[:, None, None, None]
    if hi < lo:
        return S
    k = ctx.k[:, :, lo : hi + 1]
    if ctx.cum is not None:
        w = torch.exp(c_to.unsqueeze(2) - ctx.cum_range(lo, hi + 1))  # (B, H, n) or (B, H, n, F)
        k = k * (w[..., None] if w.dim() == 3 else w)
    if ctx.doc is not None:  # only the keys of u_to's document
        k = k * (ctx.doc[:, lo : hi + 1] == ctx.doc_at(u_to)[:, None]).to(k.dtype)[:, None, :, None]
    return S + torch.einsum("bhsf,bhsd->bhfd", k, ctx.v1[:, :, lo : hi + 1])


def _scale_state(S, g):
    if isinstance(g, float):
        return S
    return S * (g[..., None, None] if g.dim() == 2 else g[..., None])


def _parallel(ctx: _Ctx, chunk_size: int):
    """Masked quadratic form: every query against every key, O(Tq * N)."""
    q, k, v1 = ctx.q, ctx.k, ctx.v1
    t = torch.arange(ctx.prefix, ctx.N, device=q.device)
    s = torch.arange(ctx.N, device=q.device)
    mask = s[None, :] <= (t[:, None] - ctx.lag)  # (Tq, N)
    if ctx.doc is not None:
        mask = mask & ctx.same(t, s)  # (B, 1, Tq, N)
    if ctx.cum is None:
        A = torch.einsum("bhtf,bhsf->bhts", q, k)
        init = torch.einsum("bhtf,bhfd->bhtd", q, ctx.S0)
    elif ctx.cum.dim() == 3:
        ct, cs = ctx.cum[:, :, t + 1], ctx.cum[:, :, s + 1]
        D = torch.exp((ct[..., :, None] - cs[..., None, :]).masked_fill(~mask, float("-inf")))
        A = torch.einsum("bhtf,bhsf->bhts", q, k) * D
        init = torch.einsum("bhtf,bhfd->bhtd", q, ctx.S0) * torch.exp(ct)[..., None]
    else:
        ct, cs = ctx.cum[:, :, t + 1], ctx.cum[:, :, s + 1]  # (B, H, T, F)
        diff = (ct[:, :, :, None] - cs[:, :, None, :]).masked_fill(~mask[..., None], float("-inf"))
        A = torch.einsum("bhtf,bhsf,bhtsf->bhts", q, k, torch.exp(diff))
        init = torch.einsum("bhtf,bhfd->bhtd", q * torch.exp(ct), ctx.S0)
    lin = init * ctx.reads(t, -1) + torch.einsum("bhts,bhsd->bhtd", A.masked_fill(~mask, 0.0), v1)
    S_final = _advance(ctx, ctx.S0, -1, ctx.N - 1 - ctx.keep)
    return lin, S_final


def _recurrent(ctx: _Ctx, chunk_size: int):
    """One query at a time: fold the key that leaves the window (or the current key), then read."""
    S, u = ctx.S0, -1
    outs = []
    for t in range(ctx.prefix, ctx.N):
        target = t - ctx.lag
        while u < target:  # fold one key: S(u+1) = g_{u+1} S(u) + k^T [v, 1]
            S = _advance(ctx, S, u, u + 1)
            u += 1
        qt = ctx.q[:, :, t - ctx.prefix]
        if ctx.cum is not None:
            g = _decay(ctx.cum_at(t), ctx.cum_at(target))
            qt = qt * (g[..., None] if g.dim() == 2 else g)
        out = torch.einsum("bhf,bhfd->bhd", qt, S)
        if ctx.doc is not None:
            out = out * ctx.reads(torch.tensor([t], device=out.device), target)[:, :, 0]
        outs.append(out)
    S = _advance(ctx, S, u, ctx.N - 1 - ctx.keep)
    return torch.stack(outs, dim=2), S


def _chunk(ctx: _Ctx, chunk_size: int):
    """Queries in chunks of C: the carried state for the part before the chunk, a masked C x C
    block for the keys that became visible inside it. O(N * C) memory."""
    q, k, v1, L = ctx.q, ctx.k, ctx.v1, ctx.lag
    S, u = ctx.S0, -1  # S holds the keys <= u
    outs = []
    for a in range(ctx.prefix, ctx.N, chunk_size):
        b = min(a + chunk_size, ctx.N)
        base = a - L - 1  # the chunk's queries read the state at base, then keys (base, t - L]
        S, u = _advance(ctx, S, u, base), max(u, base)
        qc = q[:, :, a - ctx.prefix : b - ctx.prefix]
        lo, hi = max(a - L, 0), b - 1 - L  # keys that enter inside this chunk
        t = torch.arange(a, b, device=q.device)
        if ctx.cum is None:
            lin = torch.einsum("bhtf,bhfd->bhtd", qc, S)
        else:
            gt = torch.exp(ctx.cum_range(a, b) - ctx.cum_at(base).unsqueeze(2))
            lin = torch.einsum("bhtf,bhfd->bhtd", qc * (gt[..., None] if gt.dim() == 3 else gt), S)
        lin = lin * ctx.reads(t, u)  # S holds the keys <= u: u's document only
        if hi >= lo:
            s = torch.arange(lo, hi + 1, device=q.device)
            mask = s[None, :] <= (t[:, None] - L)
            if ctx.doc is not None:
                mask = mask & ctx.same(t, s)  # (B, 1, C, n)
            kc, vc = k[:, :, lo : hi + 1], v1[:, :, lo : hi + 1]
            if ctx.cum is None:
                A = torch.einsum("bhtf,bhsf->bhts", qc, kc)
            elif ctx.cum.dim() == 3:
                diff = ctx.cum_range(a, b)[..., :, None] - ctx.cum_range(lo, hi + 1)[..., None, :]
                A = torch.einsum("bhtf,bhsf->bhts", qc, kc) * torch.exp(diff.masked_fill(~mask, float("-inf")))
            else:
                diff = ctx.cum_range(a, b)[:, :, :, None] - ctx.cum_range(lo, hi + 1)[:, :, None, :]
                A = torch.einsum("bhtf,bhsf,bhtsf->bhts", qc, kc, torch.exp(diff.masked_fill(~mask[..., None], float("-inf"))))
            lin = lin + torch.einsum("bhts,bhsd->bhtd", A.masked_fill(~mask, 0.0), vc)
        outs.append(lin)
        S, u = _advance(ctx, S, u, b - 1 - L), max(u, b - 1 - L)
    S = _advance(ctx, S, u, ctx.N - 1 - ctx.keep)
    return torch.cat(outs, dim=2), S


_FORMS = {"parallel": _parallel, "recurrent": _recurrent, "chunk": _chunk}


def _window_combine(qs, ks, v, valid, lin_num, lin_den, window, prefix, sm_scale, softcap, gamma, chunk_size,
                    doc=None, sinks=0, sink_cache=None):
    """Softmax over the newest ``window`` keys (and the document's first ``sinks`` keys outside them)
    plus the weighted linear part, one normalizer. Chunked over queries so memory is O(C * (C + W + S)).
    Without ``sink_cache`` (prefix 0): query t's sinks are the keys start_t + j, j < S (start_t:
    its document's start, else the row's first valid key), gathered per query and kept where they
    are older than its window (s <= t - W), so none counts twice. ``sink_cache`` (keys and values
    (B, H, S, *), (B, Tq, S) which count): the cached sinks, as the caller says each query reads them."""
    B, _, N, _ = ks.shape
    if sinks and sink_cache is None:
        if doc is not None:
            start = _doc_start(doc).long()
        elif valid is not None:  # left padding: the sinks are the row's first real tokens
            start = (valid[:, 0].long().cumsum(-1) == 0).sum(-1, keepdim=True).expand(B, N)
        else:
            start = torch.zeros(B, N, dtype=torch.long, device=ks.device)
        j = torch.arange(sinks, device=ks.device)
    outs = []
    for a in range(prefix, N, chunk_size):
        b = min(a + chunk_size, N)
        lo = max(a - window + 1, 0)
        t = torch.arange(a, b, device=qs.device)
        s = torch.arange(lo, b, device=qs.device)
        mask = (s[None, :] <= t[:, None]) & (s[None, :] > t[:, None] - window)  # (C, n)
        mask = mask[None, None]
        if valid is not None:
            mask = mask & valid[:, :, None, lo:b]
        if doc is not None:  # the window's keys of the query's own document
            mask = mask & (doc[:, a:b, None] == doc[:, None, lo:b])[:, None]
        scores = torch.einsum("bhtd,bhsd->bhts", qs[:, :, a - prefix : b - prefix], ks[:, :, lo:b]) * sm_scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sink_cache is not None:  # the same sinks for every query: (B, H, S, *) seen as (B, H, C, S, *)
            k_sink, v_sink = (x[:, :, None].expand(-1, -1, b - a, -1, -1) for x in sink_cache[:2])
            sink_mask = sink_cache[2][:, a - prefix : b - prefix]
        elif sinks:
            sp = start[:, a:b, None] + j  # (B, C, S): the sinks' key positions
            sink_mask = sp <= t[:, None] - window
            sp = sp.clamp(max=N - 1)  # a position past the row is > t: masked already
            if valid is not None:
                sink_mask = sink_mask & torch.gather(valid[:, 0], 1, sp.flatten(1)).view_as(sp)
            k_sink, v_sink = _gather_keys(ks, sp), _gather_keys(v, sp)  # (B, H, C, S, *)
        if sinks:  # scored like the window's keys, in front of them
            sink_scores = torch.einsum("bhtd,bhtjd->bhtj", qs[:, :, a - prefix : b - prefix], k_sink) * sm_scale
            if softcap is not None:
                sink_scores = softcap * torch.tanh(sink_scores / softcap)
            scores = torch.cat([sink_scores.masked_fill(~sink_mask[:, None], float("-inf")), scores], dim=-1)
        m = scores.amax(dim=-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a query with no valid key (padding)
        p = torch.exp(scores - m[..., None])
        g = gamma[..., None]
        num = torch.einsum("bhts,bhsd->bhtd", p[..., sinks:], v[:, :, lo:b])
        if sinks:
            num = num + torch.einsum("bhtj,bhtjd->bhtd", p[..., :sinks], v_sink)
        num = num + g * lin_num[:, :, a - prefix : b - prefix]
        den = p.sum(-1) + gamma * lin_den[:, :, a - prefix : b - prefix]
        outs.append(num / torch.where(den > 0, den, torch.ones_like(den))[..., None])
    return torch.cat(outs, dim=2)


def _gather_keys(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, D) at key positions pos (B, C, S): (B, H, C, S, D)."""
    B, H, _, D = x.shape
    idx = pos.flatten(1)[:, None, :, None].expand(B, H, -1, D)
    return torch.gather(x, 2, idx).view(B, H, *pos.shape[1:], D)
