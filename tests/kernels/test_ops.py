"""get_ops / Ops: backend selection and the op table's shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import Ops, get_ops

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
        assert getattr(ops, name) is getattr(kernels, name)


def test_ops_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_ops().sample = None  # type: ignore[misc]


def test_triton_not_available_yet_and_unknown_backend() -> None:
    with pytest.raises(NotImplementedError, match="Triton"):
        get_ops("triton", "cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")
