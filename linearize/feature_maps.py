"""Feature maps phi for linear attention, in a registry.

Every map takes ``x: (B, T, H, D)`` and returns ``(B, T, H, F)`` non-negative features, computed
in the input's dtype (the layer passes float32). Learned maps hold one set of weights per head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FEATURE_MAPS: dict[str, type["FeatureMap"]] = {}


def register_feature_map(name: str):
    def wrap(cls):
        cls.name = name
        FEATURE_MAPS[name] = cls
        return cls

    return wrap


def build_feature_map(name: str, num_heads: int, head_dim: int, feature_dim: int | None = None, seed: int = 0):
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name](num_heads, head_dim, feature_dim, seed=seed)


class FeatureMap(nn.Module):
    name = ""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, seed: int = 0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.feature_dim = head_dim if feature_dim is None else feature_dim


@register_feature_map("elu")
class EluPlusOne(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020). F = D, no parameters."""

    def __init__(self, num_heads, head_dim, feature_dim=None, seed=0):
        super().__init__(num_heads, head_dim, None)

    def forward(self, x):
        return F.elu(x) + 1


@register_feature_map("relu")
class Relu(FeatureMap):
    """phi(x) = relu(x). F = D, no parameters (features can be all zero: the normalizer has eps)."""

    def __init__(self, num_heads, head_dim, feature_dim=None, seed=0):
        super().__init__(num_heads, head_dim, None)

    def forward(self, x):
        return F.relu(x)


def _identity_init(num_heads: int, d_in: int, d_out: int) -> torch.Tensor:
    # identity where it fits so a fresh map passes x through (plus a small random tail)
    w = torch.randn(num_heads, d_in, d_out) * (0.02 if d_out != d_in else 0.0)
    eye = torch.eye(d_in, d_out)
    return w + eye


@register_feature_map("t2r")
class T2R(FeatureMap):
    """phi(x) = relu(x W_h + b_h), one learned (D, F) layer per head (Kasai et al. 2021)."""

    def __init__(self, num_heads, head_dim, feature_dim=None, seed=0):
        super().__init__(num_heads, head_dim, feature_dim)
        self.weight = nn.Parameter(_identity_init(num_heads, head_dim, self.feature_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads, self.feature_dim))

    def forward(self, x):
        y = torch.einsum("bthd,hdf->bthf", x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)
        return F.relu(y)


@register_feature_map("hedgehog")
class Hedgehog(FeatureMap):
    """phi(x) = softmax([x W_h, -x W_h]) over the feature dim, W_h learned per head (Zhang et al. 2024).

    F = 2 * (columns of W); default F = 2 * D with W initialised to the identity.
    """

    def __init__(self, num_heads, head_dim, feature_dim=None, seed=0):
        super().__init__(num_heads, head_dim, 2 * head_dim if feature_dim is None else feature_dim)
        self.weight = nn.Parameter(_identity_init(num_heads, head_dim, self.feature_dim // 2))

    def forward(self, x):
        y = torch.einsum("bthd,hdf->bthf", x, self.weight.to(x.dtype))
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1)

    @torch.no_grad()
    def features(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``forward(x.float())`` for inference in fewer launches: x (B, T, Hx, D) raw, any dtype, with
        Hx = H or H / rep (GQA: head h reads x head h // rep, no repeated copy of x); returns
        (B, T, H, F) contiguous in ``out_dtype``. One GEMM per x head against the weights of its rep
        heads with ``[W, -W]`` side by side (the features' two halves without a cat or a negation),
        a softmax in place and one copy into the layout and dtype the kernels read: 4 launches where
        ``forward`` and the casts around it take 8. The products are the same fp32 ones."""
        B, T, Hx, D = x.shape
        H, F = self.num_heads, self.feature_dim
        if H % Hx:
            raise ValueError(f"x has {Hx} heads, which do not divide the map's {H}")
        w = self._grouped_weight(Hx)  # (Hx, D, rep * F) fp32
        xf = x.float().permute(2, 0, 1, 3).reshape(Hx, B * T, D)
        y = torch.bmm(xf, w).view(Hx, B * T, H // Hx, F).softmax(dim=-1)
        out = torch.empty(B * T, Hx, H // Hx, F, device=x.device, dtype=out_dtype)
        out.copy_(y.permute(1, 0, 2, 3))
        return out.view(B, T, H, F)

    def _grouped_weight(self, Hx: int) -> torch.Tensor:
        """fp32 (Hx, D, rep * F): for x head j, the columns [W_h, -W_h] of heads h = j * rep + r. Cached
        until the weight changes (its version counter) or moves."""
        def build():
            W = self.weight.detach().float()
            w = torch.cat([W, -W], dim=-1)  # (H, D, F)
            rep = self.num_heads // Hx
            return w.view(Hx, rep, self.head_dim, self.feature_dim).transpose(1, 2).reshape(Hx, self.head_dim, -1)

        if torch.compiler.is_compiling():
            return build()  # compiled code traces no cache bookkeeping
        key = (self.weight._version, self.weight.data_ptr(), self.weight.device, Hx)
        if getattr(self, "_grouped_key", None) != key:
            self._grouped, self._grouped_key = build(), key
        return self._grouped


@register_feature_map("performer")
class Performer(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021).

    phi(x) = exp(w_i . x' - |x'|^2 / 2) / sqrt(F) with x' = x / D^(1/4), so that
    E[phi(q) . phi(k)] = exp(q . k / sqrt(D)). The orthogonal Gaussian matrix w is a
    persistent buffer: it is saved with the checkpoint and drawn from ``seed``.
    """

    def __init__(self, num_heads, head_dim, feature_dim=None, seed=0):
        super().__init__(num_heads, head_dim, feature_dim)
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("projection", _orthogonal_gaussian(head_dim, self.feature_dim, gen), persistent=True)

    def forward(self, x):
        x = x * self.head_dim**-0.25
        proj = torch.einsum("bthd,df->bthf", x, self.projection.to(x.dtype))
        # the exponent is at most |w|^2 / 2 (maximised over x), so fp32 never overflows for D <= 256
        return torch.exp(proj - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(self.feature_dim)


def _orthogonal_gaussian(d: int, m: int, gen: torch.Generator) -> torch.Tensor:
    blocks = []
    for _ in range(math.ceil(m / d)):
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
        blocks.append(q)
    w = torch.cat(blocks, dim=1)[:, :m]
    norms = torch.randn(d, m, generator=gen).norm(dim=0)  # chi-distributed row norms, as for Gaussian rows
    return w * norms
