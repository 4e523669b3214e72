"""The PyTorch attention math: three forms agree, and they match a naive definition."""

import itertools
import math

import pytest
import torch

from linearize.attention import linear_attention

f64 = torch.float64


def naive(qf, kf, v, log_g=None, state=None, valid=None, window=0, q_sm=None, k_sm=None, scale=1.0, eps=1e-6, gamma=None):
    """Straight from the definition, one (batch, head, query) at a time, no shared code."""
    B, N, H, F = kf.shape
    Dv = v.shape[-1]
    gamma = [1.0] * H if gamma is None else gamma
    out = torch.zeros(B, N, H, Dv, dtype=f64)
    for b, h, t in itertools.product(range(B), range(H), range(N)):
        num, den = torch.zeros(Dv, dtype=f64), torch.zeros((), dtype=f64)
        lin_num, lin_den = torch.zeros(Dv, dtype=f64), torch.zeros((), dtype=f64)

        def decay(s):  # prod of g over (s, t]
            if log_g is None:
                return torch.ones(F, dtype=f64)
            g = log_g[b, s + 1 : t + 1, h]
            if valid is not None:  # padding does not decay the state
                m = valid[b, s + 1 : t + 1]
                g = g * (m[:, None] if g.dim() == 2 else m)
            g = g.sum(0) if g.dim() == 2 else g.sum() * torch.ones(F, dtype=f64)
            return torch.exp(g)

        if state is not None:
            w = qf[b, t, h] * decay(-1)
            lin_num += w @ state[0][b, h]
            lin_den += w @ state[1][b, h]
        for s in range(t + 1):
            if valid is not None and not valid[b, s]:
                continue
            if window and s > t - window:
                continue
            w = (qf[b, t, h] * decay(s)) @ kf[b, s, h]
            lin_num += w * v[b, s, h]
            lin_den += w
        if not window:
            out[b, t, h] = lin_num / (lin_den + eps)
            continue
        scores = []
        for s in range(max(t - window + 1, 0), t + 1):
            if valid is None or valid[b, s]:
                scores.append((scale * q_sm[b, t, h] @ k_sm[b, s, h], s))
        m = max([a.item() for a, _ in scores], default=0.0)
        for a, s in scores:
            num += math.exp(a.item() - m) * v[b, s, h]
            den += math.exp(a.item() - m)
        num += gamma[h] * lin_num
        den += gamma[h] * lin_den
        out[b, t, h] = num / den if den > 0 else 0.0
    return out


def make(B=2, N=11, H=2, F=5, Dv=3, D=4, gate=None, init=False, pad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qf, kf = torch.rand(B, N, H, F, generator=g, dtype=f64), torch.rand(B, N, H, F, generator=g, dtype=f64)
    v = torch.randn(B, N, H, Dv, generator=g, dtype=f64)
    log_g = None
    if gate == "scalar":
        log_g = -torch.rand(B, N, H, generator=g, dtype=f64)
    elif gate == "channel":
        log_g = -torch.rand(B, N, H, F, generator=g, dtype=f64)
    state = (torch.rand(B, H, F, Dv, generator=g, dtype=f64), torch.rand(B, H, F, generator=g, dtype=f64)) if init else None
    valid = None
    if pad:
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, :3] = False  # left padding
        valid[1, 5] = False
    q_sm, k_sm = torch.randn(B, N, H, D, generator=g, dtype=f64), torch.randn(B, N, H, D, generator=g, dtype=f64)
    return dict(qf=qf, kf=kf, v=v, log_g=log_g, state=state, valid=valid, q_sm=q_sm, k_sm=k_sm)


CASES = [
    dict(N=1),
    dict(N=11),
    dict(N=16),
    dict(N=11, gate="scalar"),
    dict(N=11, gate="channel"),
    dict(N=11, init=True),
    dict(N=11, gate="scalar", init=True, pad=True),
    dict(N=11, window=1),
    dict(N=11, window=4),
    dict(N=1, window=4),
    dict(N=11, window=4, gate="channel", pad=True),
    dict(N=13, window=20, gate="scalar"),
]


def case_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items())


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunk"])
def test_forms_match_naive_definition(case, form):
    case = dict(case)
    window = case.pop("window", 0)
    x = make(**case)
    out, _ = linear_attention(
        x["qf"], x["kf"], x["v"], log_g=x["log_g"], initial_state=None if window else x["state"],
        key_valid=x["valid"], window=window, q_sm=x["q_sm"], k_sm=x["k_sm"], sm_scale=0.7, form=form, chunk_size=4,
        window_weight=torch.tensor([0.3, 2.0], dtype=f64),
    )
    ref = naive(x["qf"], x["kf"], x["v"], x["log_g"], None if window else x["state"], x["valid"], window,
                x["q_sm"], x["k_sm"], 0.7, gamma=[0.3, 2.0])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_final_state_and_forms_agree(case):
    case = dict(case)
    window = case.pop("window", 0)
    x = make(**case)
    results = {
        form: linear_attention(
            x["qf"], x["kf"], x["v"], log_g=x["log_g"], initial_state=x["state"], key_valid=x["valid"],
            window=window, q_sm=x["q_sm"], k_sm=x["k_sm"], sm_scale=0.7, form=form, chunk_size=3,
        )
        for form in ("parallel", "recurrent", "chunk")
    }
    o_ref, (S_ref, z_ref) = results["parallel"]
    for form in ("recurrent", "chunk"):
        o, (S, z) = results[form]
        torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(z, z_ref, atol=1e-10, rtol=1e-10)
    # the state is the explicit (decayed) sum over the keys it covers
    keep = max(window - 1, 0)
    N = x["kf"].shape[1]
    kf, v = x["kf"].clone(), x["v"]
    if x["valid"] is not None:
        kf = kf * x["valid"][..., None, None]
    cum = torch.zeros(kf.shape[:3] + ((kf.shape[-1],) if x["log_g"] is not None and x["log_g"].dim() == 4 else ()), dtype=f64)
    if x["log_g"] is not None:
        lg = x["log_g"] if x["valid"] is None else x["log_g"] * (x["valid"][..., None, None] if x["log_g"].dim() == 4 else x["valid"][..., None])
        cum = torch.cumsum(lg, 1)
    f = N - 1 - keep
    if f >= 0:
        w = torch.exp(cum[:, f : f + 1] - cum[:, : f + 1])
        w = w if w.dim() == 4 else w[..., None]
        S_exp = torch.einsum("bshf,bshd->bhfd", kf[:, : f + 1] * w, v[:, : f + 1])
        if x["state"] is not None:
            c = torch.exp(cum[:, f])
            S_exp = S_exp + x["state"][0] * (c[..., None] if c.dim() == 3 else c[..., None, None])
        torch.testing.assert_close(S_ref, S_exp, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_continuation_with_state_and_window_buffer(window, gate):
    """Splitting the sequence (state + the W-1 newest keys as prefix) equals one pass: the cache's contract."""
    x = make(N=14, gate=gate, pad=True)
    kw = dict(window=window, sm_scale=0.5, chunk_size=4)
    full, _ = linear_attention(x["qf"], x["kf"], x["v"], log_g=x["log_g"], key_valid=x["valid"], q_sm=x["q_sm"], k_sm=x["k_sm"], **kw)
    cut = 6
    sl = lambda t, a, b: None if t is None else t[:, a:b]
    first, state = linear_attention(
        x["qf"][:, :cut], x["kf"][:, :cut], x["v"][:, :cut], log_g=sl(x["log_g"], 0, cut), key_valid=x["valid"][:, :cut],
        q_sm=x["q_sm"][:, :cut], k_sm=x["k_sm"][:, :cut], **kw,
    )
    P = max(window - 1, 0)
    a = cut - P
    second, _ = linear_attention(
        x["qf"][:, cut:], x["kf"][:, a:], x["v"][:, a:], log_g=sl(x["log_g"], a, None), key_valid=x["valid"][:, a:],
        q_sm=x["q_sm"][:, cut:], k_sm=x["k_sm"][:, a:], initial_state=state, prefix=P, **kw,
    )
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-10, rtol=1e-10)


def test_padding_keys_change_nothing():
    """Garbage at padded positions must not reach any real token."""
    x = make(N=10, gate="scalar", pad=True)
    y = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    pad = ~x["valid"]
    for name in ("kf", "v", "k_sm"):
        y[name][pad] = 1e3
    y["log_g"][pad] = -50.0
    kw = dict(window=3, sm_scale=0.5)
    o1, s1 = linear_attention(x["qf"], x["kf"], x["v"], log_g=x["log_g"], key_valid=x["valid"], q_sm=x["q_sm"], k_sm=x["k_sm"], **kw)
    o2, s2 = linear_attention(y["qf"], y["kf"], y["v"], log_g=y["log_g"], key_valid=y["valid"], q_sm=y["q_sm"], k_sm=y["k_sm"], **kw)
    torch.testing.assert_close(o1[x["valid"]], o2[x["valid"]])
    torch.testing.assert_close(s1[0], s2[0])


def test_window_larger_than_sequence_is_softmax():
    """With the window covering everything, the layer is exactly causal softmax attention."""
    x = make(N=9)
    out, _ = linear_attention(x["qf"], x["kf"], x["v"], window=16, q_sm=x["q_sm"], k_sm=x["k_sm"], sm_scale=0.3)
    scores = torch.einsum("bthd,bshd->bhts", x["q_sm"], x["k_sm"]) * 0.3
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), x["v"])
    torch.testing.assert_close(out, ref)
