"""The one object a model's forward receives, and the cache tensors it reads and writes.

Contract (docs/contracts.md, "Batch layout" and "Cache tensors"):

* ``BatchMetadata`` is built only by the model runner. Sequences are flattened onto one
  token axis; **decodes come first**: sequences ``[0, num_decodes)`` contribute exactly one
  token each and continue from their live state (recurrent path); sequences
  ``[num_decodes, B)`` are prefill segments (chunked path), each starting at a multiple of
  the GDN chunk size (``GDN_CHUNK_SIZE``, 64).
* ``ModelCaches`` holds, per full-attention layer ordinal ``i``, ``k_cache[i]`` /
  ``v_cache[i]`` of shape ``[num_blocks, block_size, Hkv, D]`` (model dtype), and per GDN
  layer ordinal ``j``, ``conv_state[j]`` ``[num_state_slots, conv_dim, K - 1]`` (model
  dtype) and ``ssm_state[j]`` ``[num_state_slots, Hv, Dk, Dv]`` (float32).
* ``CacheSpec`` is what a model tells the runner so it can size and allocate those.

Nothing here knows about requests; models never see one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deltaserve.kernels.gdn import GDN_CHUNK_SIZE

# The recurrent state is accumulated over thousands of tokens: keep it in fp32 whatever the
# model dtype (contracts.md fixes this).
SSM_STATE_DTYPE = torch.float32


@dataclass
class BatchMetadata:
    """Flattened varlen batch. Shapes: ``T`` tokens, ``B`` sequences, ``C`` captures, ``N`` logits rows."""

    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64, absolute position of each token
    cu_seqlens: Tensor  # [B+1] int64, segment boundaries on the token axis
    seq_lens: Tensor  # [B] int64, context length after this step
    block_tables: Tensor  # [B, M] int64, KV block ids padded with 0
    slot_mapping: Tensor  # [T] int64, flat KV slot of each token (-1: do not store)
    num_decodes: int  # sequences [0, num_decodes) are one-token decodes
    state_slots: Tensor  # [B] int64, live state slot of each sequence
    has_initial_state: Tensor  # [B] bool, False: start from zero state
    capture_seq: Tensor  # [C] int64, batch index (>= num_decodes) of a prefill segment
    capture_pos: Tensor  # [C] int64, tokens into that segment after which the state is captured
    capture_slots: Tensor  # [C] int64, state slot receiving the captured conv + ssm state
    logits_indices: Tensor  # [N] int64, token rows whose logits are returned

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class ModelCaches:
    """Paged KV (one pair per full-attention layer) and state slots (one pair per GDN layer)."""

    k_cache: list[Tensor]
    v_cache: list[Tensor]
    conv_state: list[Tensor]
    ssm_state: list[Tensor]

    def state_tensors(self) -> list[Tensor]:
        """Every per-slot tensor, in the order ``copy_state_slots`` expects to receive them."""
        return [*self.conv_state, *self.ssm_state]


@dataclass(frozen=True)
class CacheSpec:
    """Shapes of a model's caches; the runner sizes pools from the byte counts below."""

    num_attn_layers: int
    num_kv_heads: int
    head_dim: int
    num_gdn_layers: int
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int
    dtype: torch.dtype
    gdn_chunk_size: int = GDN_CHUNK_SIZE  # checkpoint boundaries are multiples of it

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block id across ALL full-attention layers (K and V)."""
        per_layer = 2 * block_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)
        return self.num_attn_layers * per_layer

    def state_slot_bytes(self) -> int:
        """Bytes of one state slot across ALL GDN layers (conv state + fp32 recurrent state)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * _itemsize(self.dtype)
        ssm = self.num_v_heads * self.key_head_dim * self.value_head_dim * _itemsize(SSM_STATE_DTYPE)
        return self.num_gdn_layers * (conv + ssm)

    def allocate(
        self, num_blocks: int, block_size: int, num_state_slots: int, device: torch.device | str
    ) -> ModelCaches:
        """Zero-filled caches with the contracts.md shapes (zeros so unused slots are benign)."""
        kv_shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        conv_shape = (num_state_slots, self.conv_dim, self.conv_kernel - 1)
        ssm_shape = (num_state_slots, self.num_v_heads, self.key_head_dim, self.value_head_dim)
        return ModelCaches(
            k_cache=[
                torch.zeros(kv_shape, dtype=self.dtype, device=device) for _ in range(self.num_attn_layers)
            ],
            v_cache=[
                torch.zeros(kv_shape, dtype=self.dtype, device=device) for _ in range(self.num_attn_layers)
            ],
            conv_state=[
                torch.zeros(conv_shape, dtype=self.dtype, device=device) for _ in range(self.num_gdn_layers)
            ],
            ssm_state=[
                torch.zeros(ssm_shape, dtype=SSM_STATE_DTYPE, device=device)
                for _ in range(self.num_gdn_layers)
            ],
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
