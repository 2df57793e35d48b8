"""Qwen3 dense (``model_type`` ``qwen3``): full attention only — the plain-KV path.

Contract (transformers ``Qwen3ForCausalLM``, same tensor names): q/k per-head norms,
standard ``w * x`` RMSNorm, full rope, no output gate, dense SwiGLU MLP. ``cache_spec()``
reports 0 GDN layers, so the engine runs it with KV blocks only. Sliding-window layers are
not supported (rejected at construction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.models.attention import PagedAttention
from deltaserve.models.decoder import ATTENTION, CausalLM, DecoderLayer
from deltaserve.models.mlp import GatedMLP
from deltaserve.models.norms import RMSNorm

if TYPE_CHECKING:
    from deltaserve.kernels import Ops


class Qwen3CausalLM(CausalLM):
    def __init__(self, config: Any, *, ops: Ops, tie_word_embeddings: bool | None = None) -> None:
        super().__init__(config, RMSNorm, ops=ops, tie_word_embeddings=tie_word_embeddings)
        head_dim, eps = self.head_dim, config.rms_norm_eps
        layer_types = getattr(config, "layer_types", None) or [ATTENTION] * config.num_hidden_layers
        for i, layer_type in enumerate(layer_types[: config.num_hidden_layers]):
            if layer_type != ATTENTION:
                raise ValueError(
                    f"layer {i}: unsupported layer type {layer_type!r} (sliding window is not supported)"
                )
            attn = PagedAttention(config, head_dim=head_dim, norm_cls=RMSNorm, gated=False, ops=ops)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            self.model.layers.append(DecoderLayer(attn, mlp, RMSNorm, config.hidden_size, eps))
        self.finish_layers()
        self.tie_weights()
