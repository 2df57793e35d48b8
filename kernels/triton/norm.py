"""Fused RMSNorm: one launch for what ``models/norms.py`` does in 6 to 12 torch ops.

``rms_norm(x, weight, eps, kind, gate=None)`` normalises each row of ``x`` (the last axis) as
``x * rsqrt(mean(x^2) + eps)`` in float32 and rounds where the torch modules round, so the
result is theirs up to the order of the float32 sum:

* ``NormKind.PLAIN`` (``RMSNorm``): ``weight * normed.to(dtype)``, the product rounded to ``x``'s dtype;
* ``ZERO_CENTERED`` (``ZeroCenteredRMSNorm``): ``normed * (1 + weight)`` in float32, then cast;
* ``GATED`` (``GatedRMSNorm``): ``(weight * normed.to(dtype))`` rounded, times ``silu(gate)``
  in float32, then cast.

Why: a decode step of a 0.8B hybrid runs 79 norms, about 830 of its 1,350 kernel launches on an
H200, where a step is bound by launches, not by bytes (docs/gpu.md). One program per row; a row
(at most a few thousand values) fits one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.op_args import NormKind
from deltaserve.kernels.triton._common import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    n_cols,
    stride_x,
    stride_gate,
    stride_out,
    eps,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    normed = x * (1.0 / tl.sqrt(mean_sq + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if KIND == 1:  # NormKind.ZERO_CENTERED: in float32, one rounding at the end
        y = normed * (1.0 + w)
    else:  # the normed row rounded to the dtype, then the weight's product rounded too
        y = (w * normed.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if KIND == 2:  # NormKind.GATED
            g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[rows, n]`` with a unit stride on the last axis (a copy only when it has none)."""
    flat = t.reshape(-1, n)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kind: NormKind, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """The norm of each row of ``x`` (any leading shape), in ``x``'s dtype and shape."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {n}")
    if (gate is None) != (kind is not NormKind.GATED):
        raise ValueError("rms_norm: a gate is given exactly for the gated norm")
    rows = _rows(x, n)
    out = torch.empty_like(rows)
    g = rows if gate is None else _rows(gate, n)
    if g.shape != rows.shape:
        raise ValueError(f"rms_norm: gate of shape {tuple(gate.shape)} for x of {tuple(x.shape)}")  # type: ignore[union-attr]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, g, out, n, rows.stride(0), g.stride(0), out.stride(0), float(eps),
            KIND=int(kind), BLOCK=next_pow2(n),
        )  # fmt: skip
    return out.view(x.shape)
