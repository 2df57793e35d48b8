"""The op table models are built with: ``Ops`` and ``get_ops(backend, device)``.

Every op exists once per backend behind one signature (docs/contracts.md, "Kernel ops"; written
once, in ``op_args.py``, which wraps each backend's implementation into the public op). A model
receives an ``Ops`` at construction and calls ``ops.paged_attention(...)`` etc.; there is no global
mutable registry or "current backend", so two models with different backends can coexist and a
test can hand a model the reference ops explicitly.

Backends:

* ``"reference"``: the PyTorch ops in this package (fp32 math; runs anywhere; the test oracle).
* ``"triton"``: the Triton kernels (``kernels/triton/``; the sampler stays the reference). On a
  CUDA device they are compiled for the GPU; on the CPU they run only under the Triton
  interpreter (``TRITON_INTERPRET=1`` set before the process imports them, which is how the
  tests run them here), slowly. Anything else raises ``NotImplementedError`` saying why.
* ``"auto"``: the best backend for ``device``: the Triton ops on a CUDA device (when the
  ``triton`` package is installed and ``TRITON_INTERPRET`` is not set), the reference
  everywhere else.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltaserve.kernels.attention import paged_attention, store_kv
from deltaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from deltaserve.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from deltaserve.kernels.sampler import sample
from deltaserve.kernels.state_copy import copy_state_slots

__all__ = ["BACKENDS", "REFERENCE_OPS", "Ops", "get_ops"]

BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class Ops:
    """One backend's implementation of every kernel op (signatures: docs/contracts.md)."""

    name: str
    chunk_gated_delta_rule: Callable[..., torch.Tensor]
    recurrent_gated_delta_rule: Callable[..., torch.Tensor]
    causal_conv1d_varlen: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_state_slots: Callable[..., None]
    sample: Callable[..., torch.Tensor]
    # fused RMSNorm (``rms_norm(x, weight, eps, kind, gate=None)``), or None: the norm modules'
    # own torch ops are the reference (models/norms.py; the loader installs it)
    rms_norm: Callable[..., torch.Tensor] | None = None


# Immutable: a frozen dataclass of plain functions, safe to share between models and threads.
REFERENCE_OPS = Ops(
    name="reference",
    chunk_gated_delta_rule=chunk_gated_delta_rule,
    recurrent_gated_delta_rule=recurrent_gated_delta_rule,
    causal_conv1d_varlen=causal_conv1d_varlen,
    causal_conv1d_update=causal_conv1d_update,
    store_kv=store_kv,
    paged_attention=paged_attention,
    copy_state_slots=copy_state_slots,
    sample=sample,
)


def _triton_ops(device: torch.device) -> Ops:
    """The Triton backend for ``device``, or ``NotImplementedError`` saying why it cannot run there."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NotImplementedError(
                f"the Triton kernel backend was requested for {device}, but CUDA is not available "
                "(use backend='reference' or 'auto', or run the kernels on the CPU under TRITON_INTERPRET=1)"
            )
        if interpret:
            raise NotImplementedError(
                f"the Triton kernel backend was requested for {device} with TRITON_INTERPRET=1 set: the "
                "interpreter runs on the CPU; unset it to compile the kernels for the GPU"
            )
    elif device.type == "cpu":
        if not interpret:
            raise NotImplementedError(
                "the Triton kernel backend runs on the CPU only under the Triton interpreter: set "
                "TRITON_INTERPRET=1 before starting Python (slow; for tests), or use backend='reference' "
                "(or 'auto') for CPU inference"
            )
    else:
        raise NotImplementedError(f"the Triton kernel backend does not support device type {device.type!r}")
    if importlib.util.find_spec("triton") is None:
        raise NotImplementedError(
            "the Triton kernel backend needs the 'triton' package (pip install 'deltaserve[triton]')"
        )
    import deltaserve.kernels.triton as tk  # lazy: triton.jit reads TRITON_INTERPRET at import

    if interpret != tk.INTERPRET:
        raise NotImplementedError(
            f"kernels.triton was first imported with TRITON_INTERPRET={'1' if tk.INTERPRET else 'unset'}, but it "
            f"is {'1' if interpret else 'unset'} now; set it before the process imports the Triton kernels"
        )
    return _triton_table()


@functools.cache
def _triton_table() -> Ops:
    """The Triton op table, built once per process (like ``REFERENCE_OPS``, one shared object).
    Same table as the reference with every kernel swapped; the sampler stays torch (a few small
    ops on the logits, fine on any device)."""
    import deltaserve.kernels.triton as tk

    return replace(
        REFERENCE_OPS,
        name="triton",
        chunk_gated_delta_rule=tk.chunk_gated_delta_rule,
        recurrent_gated_delta_rule=tk.recurrent_gated_delta_rule,
        causal_conv1d_varlen=tk.causal_conv1d_varlen,
        causal_conv1d_update=tk.causal_conv1d_update,
        store_kv=tk.store_kv,
        paged_attention=tk.paged_attention,
        copy_state_slots=tk.copy_state_slots,
        rms_norm=tk.rms_norm,
    )


def get_ops(backend: str = "auto", device: str | torch.device = "cpu") -> Ops:
    """Return the op table for ``backend`` on ``device``.

    Raises ``ValueError`` for an unknown backend and ``NotImplementedError`` when ``"triton"`` cannot
    run on ``device`` here (no CUDA; a CPU device without ``TRITON_INTERPRET=1``; no triton package).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "reference":
        return REFERENCE_OPS
    if backend == "triton":
        return _triton_ops(dev)
    # "auto": the Triton kernels on a CUDA device, the reference everywhere else (and on CUDA
    # when triton is not installed, or TRITON_INTERPRET=1 asks for the CPU interpreter).
    if (
        dev.type == "cuda"
        and importlib.util.find_spec("triton") is not None
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
    ):
        return _triton_ops(dev)
    return REFERENCE_OPS
