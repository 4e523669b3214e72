"""Token-equality checks of the end-to-end benchmark: a decode path is only timed after it produced
the same tokens (and logits) as plain eager decoding.

  graph-vs-eager   greedy tokens of the DecodeGraph replay (CUDA) equal eager decoding over the same
                   static cache; on CPU the static cache, stepped eagerly, against the default cache.
                   Also: no host read of a tensor inside a static decode step (capture needs none).
  chunked-prefill  chunked prefill through the converted model's cache continues from its state:
                   the last logits equal one call's (within the dtype's tolerance, or, in 16 bits,
                   at most 1.5x as far from a float32 copy's one call as the 16-bit one call is:
                   a random model's own bf16 rounding can exceed any fixed tolerance).
  generate-static  ``generate(cache_implementation="static")`` gives the tokens of ``generate()``.

A chunked prefill point of PrefillGraph (``graphN``, or compiled: ``cgraphN``) is judged where it is
measured, by ``judge_graph_prefill``: its last logits against an eager chunked prefill's.
"""

from __future__ import annotations

import time

import torch

from .measure import CACHE_MARGIN, NOISE_FACTOR, _rel, _within_rounding, eager_stepper, float32_prefill, prefill

CHECK_TOKENS = 16


def _greedy(step, first_logits, start, n):
    ids = first_logits.argmax(-1, keepdim=True)
    toks, logits = [ids], []
    pos = torch.full_like(ids, start)
    for _ in range(n - 1):
        out = step(ids, pos)
        logits.append(out.float().clone())
        ids = out.argmax(-1, keepdim=True)
        toks.append(ids)
        pos = pos + 1
    return torch.cat(toks, 1), logits


def check_graph(m, model, converted: bool) -> dict:
    """Greedy tokens of the graph (CUDA) equal eager decoding over the same static cache class.

    On CPU the static cache steps eagerly and is compared with the default cache instead."""
    from transformers import DynamicCache, StaticCache

    from linearize.graphs import HostReads

    B, P, n = 2, m.check_prompt, CHECK_TOKENS
    prompt = m.random_ids(B, P, model.config.vocab_size, salt=3)
    max_len = P + n + CACHE_MARGIN

    def static():
        if converted:
            return m.converted_cache(model, B, max_len, static=True)
        return StaticCache(config=model.config, max_cache_len=max_len)

    def default():
        return m.converted_cache(model, B, max_len, static=False) if converted else DynamicCache(config=model.config)

    runs = {}
    with torch.no_grad():
        for name, make, graph in (("eager-static", static, False), ("eager-default", default, False),
                                  ("graph-static", static, True)):
            if graph and not m.cuda:
                continue
            cache = make()
            first = prefill(model, prompt, cache)
            step = m.graph_or_eager(model, cache, B) if graph else eager_stepper(model, cache)
            if name == "eager-static":
                # what capture needs, checked on any device: no host read of a tensor in the step
                with HostReads() as reads:
                    runs[name] = _greedy(step, first, P, 2)
                cache = make()
                first = prefill(model, prompt, cache)
                step = eager_stepper(model, cache)
            runs[name] = _greedy(step, first, P, n)
            del cache, step
    ref_t, ref_l = runs["eager-static"]
    cand = "graph-static" if m.cuda else "eager-default"
    t, lg = runs[cand]
    same = bool((t == ref_t).all())
    # random weights with tied embeddings mostly predict the input token again, so equal tokens
    # alone prove little: every step's logits must agree too
    scale = max(float(x.abs().max()) for x in ref_l)
    diff = max(float((a - b).abs().max()) for a, b in zip(lg, ref_l)) / scale
    tol = 1e-4 if m.dtype.itemsize == 4 else 2e-2
    host = sorted(set(reads.found))
    rec = {"status": "ok" if same and diff <= tol and not host else "fail", "compared": f"{cand} vs eager-static",
           "tokens": n, "batch": B, "prompt": P, "rel_logit_diff": diff, "tolerance": tol,
           "host_reads_per_step": host, "ref_tokens": ref_t.tolist(), "cand_tokens": t.tolist()}
    if m.cuda:  # info: the default cache (another code path) against the static one
        rec["default_cache_agreement"] = float((runs["eager-default"][0] == ref_t).float().mean())
    if not same:
        first = int((t != ref_t).any(0).nonzero()[0])
        rec["message"] = f"tokens differ from step {first}; max relative logit difference {diff:.3g}"
    elif diff > tol:
        rec["message"] = f"same tokens, but logits differ: max relative difference {diff:.3g} > {tol}"
    elif host:
        rec["message"] = f"a decode step reads tensors on the host (no CUDA graph possible): {'; '.join(host[:3])}"
    return rec


def check_chunked(m, model) -> dict:
    """Chunked prefill through the cache continues from the state: same last logits as one call."""
    chunk = min(m.prefill_chunk, 256)
    T = 2 * chunk + 17  # not a multiple of the chunk
    ids = m.random_ids(2, T, model.config.vocab_size, salt=5)
    with torch.no_grad():
        whole = prefill(model, ids, m.converted_cache(model, 2, T, False)).float()
        parts = prefill(model, ids, m.converted_cache(model, 2, T, False), chunk).float()
    rel = _rel(parts, whole)
    tol = 1e-4 if m.dtype.itemsize == 4 else 3e-2
    same_argmax = bool((whole.argmax(-1) == parts.argmax(-1)).all())
    rec = {"status": "ok" if rel <= tol else "fail", "length": T, "chunk": chunk, "rel_diff": rel,
           "tolerance": tol, "same_argmax": same_argmax}
    ref = None
    if m.dtype.itemsize < 4:  # the float32 one call: how far the 16-bit one call itself is from it
        ref = float32_prefill(m, model, ids, T)
        rec["one_call_vs_float32"] = _rel(whole, ref)
        rec["chunked_vs_float32"] = _rel(parts, ref)
        if rel > tol and _within_rounding(rec, "chunked_vs_float32"):
            rec["status"] = "ok"
            rec["judged_by"] = "float32"
    if rec["status"] == "fail":
        rec["message"] = f"relative difference {rel:.3g} > {tol}" + (
            "" if ref is None else f" and {rec['chunked_vs_float32']:.3g} from float32, more than "
                                   f"{NOISE_FACTOR}x the one call's {rec['one_call_vs_float32']:.3g}")
    if m.cuda:  # the same chunks replayed from a captured chunk (PrefillGraph), then one decode step
        from linearize.graphs import PrefillGraph

        dyn, static = m.converted_cache(model, 2, T, False), m.converted_cache(model, 2, T + 1, True)
        nxt = whole.argmax(-1, keepdim=True)
        pos = torch.full_like(nxt, T)
        with torch.no_grad():
            prefill(model, ids, dyn)
            graph = PrefillGraph(model, static, 2, chunk)
            g = graph(ids).float()
            step = [model(input_ids=nxt, position_ids=pos, past_key_values=c, use_cache=True).logits[:, -1].float()
                    for c in (dyn, static)]
        rec["graph_rel_diff"] = _rel(g, whole)
        rec["graph_next_rel_diff"] = _rel(step[1], step[0])
        worst = max(rec["graph_rel_diff"], rec["graph_next_rel_diff"])
        if ref is not None:
            rec["graph_vs_float32"] = _rel(g, ref)
        if worst > tol and not (rec["graph_next_rel_diff"] <= tol and _within_rounding(rec, "graph_vs_float32")):
            rec["status"] = "fail"
            rec["message"] = (rec.get("message", "") + "; " if rec.get("message") else "") + (
                f"PrefillGraph: relative difference {worst:.3g} > {tol} (prompt {rec['graph_rel_diff']:.3g}, "
                f"next step {rec['graph_next_rel_diff']:.3g})")
    return rec


def check_generate(m, model) -> dict:
    """generate(cache_implementation="static") against generate(), greedy (on CUDA transformers
    compiles the static decode step). Random weights mostly repeat the input token, so the
    per-step scores are compared too (recorded, not judged: the compiled step runs other kernels)."""
    ids = m.random_ids(1, 32, model.config.vocab_size, salt=9)
    kw = {"max_new_tokens": CHECK_TOKENS, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        t = time.perf_counter()
        try:
            out = model.generate(ids, cache_implementation="static", **kw)
        except Exception as err:  # noqa: BLE001 - the outcome is recorded, whatever it is
            return {"status": "fail", "message": f"generate(cache_implementation='static') raised "
                                                 f"{type(err).__name__}: {str(err)[:300]}"}
    secs = time.perf_counter() - t
    a, b = ref.sequences[0, 32:].tolist(), out.sequences[0, 32:].tolist()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    scale = max(float(x.float().abs().max()) for x in ref.scores)
    # scores are comparable only while both runs continue the same prefix: up to the first difference
    upto = len(ref.scores) if first is None else first + 1
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(ref.scores[:upto], out.scores[:upto])) / scale
    rec = {"status": "ok" if first is None else "fail", "seconds": round(secs, 1), "rel_score_diff": diff,
           "default_tokens": a, "static_tokens": b}
    msg = "same tokens" if first is None else f"tokens differ from generate() with the default cache from step {first + 1}"
    if first is not None and first < min(len(a), len(b)):
        s = ref.scores[first][0].float()
        top2 = s.topk(2).values
        rec["first_difference"] = {"step": first + 1, "default_top2_gap": float(top2[0] - top2[1]) / scale,
                                   "static_choice_below_default_best": float(s.max() - s[b[first]]) / scale}
        msg += (f" (there the default's scores put the static run's token "
                f"{rec['first_difference']['static_choice_below_default_best']:.2g} of the largest score below its best)")
    rec["message"] = msg + f"; max score difference up to there {diff:.2g} of the largest"
    return rec


def run_check(m, p, model) -> dict:
    if p.variant == "graph-vs-eager":
        return check_graph(m, model, p.converted)
    if p.variant == "chunked-prefill":
        return check_chunked(m, model)
    return check_generate(m, model)
