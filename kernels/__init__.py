"""Kernel ops for deltaserve: PyTorch reference implementations (CPU path and test oracle).

Models get their ops through ``get_ops(backend, device)`` (an immutable ``Ops`` table), never by
importing a backend module directly, so the Triton path can slot in behind the same signatures.
Shapes and semantics: docs/contracts.md, "Kernel ops".
"""

from deltaserve.kernels.attention import paged_attention, store_kv
from deltaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from deltaserve.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from deltaserve.kernels.ops import BACKENDS, REFERENCE_OPS, Ops, get_ops
from deltaserve.kernels.sampler import sample
from deltaserve.kernels.state_copy import copy_state_slots

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
