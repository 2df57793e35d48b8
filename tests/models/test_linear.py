"""``models.linear``: every dispatch path (oneDNN, BLAS ``W @ x^T`` for few rows of a tall
weight, ``F.linear``) computes ``x W^T + b`` to fp32 rounding, in the caller's dtype and shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deltaserve.models.linear import Linear, linear, use_onednn


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 64])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])  # tall (the W @ x^T case for 2..4 rows) and wide
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=g)
    bias = torch.randn(shape[0], generator=g) if with_bias else None
    x = torch.randn(rows, shape[1], generator=g)
    y = linear(x, weight, bias)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32 and y.is_contiguous()
    torch.testing.assert_close(y.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_non_contiguous_and_batched_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 16, generator=g)
    strided = torch.randn(3, 32, generator=g)[:, ::2]  # 3 rows of a tall weight, not contiguous
    torch.testing.assert_close(
        linear(strided, weight).double(), _reference(strided, weight, None), rtol=1e-5, atol=1e-5
    )
    batched = torch.randn(2, 5, 16, generator=g)
    y = linear(batched, weight)
    assert y.shape == (2, 5, 80)
    torch.testing.assert_close(y.double(), _reference(batched, weight, None), rtol=1e-5, atol=1e-5)
    assert linear(torch.zeros(0, 16), weight).shape == (0, 80)


def test_bfloat16_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=g).bfloat16()
    x = torch.randn(3, 32, generator=g).bfloat16()
    y = linear(x, weight)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, nn.functional.linear(x, weight), rtol=1.6e-2, atol=1e-2)


def test_autograd_takes_f_linear_and_has_gradients() -> None:
    module = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    assert not use_onednn(x, module.weight)
    module(x).sum().backward()
    assert x.grad is not None and module.weight.grad is not None
    with torch.no_grad():
        assert use_onednn(x, module.weight) == torch.backends.mkldnn.is_available()


def test_linear_module_keeps_nn_linear_names() -> None:
    assert set(Linear(8, 4, bias=True).state_dict()) == set(nn.Linear(8, 4, bias=True).state_dict())
    assert isinstance(Linear(8, 4), nn.Linear)
