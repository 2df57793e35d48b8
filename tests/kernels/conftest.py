"""Shared setup for the kernel tests: modest torch threading (the CI box has 2 cores, shared)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def rng() -> torch.Generator:
    """A fixed-seed CPU generator, so every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(0)
