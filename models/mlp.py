"""Dense gated MLP (SwiGLU): ``down(act(gate(x)) * up(x))``.

Weight names match transformers: ``gate_proj``, ``up_proj``, ``down_proj`` (no biases).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.models.fusion import concat_linears
from deltaserve.models.linear import Linear

# The activations Qwen-family configs name (``hidden_act``). Ours, not transformers'
# ACT2FN: importing that module pulls in the hub-kernels machinery and adds seconds to start-up.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported hidden_act {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = activation(hidden_act)
        self.intermediate_size = intermediate_size
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        self.gate_up_proj = concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
