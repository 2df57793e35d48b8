"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next: a one-layer drafter that
shares the target's embedding, rope and ``lm_head``.

Contract (checkpoint names under ``mtp.``, as the published checkpoints ship them):

* tensors: ``fc.weight [H, 2H]``, ``pre_fc_norm_embedding.weight [H]``,
  ``pre_fc_norm_hidden.weight [H]``, ``layers.{i}.*`` (``mtp_num_hidden_layers`` decoder
  layers, each a full-attention layer of the target's kind -- gated attention, q/k norms,
  partial rope -- with the MLP the target builds for layer index 0: dense for Qwen3.5, sparse
  MoE for Qwen3-Next), ``norm.weight [H]``. Every norm is the target's zero-centred RMSNorm.
  No embedding or head of its own: ``model.embed_tokens`` and ``lm_head`` are the target's.
* one row ``r`` of a step: ``x = fc(cat(norm_e(embed(tok_r)), norm_h(hid_r)))`` (embedding
  first), then the decoder layer at ``positions[r]``, then ``norm``; that is the head's hidden
  ``g_r``, and ``lm_head(g_r)`` its logits.
* what goes in: for a row at position ``p``, ``hid_r`` is the hidden state that predicted the
  token at ``p + 1`` -- the target's output after its final norm at ``p``
  (``CausalLM.forward(..., return_hidden=True)``), or, chained, this head's own ``g`` of the
  previous step -- and ``tok_r`` (``batch.input_ids[r]``) IS that token at ``p + 1``. Its
  logits predict the token at ``p + 2``. (vLLM and SGLang feed the target's post-norm output
  too: the head was trained on it.)
* KV: layer ``i`` stores the KV of position ``p`` at ``batch.slot_mapping[r]`` in
  ``caches.k_cache[kv_base + i]`` / ``v_cache[kv_base + i]`` (``kv_base`` = the target's
  attention layer count; ``CacheSpec.num_mtp_layers`` adds these caches) and attends over
  positions ``[0, seq_lens[b])`` of its sequence through ``batch.block_tables``, so a batch is
  built exactly like a target batch over the same positions, only with the input ids shifted
  by one. A position's head KV is valid once a step with the final ``(hid, tok)`` for it ran
  (re-running a position overwrites it: after a verify, the target's hidden replaces a draft's).
* of ``batch`` the head reads ``input_ids``, ``positions``, ``cu_seqlens``, ``seq_lens``,
  ``block_tables``, ``slot_mapping`` and ``logits_indices``; the GDN fields (state slots,
  captures) are never read, so a target batch with shifted ids serves as is.
* ``step`` picks layer ``step % num_layers`` (published checkpoints have one layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from deltaserve.models.attention import PagedAttention
from deltaserve.models.decoder import DecoderLayer
from deltaserve.models.linear import Linear
from deltaserve.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from collections.abc import Callable

    from deltaserve.kernels import Ops
    from deltaserve.models.batch import BatchMetadata, ModelCaches


@dataclass(frozen=True)
class _Shared:
    """The target's modules the head uses. Held outside the module tree on purpose: their
    weights belong to the target (one copy, loaded and moved with it, never ``mtp.*``)."""

    embed_tokens: nn.Embedding
    rotary_emb: RotaryEmbedding
    lm_head: nn.Module


@dataclass(frozen=True)
class MtpOutput:
    logits: Tensor  # [len(batch.logits_indices), vocab] float32: predictions for p + 2
    hidden: Tensor  # [T, H] model dtype: the head's normed hidden, the next chained step's input


class MtpHead(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        num_layers: int,
        head_dim: int,
        norm_cls: type[nn.Module],
        make_mlp: Callable[[], nn.Module],
        kv_base: int,
        ops: Ops,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"mtp_num_hidden_layers must be >= 1, got {num_layers}")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            attn = PagedAttention(config, head_dim=head_dim, norm_cls=norm_cls, gated=True, ops=ops)
            layer = DecoderLayer(attn, make_mlp(), norm_cls, hidden, eps)
            layer.cache_index = kv_base + i  # after the target's KV layers (CacheSpec.num_mtp_layers)
            self.layers.append(layer)
        self.norm = norm_cls(hidden, eps=eps)
        self._shared: _Shared | None = None

    def bind(self, embed_tokens: nn.Embedding, rotary_emb: RotaryEmbedding, lm_head: nn.Module) -> None:
        """Point the head at the target's embedding, rope and head (the owner calls this once)."""
        self._shared = _Shared(embed_tokens, rotary_emb, lm_head)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @torch.no_grad()
    def forward(
        self, batch: BatchMetadata, hidden: Tensor, caches: ModelCaches, *, step: int = 0
    ) -> MtpOutput:
        """One head step over ``batch`` (module docstring): ``hidden [T, H]`` row-aligned with
        ``batch.input_ids``; returns the logits of ``batch.logits_indices`` and every row's ``g``."""
        shared = self._shared
        if shared is None:
            raise RuntimeError("MtpHead.bind() was not called: the head has no embedding or lm_head")
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(f"hidden has {hidden.shape[0]} rows for a batch of {batch.num_tokens} tokens")
        emb = self.pre_fc_norm_embedding(shared.embed_tokens(batch.input_ids))
        h = self.fc(torch.cat((emb, self.pre_fc_norm_hidden(hidden.to(emb.dtype))), dim=-1))
        cos, sin = shared.rotary_emb.cos_sin(batch.positions, h.dtype)
        h = self.layers[step % len(self.layers)](h, cos, sin, batch, None, caches)
        h = self.norm(h)
        logits = shared.lm_head(h.index_select(0, batch.logits_indices)).float()
        return MtpOutput(logits=logits, hidden=h)
