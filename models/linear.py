"""``linear(x, weight, bias)`` and the ``Linear`` module every model builds its projections with.

Same contract as ``torch.nn.functional.linear`` / ``nn.Linear`` (``y = x W^T + b``, any
leading axes). On the CPU, for float32 / bfloat16 without autograd, the product runs in
oneDNN (``mkldnn._linear_pointwise``) on the weight as it is stored (no packed copy, no
extra memory) instead of aten's BLAS path. Why: the BLAS torch ships (MKL) does not use the
AVX-512 kernels on non-Intel CPUs and streams a weight poorly for a handful of rows; on a
2-core AMD EPYC host oneDNN ran a 512-row prefill GEMM about 2x faster and a decode GEMM
1.2x (1 row) to 1.5x (4 rows) faster (``tools/bench/profile_cpu.py`` measures the whole step).
Results agree with the BLAS path to float rounding (summation order differs).

One exception, measured on the same host: a float32 product of 2 to 4 rows with a weight at
least twice as tall as wide (the fused input projections, gate/up, the vocabulary head: most
of the weight bytes) streams the weight ~30% faster as BLAS's ``W @ x^T`` (the weight as the
long operand, no packing) than in oneDNN or ``x @ W^T``; a single row or more than 4 do not.

Anything else (CUDA, other dtypes, autograd, a torch without oneDNN) is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Read once: whether this torch build has oneDNN (a build flag, constant for the process).
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` takes the oneDNN path (see the module docstring)."""
    return (
        _HAS_ONEDNN
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and weight.dtype == x.dtype
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _tall_skinny(x: Tensor, weight: Tensor) -> bool:
    rows = x.shape[0] if x.dim() == 2 else 0
    return x.dtype == torch.float32 and 2 <= rows <= 4 and weight.shape[0] >= 2 * weight.shape[1]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` (``F.linear``'s contract), through oneDNN on the CPU."""
    if not use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if _tall_skinny(x, weight):
        y = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
        return y.t().contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) whose product is ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
