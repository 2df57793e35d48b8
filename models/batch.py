"""The one object a model's forward receives, and the cache tensors it reads and writes.

Contract (docs/contracts.md, "Batch layout" and "Cache tensors"):

* ``BatchMetadata`` is built only by the model runner. Sequences are flattened onto one
  token axis; **decodes come first**: sequences ``[0, num_decodes)`` contribute exactly one
  token each and continue from their live state (recurrent path); sequences
  ``[num_decodes, B)`` are prefill segments (chunked path), each starting at a multiple of
  the GDN chunk size (``GDN_CHUNK_SIZE``, 64). With speculative decoding, sequences
  ``[num_decodes, num_decodes + num_verify)`` are verify segments between the two (several
  tokens each, computed with the decode math from the live state: ``models/verify.py``), and
  the prefill segments follow them.
* ``ModelCaches`` holds, per full-attention layer ordinal ``i``, ``k_cache[i]`` /
  ``v_cache[i]`` of shape ``[num_blocks, block_size, Hkv, D]`` (model dtype) -- the target's
  ``num_attn_layers`` first, then the ``num_mtp_layers`` layers of the multi-token-prediction
  head (``models/mtp.py``; 0 unless the runner asked for them), which use the same block ids,
  block tables and slot mapping as the target -- and per GDN
  layer ordinal ``j``, ``conv_state[j]`` ``[num_state_slots, conv_dim, K - 1]`` (model
  dtype) and ``ssm_state[j]`` ``[num_state_slots, Hv, Dk, Dv]`` (``CacheSpec.ssm_dtype``:
  float32 unless configured otherwise, ``model.ssm_state_dtype``).
* ``CacheSpec`` is what a model tells the runner so it can size and allocate those.

Two allocations give those shapes. ``CacheSpec.allocate`` makes one contiguous tensor per
cache (fixed mode). ``CacheSpec.allocate_arena`` makes ONE flat byte buffer of pages in which
KV blocks and state slots share the bytes (shared mode, ``PageLayout``): every cache tensor is
then a view of the arena whose dim 0 is strided (a KV block is a row of ``block_bytes``, a
state slot a page of ``page_bytes``), so every kernel indexes dim 0 by its stride, never by
``numel`` of the trailing dims. A cache is never reshaped or made contiguous: that copies,
and writes to the copy are lost.

Nothing here knows about requests; models never see one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deltaserve.kernels.gdn import GDN_CHUNK_SIZE
from deltaserve.models.verify import VerifyPlan

# The recurrent state is accumulated over thousands of tokens: it is float32 whatever the
# model dtype unless the configuration asks otherwise (contracts.md). The kernels compute in
# float32 and round only where they store, so a checkpoint restores exactly the state a live
# slot of the same dtype held.
SSM_STATE_DTYPE = torch.float32
#: every per-layer range inside an arena page starts on this many bytes (vector loads; the
#: fp32 state view needs at least 4)
ARENA_ALIGN = 16


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
    num_verify: int = 0  # sequences [num_decodes, num_decodes + num_verify) are verify segments
    verify: VerifyPlan | None = None  # their layout (None when num_verify == 0)

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class PageLayout:
    """Where everything sits in a shared arena (``CacheSpec.page_layout``).

    A KV block ``b`` is the row of bytes ``[b * block_bytes, (b + 1) * block_bytes)``: per
    attention layer ``i``, its K block at ``k_offsets[i]`` then its V block at ``v_offsets[i]``
    (``kv_layer_bytes`` each, no padding). A page is ``page_blocks`` rows; state slot ``s`` is
    page ``s``: its first ``state_bytes`` hold, per GDN layer ``j``, the conv state at
    ``conv_offsets[j]`` and the fp32 recurrent state at ``ssm_offsets[j]`` (every offset a
    multiple of ``ARENA_ALIGN``; ``state_bytes`` is that padded size, >= the unpadded
    ``CacheSpec.state_slot_bytes()``). ``page_blocks = max(1, ceil(state_bytes / block_bytes))``,
    so one page holds one state slot or ``page_blocks`` KV blocks, and wastes less than one
    block when it holds a state.
    """

    block_size: int
    block_bytes: int
    kv_layer_bytes: int
    k_offsets: tuple[int, ...]
    v_offsets: tuple[int, ...]
    state_bytes: int
    conv_bytes: int
    ssm_bytes: int
    conv_offsets: tuple[int, ...]
    ssm_offsets: tuple[int, ...]
    page_blocks: int

    @property
    def page_bytes(self) -> int:
        return self.page_blocks * self.block_bytes

    def arena_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes


@dataclass
class ModelCaches:
    """Paged KV (one pair per full-attention layer) and state slots (one pair per GDN layer).

    In shared mode ``arena`` is the one uint8 buffer every tensor here views and ``layout``
    says where; both are None for separately allocated caches.
    """

    k_cache: list[Tensor]
    v_cache: list[Tensor]
    conv_state: list[Tensor]
    ssm_state: list[Tensor]
    arena: Tensor | None = None
    layout: PageLayout | None = None

    def state_tensors(self) -> list[Tensor]:
        """Every per-slot tensor, in the order ``copy_state_slots`` expects to receive them."""
        return [*self.conv_state, *self.ssm_state]

    def state_copy_tensors(self) -> list[Tensor]:
        """What a state slot copy moves: in shared mode one view of the arena, row ``s`` = the
        first ``state_bytes`` of page ``s`` (every GDN layer at once, one row per slot);
        otherwise ``state_tensors()``."""
        if self.arena is None or self.layout is None:
            return self.state_tensors()
        lay = self.layout
        num_pages = self.arena.numel() // lay.page_bytes
        return [_row_words(self.arena, num_pages, lay.page_bytes, 0, lay.state_bytes)]

    def block_rows(self) -> Tensor:
        """Shared mode: the arena as KV block rows (row ``b`` = every layer's K and V of block
        ``b``), for block moves."""
        if self.arena is None or self.layout is None:
            raise ValueError("block rows exist only for caches allocated in an arena")
        lay = self.layout
        num_rows = self.arena.numel() // lay.block_bytes
        return _row_words(self.arena, num_rows, lay.block_bytes, 0, lay.block_bytes)

    @property
    def nbytes(self) -> int:
        """Device bytes behind these caches."""
        if self.arena is not None:
            return self.arena.numel()
        tensors = [*self.k_cache, *self.v_cache, *self.conv_state, *self.ssm_state]
        return sum(t.numel() * t.element_size() for t in tensors)


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
    # KV layers of the MTP head, appended after the target's (``k_cache[num_attn_layers + i]``):
    # same Hkv, D and dtype, so one block id covers the target's and the head's KV of its tokens.
    num_mtp_layers: int = 0
    ssm_dtype: torch.dtype = SSM_STATE_DTYPE  # the recurrent state's, live and checkpointed

    @property
    def num_kv_layers(self) -> int:
        """Every KV cache pair: the target's attention layers, then the MTP head's."""
        return self.num_attn_layers + self.num_mtp_layers

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block id across ALL KV layers (K and V; the MTP head's included)."""
        per_layer = 2 * block_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)
        return self.num_kv_layers * per_layer

    def state_slot_bytes(self) -> int:
        """Bytes of one state slot across ALL GDN layers (conv state + recurrent state)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * _itemsize(self.dtype)
        ssm = self.num_v_heads * self.key_head_dim * self.value_head_dim * _itemsize(self.ssm_dtype)
        return self.num_gdn_layers * (conv + ssm)

    def padded_state_bytes(self) -> int:
        """Bytes of one state slot as an arena page lays it out (every per-layer range aligned)."""
        return self._state_ranges()[4]

    def _state_ranges(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...], int]:
        """Conv and ssm bytes per GDN layer, their offsets in a page, and the padded total."""
        conv = self.conv_dim * (self.conv_kernel - 1) * _itemsize(self.dtype)
        ssm = self.num_v_heads * self.key_head_dim * self.value_head_dim * _itemsize(self.ssm_dtype)
        conv_offsets: list[int] = []
        ssm_offsets: list[int] = []
        end = 0
        for _ in range(self.num_gdn_layers):
            conv_offsets.append(end)
            end = _align(end + conv)
            ssm_offsets.append(end)
            end = _align(end + ssm)
        return conv, ssm, tuple(conv_offsets), tuple(ssm_offsets), end

    def page_layout(self, block_size: int) -> PageLayout:
        """The shared-arena layout for ``block_size`` (see ``PageLayout``)."""
        if not (self.num_attn_layers and self.num_gdn_layers):
            raise ValueError("a shared arena needs both full-attention and GDN layers")
        item = _itemsize(self.dtype)
        kv_layer = block_size * self.num_kv_heads * self.head_dim * item
        k_offsets = tuple(2 * i * kv_layer for i in range(self.num_kv_layers))
        v_offsets = tuple(o + kv_layer for o in k_offsets)
        block_bytes = self.kv_block_bytes(block_size)
        conv, ssm, conv_offsets, ssm_offsets, end = self._state_ranges()
        return PageLayout(
            block_size=block_size,
            block_bytes=block_bytes,
            kv_layer_bytes=kv_layer,
            k_offsets=k_offsets,
            v_offsets=v_offsets,
            state_bytes=end,
            conv_bytes=conv,
            ssm_bytes=ssm,
            conv_offsets=conv_offsets,
            ssm_offsets=ssm_offsets,
            page_blocks=max(1, -(-end // block_bytes)),
        )

    def allocate_arena(
        self, num_live: int, num_pages: int, block_size: int, device: torch.device | str
    ) -> ModelCaches:
        """One zero-filled arena of ``num_live + num_pages`` pages and the caches as views of it:
        ``k_cache[i]`` / ``v_cache[i]`` ``[(num_live + num_pages) * page_blocks, block_size, Hkv, D]``
        (dim-0 stride ``block_bytes``), ``conv_state[j]`` / ``ssm_state[j]``
        ``[num_live + num_pages, ...]`` (dim-0 stride ``page_bytes``). State slot ``s`` is page
        ``s``; KV block ``b`` lies in page ``b // page_blocks``. Which page is used as what is
        the cache manager's to say: nothing here stops a block and a slot sharing bytes."""
        lay = self.page_layout(block_size)
        arena = torch.zeros(lay.arena_bytes(num_live + num_pages), dtype=torch.uint8, device=device)
        return self.arena_views(arena, lay)

    def arena_views(self, arena: Tensor, lay: PageLayout) -> ModelCaches:
        """The caches as views of ``arena`` (a flat uint8 tensor of whole pages) under ``lay``."""
        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() % lay.page_bytes:
            raise ValueError(f"an arena is a flat uint8 tensor of whole {lay.page_bytes}-byte pages")
        total = arena.numel() // lay.page_bytes
        rows = total * lay.page_blocks
        bs = lay.block_size
        kv_shape = (rows, bs, self.num_kv_heads, self.head_dim)
        conv_shape = (total, self.conv_dim, self.conv_kernel - 1)
        ssm_shape = (total, self.num_v_heads, self.key_head_dim, self.value_head_dim)

        def kv(off: int) -> Tensor:
            return _typed_view(arena, rows, lay.block_bytes, off, lay.kv_layer_bytes, self.dtype, kv_shape)

        return ModelCaches(
            k_cache=[kv(off) for off in lay.k_offsets],
            v_cache=[kv(off) for off in lay.v_offsets],
            conv_state=[
                _typed_view(arena, total, lay.page_bytes, off, lay.conv_bytes, self.dtype, conv_shape)
                for off in lay.conv_offsets
            ],
            ssm_state=[
                _typed_view(arena, total, lay.page_bytes, off, lay.ssm_bytes, self.ssm_dtype, ssm_shape)
                for off in lay.ssm_offsets
            ],
            arena=arena,
            layout=lay,
        )

    def allocate(
        self, num_blocks: int, block_size: int, num_state_slots: int, device: torch.device | str
    ) -> ModelCaches:
        """Zero-filled caches with the contracts.md shapes (zeros so unused slots are benign)."""
        kv_shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        conv_shape = (num_state_slots, self.conv_dim, self.conv_kernel - 1)
        ssm_shape = (num_state_slots, self.num_v_heads, self.key_head_dim, self.value_head_dim)
        return ModelCaches(
            k_cache=[
                torch.zeros(kv_shape, dtype=self.dtype, device=device) for _ in range(self.num_kv_layers)
            ],
            v_cache=[
                torch.zeros(kv_shape, dtype=self.dtype, device=device) for _ in range(self.num_kv_layers)
            ],
            conv_state=[
                torch.zeros(conv_shape, dtype=self.dtype, device=device) for _ in range(self.num_gdn_layers)
            ],
            ssm_state=[
                torch.zeros(ssm_shape, dtype=self.ssm_dtype, device=device)
                for _ in range(self.num_gdn_layers)
            ],
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def _typed_view(
    arena: Tensor,
    num_rows: int,
    row_bytes: int,
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> Tensor:
    """Bytes ``[offset, offset + nbytes)`` of every ``row_bytes`` row of ``arena`` as ``shape``
    of ``dtype``: a view (dim 0 strided by the row), never a copy."""
    view = arena.view(num_rows, row_bytes)[:, offset : offset + nbytes].view(dtype).view(shape)
    assert view.data_ptr() == arena.data_ptr() + offset, "an arena view must alias the arena"
    return view


def _row_words(arena: Tensor, num_rows: int, row_bytes: int, offset: int, nbytes: int) -> Tensor:
    """Bytes ``[offset, offset + nbytes)`` of every row as int32 words when they divide evenly
    (the row copy kernels move words), else as bytes."""
    rows = arena.view(num_rows, row_bytes)[:, offset : offset + nbytes]
    if row_bytes % 4 == 0 and offset % 4 == 0 and nbytes % 4 == 0:
        return rows.view(torch.int32)
    return rows
