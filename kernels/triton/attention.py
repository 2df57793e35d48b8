"""Paged KV cache in Triton: ``store_kv`` (a scatter) and ``paged_attention`` (prefill + decode).

Same signatures and semantics as ``kernels/attention.py`` (the oracle) and docs/contracts.md:
``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, flat slot ``block * block_size + offset``;
query token ``j`` of segment ``b`` sits at position ``seq_lens[b] - qlen_b + j`` and attends
causally to ``[0, that]`` through the block table; query head ``h`` reads KV head
``h // (Hq // Hkv)``; softmax in fp32; output in ``q.dtype``.

``paged_attention`` is one online-softmax kernel, ``_paged_attn_kernel``: a program owns a tile of
query tokens of one segment *times all query heads of one KV head* (GQA: K/V are loaded once per
group), packed as ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, and walks the keys in ``BLOCK_N``
steps, gathering them through the block table. Prefill segments (``qlen > 1``) use query tiles
of several tokens and one program per tile; decode segments (``qlen == 1``) are launched
separately, flash-decoding style: the context is split across ``num_splits`` programs whose
partial (max, sum, acc) are merged by ``_paged_attn_combine_kernel``.

Scores: ``tl.dot`` of q and k in their own dtype (16-bit products are exact; fp32 operands use
3xTF32, see ``_common.dot_precision``) with fp32 accumulation; the probabilities are
cast to the value dtype for the ``P V`` product (the flash-attention convention: bf16 P for bf16
caches, exact for fp32). Under ``TRITON_INTERPRET=1`` the operands are upcast to fp32 first
(``DOT_FP32``): the interpreter's ``tl.dot`` multiplies bf16 tensors' raw bits as integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.kernels.op_args import AttentionArgs, StoreKVArgs, paged_attention_op, store_kv_op
from deltaserve.kernels.triton._common import (
    INTERPRET,
    block,
    check_device,
    dot_precision,
    host_lists,
    index_tensor,
    next_pow2,
    num_sms,
)

__all__ = ["paged_attention", "paged_attention_impl", "store_kv"]


@triton.jit
def _store_row(
    src_ptr, cache_ptr, t, blk, off, heads, H, D, stride_t, stride_h, stride_c0, stride_c1, stride_c2,
    BD: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s ``[H, D]`` keys (or values) into its cache slot: block ``blk``, offset ``off``."""
    d = tl.arange(0, BD)
    mask = (heads < H)[:, None] & (d < D)[None, :]
    row = tl.load(src_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :], mask=mask)
    tl.store(
        cache_ptr + blk * stride_c0 + off * stride_c1 + heads[:, None] * stride_c2 + d[None, :],
        row.to(cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc0, stride_kc1, stride_kc2, stride_vc0, stride_vc1, stride_vc2,
    H, DK, DV, BLOCK_SIZE,
    BH: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        heads = tl.arange(0, BH)
        _store_row(
            key_ptr,
            k_cache_ptr,
            t,
            blk,
            off,
            heads,
            H,
            DK,
            stride_kt,
            stride_kh,
            stride_kc0,
            stride_kc1,
            stride_kc2,
            BDK,
        )
        _store_row(
            value_ptr,
            v_cache_ptr,
            t,
            blk,
            off,
            heads,
            H,
            DV,
            stride_vt,
            stride_vh,
            stride_vc0,
            stride_vc1,
            stride_vc2,
            BDV,
        )


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _store_kv(args: StoreKVArgs) -> None:
    """Write ``key/value [T, Hkv, D]`` into the paged caches at ``slot_mapping [T]``; ``-1`` is skipped."""
    key, value, k_cache, v_cache = args.key, args.value, args.k_cache, args.v_cache
    check_device(key, value, k_cache, v_cache)
    num_tokens, num_heads, head_k_dim = key.shape
    head_v_dim = value.shape[-1]
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv needs caches with a contiguous last axis")
    # Cast on the host side of the kernel (a no-op when the model and cache dtypes agree): torch
    # rounds to nearest-even, exactly like the reference, on every backend (the interpreter's
    # in-kernel fp32 -> bf16 cast truncates).
    key = _inner_contiguous(key.to(k_cache.dtype))
    value = _inner_contiguous(value.to(v_cache.dtype))
    slots = args.slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_k_dim, head_v_dim, k_cache.shape[1],
        BH=next_pow2(num_heads), BDK=next_pow2(head_k_dim), BDV=next_pow2(head_v_dim),
        num_warps=1 if num_heads * max(head_k_dim, head_v_dim) <= 1024 else 4,
    )  # fmt: skip


#: The Triton op.
store_kv = store_kv_op(_store_kv)


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, o_ptr, part_o_ptr, part_ml_ptr,
    tile_seq_ptr, tile_q0_ptr, tile_qlen_ptr, tile_pos0_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, stride_bt,
    scale, split_size, num_splits,
    NUM_Q_HEADS, GROUP, DK, DV, BLOCK_SIZE,
    PARTIAL: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)  # token index of the tile's first query
    qlen = tl.load(tile_qlen_ptr + tile)
    pos0 = tl.load(tile_pos0_ptr + tile)  # position of that query in its sequence

    rows = tl.arange(0, BLOCK_M)
    qj = rows // GROUP_PAD
    gh = rows % GROUP_PAD
    row_valid = (qj < qlen) & (gh < GROUP)
    head = kv_head * GROUP + gh
    tok = q0 + qj
    qpos = pos0 + qj
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :],
        mask=row_valid[:, None] & (dk < DK)[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys of this program: [lo, hi), where hi stops at the tile's last query position.
    lo = split * split_size
    hi = tl.minimum(pos0 + qlen, lo + split_size)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf for masked rows
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        blk = tl.load(block_table_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=kmask, other=0).to(
            tl.int64
        )
        off = kpos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + (blk * stride_k0 + off * stride_k1 + kv_head * stride_k2)[:, None] + dk[None, :],
            mask=kmask[:, None] & (dk < DK)[None, :],
            other=0.0,
        )
        k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = row_valid[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + (blk * stride_v0 + off * stride_v1 + kv_head * stride_v2)[:, None] + dv[None, :],
            mask=kmask[:, None] & (dv < DV)[None, :],
            other=0.0,
        )
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if not PARTIAL:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=row_valid[:, None] & (dv < DV)[None, :],
        )
    else:
        # Partial results of this split: un-normalised acc, running max and sum (decode: qj == 0).
        part = (tile * NUM_Q_HEADS + head).to(tl.int64) * num_splits + split
        tl.store(
            part_o_ptr + part[:, None] * DV + dv[None, :], acc, mask=row_valid[:, None] & (dv < DV)[None, :]
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _paged_attn_combine_kernel(
    part_o_ptr, part_ml_ptr, o_ptr, tile_q0_ptr,
    stride_ot, stride_oh,
    num_splits, NUM_Q_HEADS, DV,
    BS: tl.constexpr, BDV: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(tile_q0_ptr + tile)
    splits = tl.arange(0, BS)
    smask = splits < num_splits
    dv = tl.arange(0, BDV)
    part = (tile * NUM_Q_HEADS + head).to(tl.int64) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=smask, other=-1.0e30)
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(
        part_o_ptr + part[:, None] * DV + dv[None, :], mask=smask[:, None] & (dv < DV)[None, :], other=0.0
    )
    m_max = tl.max(m, axis=0)
    scale = tl.exp(m - m_max)  # splits that saw no key: m = -1e30, l = 0, acc = 0
    total = tl.sum(l_s * scale, axis=0)
    o = tl.sum(acc * scale[:, None], axis=0) / total
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=dv < DV)


def paged_attention_impl(
    args: AttentionArgs,
    *,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each segment's queries over its whole paged context (see module
    docstring), with the tiling exposed (tests force several decode splits / small tiles).

    ``num_splits``: programs per decode (token, KV head) (None: enough to fill the GPU);
    ``block_q``: query tokens per prefill program; ``block_n``: keys per inner step.
    """
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    check_device(q, k_cache, v_cache)
    num_tokens, num_q_heads, head_k_dim = q.shape
    _, block_size, num_kv_heads, head_v_dim = v_cache.shape
    args.group()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs caches with a contiguous last axis")
    bounds, contexts = host_lists(args.cu_seqlens_q, args.seq_lens)
    assert bounds is not None and contexts is not None
    if len(bounds) != len(contexts) + 1:
        raise ValueError(f"cu_seqlens_q has {len(bounds)} entries for {len(contexts)} sequences")
    out = torch.zeros(num_tokens, num_q_heads, head_v_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    q = _inner_contiguous(q)
    tables = args.block_tables.to(device=q.device, dtype=torch.int64)
    if tables.dim() != 2 or (tables.shape[1] > 0 and tables.stride(1) != 1):
        tables = tables.reshape(len(contexts), -1).contiguous()
    call = _AttnCall.make(q, k_cache, v_cache, tables, out, args.scale, block_n)
    if block_q is None:
        block_q = max(1, (64 if not call.wide else 32) // call.group_pad)
    decode, prefill = _work_tiles(bounds, contexts, block_q)
    if prefill:
        call.prefill(prefill, block_q)
    if decode:
        call.decode(decode, num_splits)
    return out


#: The Triton op (default tiling).
paged_attention = paged_attention_op(paged_attention_impl)


Tile = tuple[int, int, int, int]  # (segment, first query token, query tokens, first query position)


def _work_tiles(bounds: list[int], contexts: list[int], block_q: int) -> tuple[list[Tile], list[Tile]]:
    """The decode tiles (one per one-token segment) and the prefill tiles (``block_q`` query
    tokens each), the prefill ones longest key range first."""
    decode: list[Tile] = []
    prefill: list[Tile] = []
    for b, context in enumerate(contexts):
        q_start, q_len = bounds[b], bounds[b + 1] - bounds[b]
        if q_len == 0:
            continue
        if q_len > context:
            raise ValueError(f"segment {b}: {q_len} query tokens but seq_len {context}")
        if q_len == 1:
            decode.append((b, q_start, 1, context - 1))
        else:
            for t0 in range(0, q_len, block_q):
                prefill.append((b, q_start + t0, min(block_q, q_len - t0), context - q_len + t0))
    prefill.sort(key=lambda tile: -(tile[3] + tile[2]))  # longest key ranges first
    return decode, prefill


@dataclass(frozen=True)
class _AttnCall:
    """One ``paged_attention`` call's tensors and tile sizes, shared by its prefill and decode
    launches."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    out: torch.Tensor
    scale: float
    group: int
    group_pad: int
    block_n: int
    bdk: int
    bdv: int
    precision: str
    wide: bool

    @classmethod
    def make(
        cls,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        block_n: int | None,
    ) -> _AttnCall:
        group = q.shape[1] // v_cache.shape[2]
        bdk, bdv = block(q.shape[2]), block(v_cache.shape[3])
        wide = max(bdk, bdv) > 128
        if block_n is None:  # sized so the sm_90 builds do not spill (fp32 operands take twice the room)
            block_n = 32 if wide or q.dtype == torch.float32 else 64
        # input_precision only matters for fp32 operands; 16-bit ones always use the tensor cores.
        precision = dot_precision() if q.dtype == torch.float32 else "tf32"
        return cls(
            q,
            k_cache,
            v_cache,
            tables,
            out,
            scale,
            group,
            next_pow2(group),
            block_n,
            bdk,
            bdv,
            precision,
            wide,
        )

    def _strides(self) -> tuple[int, ...]:
        q, out, k, v = self.q, self.out, self.k_cache, self.v_cache
        return (
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), self.tables.stride(0),
        )  # fmt: skip

    def _shape(self) -> tuple[int, ...]:
        """Query heads, group, head dims, block size: the kernel's runtime shape arguments."""
        return (self.q.shape[1], self.group, self.q.shape[2], self.v_cache.shape[3], self.v_cache.shape[1])

    def _work(self, tiles: list[Tile]) -> list[torch.Tensor]:
        return [index_tensor([tile[i] for tile in tiles], self.q.device) for i in range(4)]

    def prefill(self, tiles: list[Tile], block_q: int) -> None:
        """One program per (prefill tile, KV head)."""
        bm = max(16, block_q * self.group_pad)
        num_kv_heads = self.v_cache.shape[2]
        out = self.out
        _paged_attn_kernel[(len(tiles), num_kv_heads, 1)](
            self.q, self.k_cache, self.v_cache, self.tables, out, out, out, *self._work(tiles),
            *self._strides(), self.scale, 1 << 30, 1, *self._shape(),
            PARTIAL=False, GROUP_PAD=self.group_pad, BLOCK_M=bm, BLOCK_N=self.block_n, BDK=self.bdk,
            BDV=self.bdv, PRECISION=self.precision, DOT_FP32=INTERPRET,
            num_warps=8 if bm * max(self.bdk, self.bdv) >= 64 * 128 else 4,
        )  # fmt: skip

    def decode(self, tiles: list[Tile], num_splits: int | None) -> None:
        """Flash decoding: each (decode token, KV head) split over ``num_splits`` programs (None:
        enough to fill the GPU, at least ~256 keys per split), merged by the combine kernel."""
        num_q_heads, num_kv_heads, head_v_dim = self.q.shape[1], self.v_cache.shape[2], self.v_cache.shape[3]
        device, out = self.q.device, self.out
        max_context = max(tile[3] + 1 for tile in tiles)
        if num_splits is None:
            want = triton.cdiv(2 * num_sms(device), len(tiles) * num_kv_heads)
            num_splits = max(1, min(want, triton.cdiv(max_context, 256)))
        split_size = triton.cdiv(triton.cdiv(max_context, max(1, num_splits)), self.block_n) * self.block_n
        num_splits = triton.cdiv(max_context, split_size)
        seq_t, q0_t, qlen_t, pos0_t = self._work(tiles)
        part_o = part_ml = out
        if num_splits > 1:
            rows = len(tiles) * num_q_heads * num_splits
            part_o = torch.empty(rows, head_v_dim, dtype=torch.float32, device=device)
            part_ml = torch.empty(rows, 2, dtype=torch.float32, device=device)
        _paged_attn_kernel[(len(tiles), num_kv_heads, num_splits)](
            self.q, self.k_cache, self.v_cache, self.tables, out, part_o, part_ml,
            seq_t, q0_t, qlen_t, pos0_t, *self._strides(), self.scale, split_size, num_splits, *self._shape(),
            PARTIAL=num_splits > 1, GROUP_PAD=self.group_pad, BLOCK_M=max(16, self.group_pad),
            BLOCK_N=self.block_n, BDK=self.bdk, BDV=self.bdv, PRECISION=self.precision,
            DOT_FP32=INTERPRET, num_warps=4,
        )  # fmt: skip
        if num_splits > 1:
            _paged_attn_combine_kernel[(len(tiles), num_q_heads)](
                part_o, part_ml, out, q0_t, out.stride(0), out.stride(1),
                num_splits, num_q_heads, head_v_dim,
                BS=next_pow2(num_splits), BDV=self.bdv, num_warps=4,
            )  # fmt: skip
