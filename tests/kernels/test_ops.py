"""get_ops / Ops: backend selection and the op table's shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deltaserve.kernels
from deltaserve.kernels import Ops, get_ops

CONTRACT_OPS = {
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "causal_conv1d_varlen",
    "causal_conv1d_update",
    "store_kv",
    "paged_attention",
    "copy_state_slots",
    "sample",
}


def test_reference_and_auto_give_the_reference_ops() -> None:
    ops = get_ops("reference")
    assert ops.name == "reference"
    assert get_ops() is ops and get_ops("auto", torch.device("cpu")) is ops
    assert {f.name for f in dataclasses.fields(Ops)} - {"name"} == CONTRACT_OPS
    for name in CONTRACT_OPS:
        assert getattr(ops, name) is getattr(deltaserve.kernels, name)


def test_ops_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_ops().sample = None  # type: ignore[misc]


def test_triton_backend_availability_and_unknown_backend() -> None:
    if torch.cuda.is_available():
        assert get_ops("triton", "cuda").name == "triton"
        assert get_ops("auto", "cuda").name == "triton"
    else:
        # no GPU: asking for Triton on CUDA is a clear error, and auto falls back
        with pytest.raises(NotImplementedError, match="Triton|CUDA|cuda"):
            get_ops("triton", "cuda")
    assert get_ops("auto", "cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")
