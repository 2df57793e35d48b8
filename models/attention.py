"""Full-attention block over the paged KV cache (Qwen3 / Qwen3.5 / Qwen3-Next).

Contract:

* ``q_proj -> [T, H, D]`` (or, when ``gated``, ``[T, H, 2D]`` laid out per head as
  ``[q_h, gate_h]``), ``k_proj/v_proj -> [T, Hkv, D]``; ``q_norm``/``k_norm`` are per-head
  RMSNorms on ``D``; rope on the first ``rotary_dim`` dims of q and k.
* K/V of this step are written with ``ops.store_kv`` at ``batch.slot_mapping`` before
  ``ops.paged_attention`` reads the whole context (cached prefix + this step) from the cache,
  so decodes and prefill segments run in one call.
* gated: ``o * sigmoid(gate)`` before ``o_proj``. Scale ``D**-0.5``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from deltaserve.models.fusion import concat_linears
from deltaserve.models.linear import Linear
from deltaserve.models.rope import apply_rotary

if TYPE_CHECKING:
    from deltaserve.kernels import Ops
    from deltaserve.models.batch import BatchMetadata


class PagedAttention(nn.Module):
    """The attention block of a transformers Qwen3-family text ``config`` (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``attention_bias``
    (default False)); ``head_dim`` and the q/k ``norm_cls`` are the model's."""

    def __init__(
        self, config: Any, *, head_dim: int, norm_cls: type[nn.Module], gated: bool, ops: Ops
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gated = gated
        self.scale = head_dim**-0.5
        self.ops = ops
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = Linear(hidden_size, q_out, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = norm_cls(head_dim, eps=config.rms_norm_eps)
        self.k_norm = norm_cls(head_dim, eps=config.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections()
        self._qkv_sizes = [q_out, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def fuse_projections(self) -> None:
        self.qkv_proj = concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self._qkv_sizes, dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        batch: BatchMetadata,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        t = x.shape[0]
        gate: Tensor | None = None
        q_all, k_all, v_all = self._project(x)
        if self.gated:
            q, gate = torch.chunk(q_all.reshape(t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(t, self.num_heads * self.head_dim)
        else:
            q = q_all.reshape(t, self.num_heads, self.head_dim)
        q = self.q_norm(q)
        k = self.k_norm(k_all.reshape(t, self.num_kv_heads, self.head_dim))
        v = v_all.reshape(t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        self.ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        # verify segments attend token by token, each a decode of its own (models/verify.py)
        view = batch.verify if batch.verify is not None else batch
        o = self.ops.paged_attention(
            q.contiguous(), k_cache, v_cache, view.block_tables, view.cu_seqlens, view.seq_lens, self.scale
        )
        o = o.reshape(t, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
