"""RMSNorm variants, each matching its transformers twin op-for-op (so bf16 rounding agrees).

* ``RMSNorm`` (Qwen3): ``w * norm(x)``; the product is taken in the input dtype.
* ``ZeroCenteredRMSNorm`` (Qwen3.5, Qwen3-Next): ``norm(x) * (1 + w)`` in fp32, then cast;
  checkpoints store ``w`` centred on 0.
* ``GatedRMSNorm`` (GDN output): ``w * norm(x) * silu(z)``; ``w`` is centred on 1 (it is
  NOT zero-centred even in the zero-centred models).

All normalise over the last axis with ``x * rsqrt(mean(x^2) + eps)`` computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _normalize_fp32(x: Tensor, eps: float) -> Tensor:
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _WeightedNorm(nn.Module):
    """``eps`` and a ``[dim]`` weight initialised to ``weight_init`` (its identity value)."""

    weight_init = 1.0

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), self.weight_init))


class RMSNorm(_WeightedNorm):
    def forward(self, x: Tensor) -> Tensor:
        return self.weight * _normalize_fp32(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(_WeightedNorm):
    weight_init = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return (_normalize_fp32(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(_WeightedNorm):
    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = self.weight * _normalize_fp32(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.to(torch.float32))).to(x.dtype)
