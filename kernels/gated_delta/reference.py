"""Readable PyTorch references for the gated delta rule (Gated DeltaNet).

Recurrence, per head, with k_t a row vector and the state S of shape [K, V]:

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + beta_t * k_t^T (v_t - k_t S_t)
    o_t = scale * q_t S_t

equivalently S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t with
alpha_t = exp(g_t). These functions are differentiable, run on any device and in any
dtype; the tests call them in float64 as the ground truth for the Triton kernels.

`gated_delta_rule_chunk_ref` is the chunkwise (WY / UT-transform) form the kernels in
chunk.py implement; the tests pin it against the loop form.
"""
from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # same epsilon placement as the kernels (and fla): x / sqrt(sum x^2 + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _split(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of size 1, got B={B}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence (the definition).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay (<= 0); beta: [B, T, H].
    initial_state: [N, H, K, V] (N = B, or the number of sequences with cu_seqlens).
    cu_seqlens: int [N+1] offsets into a packed batch (B == 1).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] (float32, or
    float64 when the inputs are float64) or None. Computes in float32 at least.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    outs, finals = [], []
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(cdt)
        for t in range(s, e):
            S = S * g[b, t].exp()[:, None, None]
            kt = k[b, t]                                        # (H, K)
            delta = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt[:, :, None] * delta[:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", q[b, t], S))
        finals.append(S)
    o = torch.stack(outs, 0) if outs else v.new_zeros(0, H, V)
    o = o.reshape(B, T, H, V).to(v.dtype)     # sequences were walked in memory order
    return o, (torch.stack(finals, 0) if output_final_state else None)


def gated_delta_rule_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise form (what chunk.py computes), same signature as `gated_delta_rule_ref`.

    Inside a chunk of C tokens starting from state S0, with gc the in-chunk cumulative sum
    of g and gamma = exp(gc):
        A   = strict_lower(beta_i (k_i . k_j) gamma_i / gamma_j)        [C, C]
        Tm  = (I + A)^-1                                                (UT transform)
        w   = Tm (beta gamma k),  u = Tm (beta v)                       (WY form)
        v'  = u - w S0                                                  (the deltas)
        o   = scale (gamma q S0 + (lower(gamma_i / gamma_j) * q k^T) v')
        S1  = gamma_C S0 + (k gamma_C / gamma)^T v'
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    outs, finals = [], []
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(cdt)
        for c0 in range(s, e, chunk_size):
            c1 = min(c0 + chunk_size, e)
            C = c1 - c0
            qc, kc, vc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v))   # (H, C, D)
            gc = g[b, c0:c1].transpose(0, 1).cumsum(-1)                      # (H, C)
            bc = beta[b, c0:c1].transpose(0, 1)                              # (H, C)
            decay = gc[:, :, None] - gc[:, None, :]                          # (H, C, C)
            strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
            lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            A = bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay.masked_fill(~strict, float("-inf")).exp()
            eye = torch.eye(C, dtype=cdt, device=q.device)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand(H, C, C), upper=False)
            w = Tm @ (bc[..., None] * gc.exp()[..., None] * kc)
            u = Tm @ (bc[..., None] * vc)
            vn = u - w @ S
            P = (qc @ kc.transpose(1, 2)) * decay.masked_fill(~lower, float("-inf")).exp()
            oc = scale * (gc.exp()[..., None] * (qc @ S) + P @ vn)
            outs.append(oc.transpose(0, 1))                                  # (C, H, V)
            gC = gc[:, -1]
            S = gC.exp()[:, None, None] * S + ((gC[:, None] - gc).exp()[..., None] * kc).transpose(1, 2) @ vn
        finals.append(S)
    o = torch.cat(outs, 0) if outs else v.new_zeros(0, H, V)
    o = o.reshape(B, T, H, V).to(v.dtype)     # sequences were walked in memory order
    return o, (torch.stack(finals, 0) if output_final_state else None)
