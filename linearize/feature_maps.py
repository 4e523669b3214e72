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
        """``forward(x.float())`` for inference on the kernels, in one launch: x (B, T, Hx, D) raw, any
        dtype, with Hx = H or H / rep (GQA: head h reads x head h // rep, no repeated copy of x);
        returns (B, T, H, F) contiguous in ``out_dtype``. The GEMM, the softmax and the cast run in one
        Triton kernel (``kernels/linear_attn/features.py``, the PyTorch twin beside it), with fp32
        products: in PyTorch they took a copy of x in fp32 and two fp32 round trips of the features."""
        from linearize.kernels.linear_attn.features import hedgehog_features

        if x.dtype == torch.float64:
            return self.forward(x.repeat_interleave(self.num_heads // x.shape[2], dim=2)).to(out_dtype)
        return hedgehog_features(x, self.weight, out_dtype)


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
