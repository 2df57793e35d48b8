"""Kernel ops for deltaserve: PyTorch reference implementations (CPU path and test oracle).

Models get their ops through ``get_ops(backend, device)`` (an immutable ``Ops`` table), never by
importing a backend module directly, so the Triton path can slot in behind the same signatures.
Shapes and semantics: docs/contracts.md, "Kernel ops".
"""

from kernels.attention import paged_attention, store_kv
from kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.ops import BACKENDS, REFERENCE_OPS, Ops, get_ops
from kernels.sampler import sample
from kernels.state_copy import copy_state_slots

__all__ = [
    "BACKENDS",
    "REFERENCE_OPS",
    "Ops",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "copy_state_slots",
    "get_ops",
    "paged_attention",
    "recurrent_gated_delta_rule",
    "sample",
    "store_kv",
]
