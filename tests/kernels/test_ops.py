"""get_ops / Ops: backend selection and the op table's shape."""

from __future__ import annotations

import dataclasses
import inspect

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
#: ops a backend may leave to the model's own torch ops (None in the reference table)
OPTIONAL_OPS = {"rms_norm"}


def test_reference_and_auto_give_the_reference_ops() -> None:
    ops = get_ops("reference")
    assert ops.name == "reference"
    assert get_ops() is ops and get_ops("auto", torch.device("cpu")) is ops
    assert {f.name for f in dataclasses.fields(Ops)} - {"name"} == CONTRACT_OPS | OPTIONAL_OPS
    for name in CONTRACT_OPS:
        assert getattr(ops, name) is getattr(deltaserve.kernels, name)
    assert all(getattr(ops, name) is None for name in OPTIONAL_OPS)


def test_ops_keep_the_contract_signatures() -> None:
    # Both backends' ops are built by kernels/op_args.py: the public signature is the contract's
    # (docs/contracts.md), not the argument object the implementations take.
    ops = get_ops("reference")
    chunk = inspect.signature(ops.chunk_gated_delta_rule).parameters
    assert list(chunk)[5:9] == ["cu_seqlens", "ssm_state", "state_slots", "has_initial_state"]
    assert (chunk["chunk_size"].default, chunk["use_qk_l2norm"].default) == (64, True)
    conv = inspect.signature(ops.causal_conv1d_varlen).parameters
    assert list(conv) == [
        "x", "weight", "bias", "cu_seqlens", "conv_state", "state_slots", "has_initial_state",
        "capture_seq", "capture_pos", "capture_slots", "activation",
    ]  # fmt: skip
    assert list(inspect.signature(ops.paged_attention).parameters) == [
        "q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "seq_lens", "scale",
    ]  # fmt: skip
    assert (
        ops.recurrent_gated_delta_rule.__doc__
        and ops.copy_state_slots.__module__ == "deltaserve.kernels.state_copy"
    )


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
