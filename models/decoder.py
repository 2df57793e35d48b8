"""The decoder stack shared by every model: embed -> layers -> norm -> lm_head.

Contract:

* Module tree and parameter names are transformers': ``model.embed_tokens``,
  ``model.layers.{i}.{input_layernorm, self_attn | linear_attn, post_attention_layernorm,
  mlp}``, ``model.norm``, ``lm_head`` — so a checkpoint's tensors load by name.
* ``CausalLM.forward(batch, caches) -> [len(batch.logits_indices), vocab]`` float32.
  Full-attention layer ``i`` (in order of appearance) uses ``caches.k_cache[i]`` /
  ``v_cache[i]``; GDN layer ``j`` uses ``caches.conv_state[j]`` / ``ssm_state[j]``.
  ``forward(batch, caches, return_hidden=True) -> (logits, hidden)`` also returns every
  token's hidden state after the final norm, ``[T, H]`` in the model dtype (what an MTP head
  consumes); the logits are the same rows of the same values. Without it the final norm runs
  on the logits rows only (the default path's cost is unchanged).
* ``mtp`` is the model's multi-token-prediction head (``models/mtp.py``) when one was built
  (the loader's ``load_mtp=True``), else None; ``cache_spec(with_mtp=True)`` adds its KV layers.
* Subclasses build ``self.model.layers`` in ``__init__`` and may override
  ``convert_checkpoint`` (rename/merge checkpoint tensors to this tree's names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import Tensor, nn

from deltaserve.models.attention import PagedAttention
from deltaserve.models.batch import SSM_STATE_DTYPE, BatchMetadata, CacheSpec, ModelCaches
from deltaserve.models.gdn import GatedDeltaNet, GdnSegments
from deltaserve.models.linear import Linear
from deltaserve.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from deltaserve.kernels import Ops
    from deltaserve.models.mtp import MtpHead

ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += mixer(norm(h)); h += mlp(norm(h))``."""

    def __init__(
        self, mixer: nn.Module, mlp: nn.Module, norm_cls: type[nn.Module], hidden_size: int, eps: float
    ):
        super().__init__()
        self.is_attention = isinstance(mixer, PagedAttention)
        # Attribute name decides the checkpoint name: self_attn.* vs linear_attn.*.
        if self.is_attention:
            self.self_attn = mixer
        else:
            self.linear_attn = mixer
        self.mlp = mlp
        self.input_layernorm = norm_cls(hidden_size, eps=eps)
        self.post_attention_layernorm = norm_cls(hidden_size, eps=eps)
        # Ordinal of this layer among layers of its kind = index into the matching caches.
        self.cache_index = -1

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        batch: BatchMetadata,
        seg: GdnSegments | None,
        caches: ModelCaches,
    ) -> Tensor:
        x = self.input_layernorm(h)
        if self.is_attention:
            i = self.cache_index
            x = self.self_attn(x, cos, sin, batch, caches.k_cache[i], caches.v_cache[i])
        else:
            j = self.cache_index
            assert seg is not None
            x = self.linear_attn(x, seg, caches.conv_state[j], caches.ssm_state[j])
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class TextBackbone(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, norm: nn.Module, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList()
        self.norm = norm
        self.rotary_emb = rotary_emb


class CausalLM(nn.Module):
    """Base of every model class. Built from a transformers *text* config and an ``Ops``."""

    def __init__(
        self, config: Any, norm_cls: type[nn.Module], *, ops: Ops, tie_word_embeddings: bool | None
    ) -> None:
        """Embedding, final norm (``norm_cls``), rope and head; subclasses append the layers.

        ``tie_word_embeddings=None`` takes the config's flag (a VL folder passes its top-level one).
        """
        super().__init__()
        self.config = config
        self.ops = ops
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = TextBackbone(
            config.vocab_size,
            config.hidden_size,
            norm_cls(config.hidden_size, eps=config.rms_norm_eps),
            RotaryEmbedding.from_config(config, self.head_dim),
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        tie = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        self.tie_word_embeddings = bool(tie)
        self.num_gdn_layers = 0
        self.mtp: MtpHead | None = None  # set by subclasses that build one

    def finish_layers(self) -> None:
        """Assign cache ordinals; call once all layers are appended."""
        counts = {True: 0, False: 0}
        for layer in self.model.layers:
            layer.cache_index = counts[layer.is_attention]
            counts[layer.is_attention] += 1
        self.num_gdn_layers = counts[False]

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def convert_checkpoint(cls, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Map checkpoint tensor names/layouts onto this module tree (identity by default)."""
        return state

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn for layer in self.model.layers if layer.is_attention]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if not layer.is_attention]

    def cache_spec(self, *, with_mtp: bool = False, ssm_dtype: torch.dtype = SSM_STATE_DTYPE) -> CacheSpec:
        """The caches this model needs; ``with_mtp`` adds the MTP head's KV layers after the
        target's (ValueError when the model has no head); ``ssm_dtype``: the recurrent state's."""
        if with_mtp and self.mtp is None:
            raise ValueError("this model has no MTP head (load it with load_mtp=True)")
        attn = self.attention_layers()
        gdn = self.gdn_layers()
        a0 = attn[0] if attn else None
        g0 = gdn[0] if gdn else None
        return CacheSpec(
            num_attn_layers=len(attn),
            num_kv_heads=a0.num_kv_heads if a0 else 0,
            head_dim=a0.head_dim if a0 else 0,
            num_gdn_layers=len(gdn),
            conv_dim=g0.conv_dim if g0 else 0,
            conv_kernel=g0.conv_kernel if g0 else 0,
            num_v_heads=g0.num_v_heads if g0 else 0,
            key_head_dim=g0.head_k_dim if g0 else 0,
            value_head_dim=g0.head_v_dim if g0 else 0,
            dtype=self.dtype,
            num_mtp_layers=self.mtp.num_layers if with_mtp and self.mtp is not None else 0,
            ssm_dtype=ssm_dtype,
        )

    @overload
    def forward(
        self, batch: BatchMetadata, caches: ModelCaches, *, return_hidden: Literal[False] = False
    ) -> Tensor: ...

    @overload
    def forward(
        self, batch: BatchMetadata, caches: ModelCaches, *, return_hidden: Literal[True]
    ) -> tuple[Tensor, Tensor]: ...

    @torch.no_grad()
    def forward(
        self, batch: BatchMetadata, caches: ModelCaches, *, return_hidden: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(batch.positions, h.dtype)
        seg = GdnSegments.from_batch(batch) if self.num_gdn_layers else None
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, seg, caches)
        if return_hidden:
            # The norm is per token, so normalising every row then selecting gives the logits
            # rows the default path computes.
            hidden = self.model.norm(h)
            return self.lm_head(hidden.index_select(0, batch.logits_indices)).float(), hidden
        # Norm and lm_head are per token: only the requested rows need them.
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        return self.lm_head(h).float()
