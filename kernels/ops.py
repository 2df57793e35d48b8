"""The op table models are built with: ``Ops`` and ``get_ops(backend, device)``.

Every op exists once per backend behind one signature (docs/contracts.md, "Kernel ops"). A model
receives an ``Ops`` at construction and calls ``ops.paged_attention(...)`` etc.; there is no global
mutable registry or "current backend", so two models with different backends can coexist and a
test can hand a model the reference ops explicitly.

Backends:

* ``"reference"``: the PyTorch ops in this package (fp32 math; runs anywhere; the test oracle).
* ``"triton"``: the GPU kernels (``kernels/triton/``) — not implemented yet, asking for it raises.
* ``"auto"``: the best backend for ``device``. Today that is always the reference; when
  ``kernels/triton/`` lands, ``"auto"`` on a CUDA device returns the Triton ops (see
  ``_triton_ops``), everything else keeps the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import paged_attention, store_kv
from kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.sampler import sample
from kernels.state_copy import copy_state_slots

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
    """The Triton backend. Slot-in point for ``kernels/triton/``: build and return its ``Ops`` here."""
    raise NotImplementedError(
        f"the Triton kernel backend is not implemented yet (kernels/triton/); requested for device "
        f"{device}. Use backend='reference' (or 'auto', which falls back to it)."
    )


def get_ops(backend: str = "auto", device: str | torch.device = "cpu") -> Ops:
    """Return the op table for ``backend`` on ``device``.

    Raises ``ValueError`` for an unknown backend and ``NotImplementedError`` for ``"triton"`` until
    the Triton kernels exist.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "reference":
        return REFERENCE_OPS
    if backend == "triton":
        return _triton_ops(dev)
    # "auto": the reference everywhere until the Triton path lands; then CUDA devices go there.
    return REFERENCE_OPS
