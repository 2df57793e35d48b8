"""Where the Triton kernel tests run: under the interpreter on the CPU, or on CUDA.

Every ``test_triton_*`` module sets ``pytestmark = TRITON_MARKS``: marked ``interpret`` (CI
runs them with ``TRITON_INTERPRET=1 pytest -m interpret``) and skipped when neither the
interpreter nor a GPU is available, so the default suite stays fast.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TRITON_MARKS = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        not (INTERPRET or torch.cuda.is_available()), reason="Triton kernels need TRITON_INTERPRET=1 or CUDA"
    ),
]
