"""Load-time fusion of projections that read the same input.

Checkpoints store ``gate_proj``/``up_proj``, ``q/k/v_proj``, ``in_proj_qkv/z/b/a`` as
separate matrices (the names the loader matches). At decode time one matmul per group
instead of two to four saves kernel launches and Python overhead, so after loading each
module's ``fuse_projections()`` replaces a group by one ``nn.Linear`` whose output rows are
the members' rows concatenated in order; ``split_sizes`` undoes it. The originals are
dropped (no second copy of the weights). A fused module no longer matches a checkpoint's
names: fuse only after ``load_state_dict``.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.models.linear import Linear


def concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` computing every member's output, concatenated on the last axis."""
    first = linears[0]
    has_bias = first.bias is not None
    if any((lin.bias is not None) != has_bias or lin.in_features != first.in_features for lin in linears):
        raise ValueError("can only fuse linears with the same input size and bias setting")
    out = sum(lin.out_features for lin in linears)
    fused = Linear(first.in_features, out, bias=has_bias, device="meta", dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)  # type: ignore[misc]
    return fused


def fuse_model(model: nn.Module) -> nn.Module:
    """Call ``fuse_projections()`` on every submodule that has one."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        if callable(fuse):
            fuse()
    return model
