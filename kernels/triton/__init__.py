"""Triton kernels for deltaserve: the GPU data path, same signatures as the PyTorch reference ops.

Get them through ``deltaserve.kernels.get_ops("triton", device)`` (or ``"auto"`` on a CUDA device); this
package is imported lazily by ``kernels/ops.py`` (which builds the ``Ops`` table from it; this
package never imports ``ops.py``, so there is no import circle) because ``triton.jit`` decides at import time
whether the kernels are compiled for the GPU or run by the interpreter (``TRITON_INTERPRET=1``,
how the CPU tests run them).

Ops (docs/contracts.md, "Kernel ops"); every one is a Triton kernel except ``sample``, which is the
reference sampler (plain torch ops, fine on the GPU):

* ``chunk_gated_delta_rule``: chunked GDN prefill over a varlen batch (``gdn.py``);
* ``recurrent_gated_delta_rule``: fused one-token GDN decode step in place on slots (``gdn.py``);
* ``causal_conv1d_varlen`` / ``causal_conv1d_update``: short conv + SiLU on slot state (``conv1d.py``);
* ``store_kv`` / ``paged_attention``: paged KV scatter, online-softmax attention (``attention.py``);
* ``copy_state_slots``: batched slot copy over all state tensors in one launch (``state_copy.py``);
* ``rms_norm``: the three RMSNorm variants of ``models/norms.py`` in one launch each (``norm.py``).
"""

from __future__ import annotations

from deltaserve.kernels.triton._common import INTERPRET
from deltaserve.kernels.triton.attention import paged_attention, store_kv
from deltaserve.kernels.triton.conv1d import causal_conv1d_update, causal_conv1d_varlen
from deltaserve.kernels.triton.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from deltaserve.kernels.triton.norm import rms_norm
from deltaserve.kernels.triton.state_copy import copy_state_slots

__all__ = [
    "INTERPRET",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "copy_state_slots",
    "paged_attention",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "store_kv",
]
