"""Readable PyTorch references for normalized feature-map linear attention.

Semantics (per batch row and head; ``q, k`` are already feature-mapped)::

    S_t = g_t * S_{t-1} + k_t^T v_t          S: [F, Dv]
    z_t = g_t * z_{t-1} + k_t                z: [F]
    o_t = (q_t S_t) / (q_t . z_t + eps)      normalize=True
    o_t =  q_t S_t                           normalize=False

with ``g_t = exp(log_g_t)`` (1 when ``log_g`` is None).  With a sliding window ``W`` the
newest ``W`` keys (``t-W < s <= t``) are attended with a softmax and the linear state only
covers ``s <= t-W``; the final state then covers every key but the newest W-1 and is decayed to
its own newest key (T-W), so a caller can fold the buffered keys in later with their gates::

    a_ts = sm_scale * q_sm_t . k_sm_s,   m_t = max_win a_ts
    o_t = (sum_win e^{a_ts-m_t} v_s + gamma q_t S^lin_t) / (sum_win e^{a_ts-m_t} + gamma q_t . z^lin_t)
    win = {s : t-W < s <= t}  union  {s : s < sinks, s <= t}

(the LoLCATs layer: the linear terms are read on the scale of the shifted window scores, weighted
by ``window_weight`` gamma, a float or one value per head; the same math as
``linearize.attention``).  The first ``sinks`` keys (attention sinks, as in StreamingLLM; 0 by
default) join the softmax set, each counted once; the linear terms still cover every key s <= t-W,
sinks included.  With ``cu_seqlens`` each sequence is its own: its sinks are its first keys.

Two forms are given: a step-by-step loop (:func:`linear_attn_recurrent_ref`, the definition)
and a masked quadratic form (:func:`linear_attn_ref`, differentiable and fast enough for tests).
Both compute in the dtype of their inputs: pass float64 tensors for a reference.
"""

from __future__ import annotations

import torch

State = tuple[torch.Tensor, torch.Tensor]


def _gamma(window_weight, H, dtype, device) -> torch.Tensor:
    """The window weight as an (H,) tensor."""
    return torch.as_tensor(window_weight, dtype=dtype, device=device).reshape(-1).expand(H)


def _check_window(window, initial_state, normalize, q_sm, k_sm, sm_scale, sinks=0):
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if window == 0:
        if sinks:
            raise ValueError(f"sinks need a window > 0 (they join its softmax part); pass window >= 1 or sinks=0, "
                             f"got sinks={sinks}")
        return
    if initial_state is not None:
        raise ValueError(
            "a sliding-window call takes initial_state=None only; run a prefix through the "
            "caller's window buffer instead")
    if not normalize:
        raise ValueError("the sliding-window hybrid is always normalized; pass normalize=True")
    if q_sm is None or k_sm is None or sm_scale is None:
        raise ValueError("window > 0 needs q_sm, k_sm and sm_scale")


def _split_varlen(fn, q, k, v, log_g, initial_state, output_final_state, q_sm, k_sm, cu_seqlens, **kw):
    """Run ``fn`` on each packed sequence separately (B must be 1) and stitch the results."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of 1, got B={q.shape[0]}")
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = slice(bos, eos)
        h0 = None if initial_state is None else (initial_state[0][n:n + 1], initial_state[1][n:n + 1])
        o, st = fn(q[:, sl], k[:, sl], v[:, sl],
                   log_g=None if log_g is None else log_g[:, sl],
                   initial_state=h0, output_final_state=output_final_state,
                   q_sm=None if q_sm is None else q_sm[:, sl],
                   k_sm=None if k_sm is None else k_sm[:, sl], **kw)
        outs.append(o)
        states.append(st)
    o = torch.cat(outs, dim=1)
    if not output_final_state:
        return o, None
    return o, (torch.cat([s[0] for s in states]), torch.cat([s[1] for s in states]))


def linear_attn_recurrent_ref(q, k, v, *, log_g=None, normalize=True, eps=1e-6, initial_state=None,
                              output_final_state=False, window=0, q_sm=None, k_sm=None, sm_scale=None,
                              window_weight=1.0, cu_seqlens=None, sinks=0):
    """Step-by-step definition. Shapes: q, k [B, T, H, F]; v [B, T, H, Dv]; log_g [B, T, H];
    state (S [B, H, F, Dv], z [B, H, F]). Returns (o [B, T, H, Dv], state or None)."""
    _check_window(window, initial_state, normalize, q_sm, k_sm, sm_scale, sinks)
    kw = dict(normalize=normalize, eps=eps, window=window, sm_scale=sm_scale, window_weight=window_weight,
              sinks=sinks)
    if cu_seqlens is not None:
        return _split_varlen(linear_attn_recurrent_ref, q, k, v, log_g, initial_state,
                             output_final_state, q_sm, k_sm, cu_seqlens, **kw)
    B, T, H, F = q.shape
    Dv = v.shape[-1]
    dt = q.dtype
    if initial_state is None:
        S = q.new_zeros(B, H, F, Dv)
        z = q.new_zeros(B, H, F)
    else:
        S, z = initial_state[0].to(dt), initial_state[1].to(dt)
    lg = torch.zeros(B, T, H, dtype=dt, device=q.device) if log_g is None else log_g.to(dt)
    cum = lg.cumsum(1)  # B_t: log of prod_{r<=t} g_r
    o = []
    for t in range(T):
        g = lg[:, t].exp()  # (B, H)
        if window == 0:
            S = g[..., None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
            z = g[..., None] * z + k[:, t]
            num = torch.einsum("bhf,bhfd->bhd", q[:, t], S)
            if normalize:
                num = num / ((q[:, t] * z).sum(-1, keepdim=True) + eps)
            o.append(num)
            continue
        # Linear state over s <= t - W, decayed to t.
        S = g[..., None, None] * S
        z = g[..., None] * z
        s_new = t - window
        if s_new >= 0:
            dec = (cum[:, t] - cum[:, s_new]).exp()  # prod_{r=s_new+1..t} g_r
            S = S + dec[..., None, None] * k[:, s_new, :, :, None] * v[:, s_new, :, None, :]
            z = z + dec[..., None] * k[:, s_new]
        # Softmax keys: the sinks not already in the window (s < min(sinks, lo)), then the window.
        lo = max(0, t - window + 1)
        n_sink = min(sinks, lo)
        ks = torch.cat([k_sm[:, :n_sink], k_sm[:, lo:t + 1]], 1)
        vs = torch.cat([v[:, :n_sink], v[:, lo:t + 1]], 1)
        a = sm_scale * torch.einsum("bhd,bshd->bhs", q_sm[:, t], ks)
        m = a.amax(-1)  # (B, H); the window always holds key t itself
        p = (a - m[..., None]).exp()
        e = _gamma(window_weight, H, dt, q.device)[None]
        num = torch.einsum("bhs,bshd->bhd", p, vs) + e[..., None] * torch.einsum(
            "bhf,bhfd->bhd", q[:, t], S)
        den = p.sum(-1) + e * (q[:, t] * z).sum(-1)
        o.append(num / den[..., None])
    o = torch.stack(o, dim=1).to(v.dtype)
    if not output_final_state:
        return o, None
    if window >= 1 and T > 0:
        # The returned state covers s <= T-W and is decayed to T-W, its newest key (the W-1 newer
        # keys stay in the caller's window buffer with their gates): sum it up directly.
        last = T - window
        S = torch.zeros_like(S)
        z = torch.zeros_like(z)
        for s_idx in range(last + 1):
            dec = (cum[:, last] - cum[:, s_idx]).exp()
            S = S + dec[..., None, None] * k[:, s_idx, :, :, None] * v[:, s_idx, :, None, :]
            z = z + dec[..., None] * k[:, s_idx]
    return o, (S, z)


def linear_attn_ref(q, k, v, *, log_g=None, normalize=True, eps=1e-6, initial_state=None,
                    output_final_state=False, window=0, q_sm=None, k_sm=None, sm_scale=None,
                    window_weight=1.0, cu_seqlens=None, sinks=0):
    """Masked quadratic form of :func:`linear_attn_recurrent_ref` (same signature and result).

    Differentiable with respect to every tensor input; O(T^2) memory.
    """
    _check_window(window, initial_state, normalize, q_sm, k_sm, sm_scale, sinks)
    kw = dict(normalize=normalize, eps=eps, window=window, sm_scale=sm_scale, window_weight=window_weight,
              sinks=sinks)
    if cu_seqlens is not None:
        return _split_varlen(linear_attn_ref, q, k, v, log_g, initial_state,
                             output_final_state, q_sm, k_sm, cu_seqlens, **kw)
    B, T, H, F = q.shape
    dt = q.dtype
    lg = torch.zeros(B, T, H, dtype=dt, device=q.device) if log_g is None else log_g.to(dt)
    cum = lg.cumsum(1).transpose(1, 2)  # (B, H, T)
    t_idx = torch.arange(T, device=q.device)
    diff = t_idx[:, None] - t_idx[None, :]  # t - s
    lin_mask = diff >= window  # s <= t - W  (window 0: s <= t)
    # decay[t, s] = prod_{r=s+1..t} g_r, only where the linear part uses it.
    log_dec = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lin_mask, float("-inf"))
    qk = torch.einsum("bthf,bshf->bhts", q, k)
    A = qk * log_dec.exp()  # (B, H, T, T)
    num = torch.einsum("bhts,bshd->bthd", A, v.to(dt))
    den = A.sum(-1).transpose(1, 2)  # (B, T, H)
    if initial_state is not None:
        S0, z0 = initial_state[0].to(dt), initial_state[1].to(dt)
        g0 = cum.exp().transpose(1, 2)  # (B, T, H): decay of the initial state to t
        num = num + g0[..., None] * torch.einsum("bthf,bhfd->bthd", q, S0)
        den = den + g0 * torch.einsum("bthf,bhf->bth", q, z0)
    if window == 0:
        o = num / (den[..., None] + eps) if normalize else num
    else:
        win_mask = (diff >= 0) & ((diff < window) | (t_idx[None, :] < sinks))  # window plus sinks
        a = sm_scale * torch.einsum("bthd,bshd->bhts", q_sm.to(dt), k_sm.to(dt))
        a = a.masked_fill(~win_mask, float("-inf"))
        m = a.amax(-1, keepdim=True)
        p = (a - m).exp()
        e = _gamma(window_weight, H, dt, q.device)[None, None]  # (1, 1, H)
        num = torch.einsum("bhts,bshd->bthd", p, v.to(dt)) + e[..., None] * num
        den = p.sum(-1).transpose(1, 2) + e * den
        o = num / den[..., None]
    o = o.to(v.dtype)
    if not output_final_state:
        return o, None
    # Final state: tokens s <= T - max(W, 1), decayed to that last token (T-1 without a window),
    # plus the decayed initial state.
    last = max(window, 1)
    keep = (t_idx <= T - last).to(dt)  # (T,)
    ref = cum[..., max(T - last, 0) : max(T - last, 0) + 1]
    w = (ref - cum).exp() * keep if T > 0 else cum  # (B, H, T)
    S = torch.einsum("bhs,bshf,bshd->bhfd", w, k, v.to(dt))
    z = torch.einsum("bhs,bshf->bhf", w, k)
    if initial_state is not None:  # (window calls take no initial state, so this is cum at T-1)
        gT = cum[..., -1].exp() if T > 0 else torch.ones(B, H, dtype=dt, device=q.device)
        S = S + gT[..., None, None] * S0
        z = z + gT[..., None] * z0
    return o, (S, z)


def linear_attn_chunked_ref(q, k, v, *, log_g=None, normalize=True, eps=1e-6, initial_state=None,
                            output_final_state=False, chunk=256):
    """Chunk-by-chunk form (no window, no varlen): O(T * chunk) memory, for long-T checks.

    Same result as :func:`linear_attn_ref`; differentiable.  Computes in the inputs' dtype.
    """
    B, T, H, F = q.shape
    Dv = v.shape[-1]
    dt = q.dtype
    if initial_state is None:
        S = q.new_zeros(B, H, F, Dv)
        z = q.new_zeros(B, H, F)
    else:
        S, z = initial_state[0].to(dt), initial_state[1].to(dt)
    lg = torch.zeros(B, T, H, dtype=dt, device=q.device) if log_g is None else log_g.to(dt)
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, c0:c0 + chunk], k[:, c0:c0 + chunk], v[:, c0:c0 + chunk].to(dt)
        b = lg[:, c0:c0 + chunk].cumsum(1).transpose(1, 2)  # (B, H, C)
        C = b.shape[-1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        dec = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        A = torch.einsum("bihf,bjhf->bhij", qc, kc) * dec
        eb = b.exp().transpose(1, 2)  # (B, C, H)
        num = torch.einsum("bhij,bjhd->bihd", A, vc) + eb[..., None] * torch.einsum("bihf,bhfd->bihd", qc, S)
        if normalize:
            den = A.sum(-1).transpose(1, 2) + eb * torch.einsum("bihf,bhf->bih", qc, z)
            num = num / (den[..., None] + eps)
        outs.append(num)
        w = (b[..., -1:] - b).exp()  # (B, H, C): decay of each key to the chunk end
        S = b[..., -1].exp()[..., None, None] * S + torch.einsum("bhj,bjhf,bjhd->bhfd", w, kc, vc)
        z = b[..., -1].exp()[..., None] * z + torch.einsum("bhj,bjhf->bhf", w, kc)
    o = torch.cat(outs, 1).to(v.dtype)
    return o, ((S, z) if output_final_state else None)


def linear_attn_channel_ref(q, k, v, log_g, *, normalize=True, eps=1e-6, initial_state=None):
    """Step-by-step definition with a per-channel decay (the GLA form): log_g [B, T, H, F], every
    entry <= 0, decays row f of the state. q, k [B, T, H, F]; v [B, T, H, Dv]; initial_state
    (S [B, H, F, Dv], z [B, H, F]) or None. Computes in q's dtype (pass float64 for a reference);
    differentiable. Returns o [B, T, H, Dv] in v's dtype and the final state (S, z)::

        S_t = exp(log_g_t)[:, None] * S_{t-1} + k_t^T v_t,   z_t = exp(log_g_t) * z_{t-1} + k_t
        o_t = (q_t S_t) / (q_t . z_t + eps)  (normalize)  or  q_t S_t
    """
    B, T, H, F = q.shape
    dt = q.dtype
    S = q.new_zeros(B, H, F, v.shape[-1]) if initial_state is None else initial_state[0].to(dt)
    z = q.new_zeros(B, H, F) if initial_state is None else initial_state[1].to(dt)
    o = []
    for t in range(T):
        g = log_g[:, t].to(dt).exp()  # (B, H, F)
        S = g[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :].to(dt)
        z = g * z + k[:, t]
        num = torch.einsum("bhf,bhfd->bhd", q[:, t], S)
        o.append(num / ((q[:, t] * z).sum(-1, keepdim=True) + eps) if normalize else num)
    o = torch.stack(o, dim=1) if T else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(v.dtype), (S, z)
