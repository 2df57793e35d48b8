"""``get_ops("triton" | "auto", device)`` wiring. Interpreter or CUDA only (like every Triton test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deltaserve.kernels
from deltaserve.kernels import Ops, get_ops
from tests.kernels.triton_env import DEVICE, INTERPRET, TRITON_MARKS

pytestmark = TRITON_MARKS


def test_triton_ops_table() -> None:
    ops = get_ops("triton", DEVICE)
    assert ops.name == "triton" and get_ops("triton", torch.device(DEVICE)) is ops
    names = {f.name for f in dataclasses.fields(Ops)} - {"name"}
    for name in names - {"sample"}:
        assert getattr(ops, name) is not getattr(deltaserve.kernels, name, None), (
            f"{name} is still the reference"
        )
        assert getattr(ops, name).__module__.startswith("deltaserve.kernels.triton."), name
    assert ops.sample is deltaserve.kernels.sample  # the sampler stays the (torch) reference


def test_auto_picks_by_device() -> None:
    assert get_ops("auto", "cpu").name == "reference"
    if torch.cuda.is_available() and not INTERPRET:
        assert get_ops("auto", "cuda").name == "triton"


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        get_ops("triton", "cpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(NotImplementedError, match="CUDA is not available"):
            get_ops("triton", "cuda")
