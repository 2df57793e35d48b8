"""Dense gated MLP (SwiGLU): ``down(act(gate(x)) * up(x))``.

Weight names match transformers: ``gate_proj``, ``up_proj``, ``down_proj`` (no biases).
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
