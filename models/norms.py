"""RMSNorm variants, each matching its transformers twin op-for-op (so bf16 rounding agrees).

* ``RMSNorm`` (Qwen3): ``w * norm(x)``; the product is taken in the input dtype.
* ``ZeroCenteredRMSNorm`` (Qwen3.5, Qwen3-Next): ``norm(x) * (1 + w)`` in fp32, then cast;
  checkpoints store ``w`` centred on 0.
* ``GatedRMSNorm`` (GDN output): ``w * norm(x) * silu(z)``; ``w`` is centred on 1 (it is
  NOT zero-centred even in the zero-centred models).

All normalise over the last axis with ``x * rsqrt(mean(x^2) + eps)`` computed in fp32.

``use_norm_kernel(model, kernel)`` gives every norm of a model a fused op (the Triton backend's
``rms_norm``: one launch in place of 6 to 12 torch ops); these modules' own torch ops stay
the reference, and run where the weight's dtype is not the input's (the fused op rounds to
the input's dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.kernels.op_args import NormKind


def _normalize_fp32(x: Tensor, eps: float) -> Tensor:
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _WeightedNorm(nn.Module):
    """``eps`` and a ``[dim]`` weight initialised to ``weight_init`` (its identity value);
    ``kernel``, when set, the fused op that computes this norm (``kind``)."""

    weight_init = 1.0
    kind = NormKind.PLAIN

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), self.weight_init))
        self.kernel: Callable[..., Tensor] | None = None

    def _fused(self, x: Tensor) -> bool:
        return self.kernel is not None and x.dtype == self.weight.dtype


class RMSNorm(_WeightedNorm):
    def forward(self, x: Tensor) -> Tensor:
        if self._fused(x):
            return self.kernel(x, self.weight, self.eps, self.kind)  # type: ignore[misc]
        return self.weight * _normalize_fp32(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(_WeightedNorm):
    weight_init = 0.0
    kind = NormKind.ZERO_CENTERED

    def forward(self, x: Tensor) -> Tensor:
        if self._fused(x):
            return self.kernel(x, self.weight, self.eps, self.kind)  # type: ignore[misc]
        return (_normalize_fp32(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(_WeightedNorm):
    kind = NormKind.GATED

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if self._fused(x):
            return self.kernel(x, self.weight, self.eps, self.kind, gate)  # type: ignore[misc]
        normed = self.weight * _normalize_fp32(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.to(torch.float32))).to(x.dtype)


def use_norm_kernel(model: nn.Module, kernel: Callable[..., Tensor] | None) -> int:
    """Give every norm of ``model`` the fused op ``kernel`` (None: their torch ops); returns
    how many norms it reached."""
    norms = [m for m in model.modules() if isinstance(m, _WeightedNorm)]
    for m in norms:
        m.kernel = kernel
    return len(norms)
