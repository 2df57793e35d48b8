"""Sparse mixture-of-experts block (Qwen3-Next): softmax router, top-k, experts, shared expert.

Contract (matches transformers' ``Qwen3NextSparseMoeBlock``):

* router: ``probs = softmax(x @ gate.weight.T)`` in fp32; top-k; renormalised to sum 1 when
  ``norm_topk_prob``; cast back to the activation dtype.
* expert ``e``: ``down_e(act(gate_e(x)) * up_e(x))``; stored fused, as transformers 5 does in
  memory: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj
  [E, H, I]``. Checkpoints saved per expert (``experts.{e}.gate_proj`` ...) are merged by
  ``merge_per_expert_weights`` at load time.
* output: ``sum_k w_k expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from deltaserve.models.linear import Linear, linear
from deltaserve.models.mlp import GatedMLP, activation


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """-> (weights ``[T, k]`` in ``x.dtype``, expert ids ``[T, k]``)."""
        logits = linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))
        self.act_fn = activation(hidden_act)

    def forward(self, x: Tensor, top_i: Tensor, top_w: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        # Group (token, k) pairs by expert so each expert runs one matmul over its tokens.
        flat_expert = top_i.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        token_of = order // top_i.shape[1]
        weight_of = top_w.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            weights = weight_of[start : start + count]
            start += count
            gate, up = linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = linear(self.act_fn(gate) * up, self.down_proj[expert]) * weights[:, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """The sparse MoE MLP of a transformers Qwen3-Next ``config`` (``hidden_size``,
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size`` (0: no shared expert), ``norm_topk_prob``,
    ``hidden_act``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden_size, num_experts, act = config.hidden_size, config.num_experts, config.hidden_act
        self.gate = TopKRouter(hidden_size, num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = Experts(num_experts, hidden_size, config.moe_intermediate_size, act)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, config.shared_expert_intermediate_size, act)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        top_w, top_i = self.gate(x)
        out = self.experts(x, top_i, top_w)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def merge_per_expert_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rewrite ``<p>.experts.{e}.{gate,up,down}_proj.weight`` into fused ``<p>.experts.gate_up_proj``
    / ``<p>.experts.down_proj``; fused keys pass through. An incomplete set of experts is left
    unmerged, so the loader reports the stray keys as unexpected and the fused ones as missing."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for key in state:
        m = _PER_EXPERT_KEY.match(key)
        if m:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["expert"])] = key
    for prefix, projs in groups.items():
        ids = [set(projs.get(p, {})) for p in ("gate_proj", "up_proj", "down_proj")]
        n = len(ids[0])
        if not (ids[0] == ids[1] == ids[2] == set(range(n))):
            continue
        gate = [state.pop(projs["gate_proj"][e]) for e in range(n)]
        up = [state.pop(projs["up_proj"][e]) for e in range(n)]
        down = [state.pop(projs["down_proj"][e]) for e in range(n)]
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((g, u), dim=0) for g, u in zip(gate, up)])
        state[f"{prefix}.down_proj"] = torch.stack(down)
    return state


def split_fused_expert_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``merge_per_expert_weights``: fused ``<p>.experts.gate_up_proj`` /
    ``<p>.experts.down_proj`` become the per-expert ``<p>.experts.{e}.{gate,up,down}_proj.weight``
    that published checkpoints store (gate rows first in ``gate_up_proj``)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.endswith(".experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            for e, fused in enumerate(value):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith(".experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for e, down in enumerate(value):
                out[f"{prefix}.{e}.down_proj.weight"] = down.contiguous()
        else:
            out[key] = value
    return out
