"""Qwen3-Next (``model_type`` ``qwen3_next``): Qwen3.5's hybrid stack with fused GDN
projections and sparse MoE MLPs.

Contract (transformers ``Qwen3NextForCausalLM``, same tensor names):

* linear layers: ``FusedGatedDeltaNet`` (``in_proj_qkvz`` / ``in_proj_ba``, per-key-head
  interleaved).
* layer ``i`` is MoE iff ``i not in mlp_only_layers`` and ``num_experts > 0`` and
  ``(i + 1) % decoder_sparse_step == 0``; otherwise a dense MLP of ``intermediate_size``.
* experts load from fused 3-D ``experts.gate_up_proj``/``experts.down_proj`` or from
  per-expert ``experts.{e}.{gate,up,down}_proj.weight`` (what transformers 5's
  ``save_pretrained`` writes).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaserve.models.gdn import FusedGatedDeltaNet, GatedDeltaNet
from deltaserve.models.mlp import GatedMLP
from deltaserve.models.moe import SparseMoeBlock, merge_per_expert_weights
from deltaserve.models.qwen3_5 import Qwen35CausalLM


class Qwen3NextCausalLM(Qwen35CausalLM):
    gdn_cls: type[GatedDeltaNet] = FusedGatedDeltaNet

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0:
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    @classmethod
    def convert_checkpoint(cls, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return merge_per_expert_weights(state)
