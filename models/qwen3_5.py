"""Qwen3.5 text model (``model_type`` ``qwen3_5_text``; ``qwen3_5`` checkpoints load their text part).

Contract (transformers ``Qwen3_5ForCausalLM``, same tensor names):

* ``config.layer_types[i]`` in {``linear_attention``, ``full_attention``}.
* linear layers: ``GatedDeltaNet`` (separate ``in_proj_qkv/z/b/a``).
* full layers: gated attention (``q_proj`` -> per head ``[q, gate]``), q/k norm, partial
  rope (``head_dim * partial_rotary_factor`` dims), ``o * sigmoid(gate)``.
* every norm outside the GDN output gate is zero-centred ``(1 + w)``; dense SwiGLU MLP.
* ``qwen3_5`` (vision-language) checkpoints keep the text weights under
  ``model.language_model.``; ``model.visual.*`` is ignored by the loader, and so is ``mtp.*``
  unless ``mtp_layers`` > 0 builds the multi-token-prediction head (``self.mtp``,
  ``models/mtp.py``; its MLP is ``make_mlp(config, 0)``, as the checkpoints' ``mtp.layers.0``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from deltaserve.models.attention import PagedAttention
from deltaserve.models.decoder import ATTENTION, LINEAR_ATTENTION, CausalLM, DecoderLayer
from deltaserve.models.gdn import GatedDeltaNet
from deltaserve.models.mlp import GatedMLP
from deltaserve.models.mtp import MtpHead
from deltaserve.models.norms import ZeroCenteredRMSNorm

if TYPE_CHECKING:
    from deltaserve.kernels import Ops


class Qwen35CausalLM(CausalLM):
    gdn_cls: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(
        self, config: Any, *, ops: Ops, tie_word_embeddings: bool | None = None, mtp_layers: int = 0
    ) -> None:
        super().__init__(config, ZeroCenteredRMSNorm, ops=ops, tie_word_embeddings=tie_word_embeddings)
        head_dim, eps = self.head_dim, config.rms_norm_eps
        for i, layer_type in enumerate(config.layer_types[: config.num_hidden_layers]):
            if layer_type == ATTENTION:
                mixer: nn.Module = PagedAttention(
                    config, head_dim=head_dim, norm_cls=ZeroCenteredRMSNorm, gated=True, ops=ops
                )
            elif layer_type == LINEAR_ATTENTION:
                mixer = self.gdn_cls(config, ops=ops)
            else:
                raise ValueError(f"layer {i}: unsupported layer type {layer_type!r}")
            layer = DecoderLayer(
                mixer, self.make_mlp(config, i), ZeroCenteredRMSNorm, config.hidden_size, eps
            )
            self.model.layers.append(layer)
        self.finish_layers()
        if mtp_layers:
            self.mtp = MtpHead(
                config,
                num_layers=mtp_layers,
                head_dim=head_dim,
                norm_cls=ZeroCenteredRMSNorm,
                make_mlp=lambda: self.make_mlp(config, 0),
                kv_base=len(self.attention_layers()),
                ops=ops,
            )
            self.mtp.bind(self.model.embed_tokens, self.model.rotary_emb, self.lm_head)
        self.tie_weights()

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
