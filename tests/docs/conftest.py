"""Fixtures for the docs tests: the built-in model, loaded once for the directory."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    path = ensure_builtin_model("tiny-qwen3.5")
    return load_model(path, dtype=torch.float32, device="cpu", ops=get_ops("reference"))
