"""The fused Triton RMSNorm (``kernels/triton/norm.py``) vs the norm modules' torch ops
(``models/norms.py``, themselves checked op for op against transformers in tests/models).

Runs under ``TRITON_INTERPRET=1`` on the CPU or on a CUDA device; skipped otherwise.
Tolerances: fp32 ``atol=rtol=1e-5`` (the same float32 math, the row's sum in another order);
bf16 two ulps (``atol=rtol=2e-2``): both round at the same points, so only a row whose sum lands
on the other side of a rounding boundary differs: one ulp of the normed value, which the
weight's product (|w| up to about 2 here) carries into up to two of the result's.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from deltaserve.kernels.op_args import NormKind
from deltaserve.models.norms import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm, use_norm_kernel
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
MODULES = {NormKind.PLAIN: RMSNorm, NormKind.ZERO_CENTERED: ZeroCenteredRMSNorm, NormKind.GATED: GatedRMSNorm}


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


def _norm(kind: NormKind, dim: int, dtype: torch.dtype, rng: torch.Generator) -> torch.nn.Module:
    norm = MODULES[kind](dim, eps=1e-6)
    with torch.no_grad():  # weights away from their identity value, so a dropped weight shows
        norm.weight.copy_(norm.weight + 0.5 * torch.randn(dim, generator=rng))
    return norm.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(NormKind), ids=[k.name.lower() for k in NormKind])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 64), (0, 32), (2, 130)], ids=str)
def test_fused_norm_matches_the_module(
    tops: Ops, kind: NormKind, dtype: torch.dtype, shape: tuple[int, ...], rng: torch.Generator
) -> None:
    dim = shape[-1]
    norm = _norm(kind, dim, dtype, rng)
    # a row view with a stride wider than the row (a slice of a fused projection's output)
    wide = (3.0 * torch.randn(*shape[:-1], dim + 7, generator=rng)).to(DEVICE, dtype)
    x = wide[..., 3 : 3 + dim]
    gate = torch.randn(*shape, generator=rng).to(DEVICE, dtype) if kind is NormKind.GATED else None
    args = (x,) if gate is None else (x, gate)
    want = norm(*args)
    assert tops.rms_norm is not None
    got = tops.rms_norm(x, norm.weight, norm.eps, kind, gate)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    use_norm_kernel(norm, tops.rms_norm)  # the module calls the kernel once it is given one
    assert torch.equal(norm(*args), got)


def test_a_weight_of_another_dtype_keeps_the_torch_ops(tops: Ops, rng: torch.Generator) -> None:
    """The fused op rounds to the input's dtype; torch promotes to the wider one, so a bf16
    weight on a float32 input stays on the module's own ops (same result as without a kernel)."""
    norm = _norm(NormKind.PLAIN, 64, torch.bfloat16, rng)
    x = torch.randn(4, 64, generator=rng).to(DEVICE)
    want = norm(x)
    assert use_norm_kernel(norm, tops.rms_norm) == 1
    got = norm(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_bad_arguments_are_value_errors(tops: Ops) -> None:
    assert tops.rms_norm is not None
    x = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"^rms_norm: weight of shape \(4,\) for rows of 8$"):
        tops.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6, NormKind.PLAIN)
    with pytest.raises(ValueError, match=r"^rms_norm: a gate is given exactly for the gated norm$"):
        tops.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, NormKind.GATED)
    with pytest.raises(ValueError, match=r"^rms_norm: gate of shape \(3, 8\) for x of \(2, 8\)$"):
        tops.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, NormKind.GATED, torch.ones(3, 8, device=DEVICE))
