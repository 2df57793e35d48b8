"""Gated DeltaNet in Triton: chunked varlen prefill and the fused one-token decode step.

Same signatures and semantics as ``kernels/gdn.py`` (the oracle); see its docstring and
docs/contracts.md. Per token, with ``S [Dk, Dv]`` the state of one value head::

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

``chunk_gated_delta_rule`` runs three kernels over a host-built chunk table (one row per chunk of
``chunk_size`` tokens counted from each segment's start, so chunk ends are the capture points):

1. ``_chunk_prep_kernel``, one program per (chunk, value head), independent of any state: the
   within-chunk cumulative log-decay ``G``, the unit lower-triangular system
   ``I + L`` with ``L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)`` (``j < i``), its inverse ``T`` by
   forward substitution, and the WY factors ``W = T (beta exp(G) K)``, ``U = T (beta V)``.
2. ``_chunk_scan_kernel``, one program per (segment, value head, Dv tile), sequential over the
   segment's chunks: the initial state from its slot (zeros without one), then per chunk
   ``V' = U - W S`` and ``S <- exp(G_last) S + (K exp(G_last - G))^T V'``. It saves the state
   entering every chunk (for step 3) and writes the state at every chunk boundary that has a
   capture slot straight into ``ssm_state`` (so a checkpoint capture costs one tile store), and
   the final state into the segment's own slot.
3. ``_chunk_output_kernel``, one program per (chunk, value head, Dv tile):
   ``O = (Q exp(G)) S + ((Q K^T) * exp(G_i - G_j) * [j <= i]) (U - W S)``.

All math is fp32 (``tl.dot`` on fp32 operands as 3xTF32, ~fp32 accurate; see
``_common.dot_precision``); q/k are L2-normalised in the kernels and q is scaled by ``Dk ** -0.5``; value head
``h`` reads key head ``h // (Hv // Hk)``.

Preconditions beyond the reference's: the state slots of one call are distinct from each other and
from its capture slots (the scheduler guarantees it; the reference happens to tolerate aliasing).
Several captures of one boundary are supported (the extra ones are copied after the scan).
Captures off the chunk grid are padded onto it by ``kernels/capture_align.py`` (as for the
reference), so the kernels only ever see grid captures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import triton
import triton.language as tl

from deltaserve.kernels.capture_align import captures_anywhere
from deltaserve.kernels.gdn import _plan_captures
from deltaserve.kernels.op_args import GdnArgs, GdnChunkArgs, GdnStepArgs, gdn_chunk_op, gdn_step_op
from deltaserve.kernels.triton._common import (
    Segments,
    block,
    check_device,
    dot_precision,
    index_tensor,
    last_dim_contiguous,
    num_sms,
    tile,
    varlen_segments,
)

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

_Args = TypeVar("_Args", bound=GdnArgs)

_L2NORM_EPS = 1e-6


@triton.jit
def _load_qk_rows(ptr, tok, row_mask, head, stride_t, stride_h, cols, col_mask, USE_L2NORM: tl.constexpr):
    """``[rows, BK]`` fp32 tile of q or k (one head), L2-normalised per row if asked."""
    x = tl.load(
        ptr + tok[:, None] * stride_t + head * stride_h + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    if USE_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, BT: tl.constexpr):
    """Chunk ``chunk``'s first token, length, ``BT`` row indices, which rows are real tokens and
    their token indices."""
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_len_ptr + chunk)
    rows = tl.arange(0, BT)
    return start, length, rows, rows < length, start + rows


@triton.jit
def _corrected_values(
    w_ptr, u_ptr, tok, row_mask, head, state, NUM_V_HEADS, kcols, kmask, vcols, vmask, DK, DV,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``V' = U - W S`` of one chunk (rows ``tok``), value head and Dv tile, from the WY factors
    that the prep kernel stored and the state ``S`` entering the chunk."""
    out_rows = (tok * NUM_V_HEADS + head).to(tl.int64)
    w = tl.load(
        w_ptr + out_rows[:, None] * DK + kcols[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0
    )
    u = tl.load(
        u_ptr + out_rows[:, None] * DV + vcols[None, :], mask=row_mask[:, None] & vmask[None, :], other=0.0
    )
    return u - tl.dot(w, state, input_precision=PRECISION)


@triton.jit
def _chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr,
    chunk_start_ptr, chunk_len_ptr,
    gcum_ptr, w_ptr, u_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    NUM_V_HEADS, GROUP, DK, DV,
    USE_L2NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    _, length, rows, row_mask, tok = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, BT)
    kcols, kmask = tile(0, BK, DK)

    k = _load_qk_rows(k_ptr, tok, row_mask, head // GROUP, stride_kt, stride_kh, kcols, kmask, USE_L2NORM)
    g = tl.load(g_ptr + tok * stride_gt + head * stride_gh, mask=row_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * stride_bt + head * stride_bh, mask=row_mask, other=0.0).to(tl.float32)
    g_cum = tl.cumsum(g, axis=0)  # padding rows (g = 0) repeat the last real value
    tl.store(gcum_ptr + tok * NUM_V_HEADS + head, g_cum, mask=row_mask)

    # Strictly lower L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j); the exponent is <= 0 there, and
    # is zeroed above the diagonal *before* exp so it cannot overflow.
    lower = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(lower, g_cum[:, None] - g_cum[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    # Forward substitution for M = (I + L)^-1 - I, which is strictly lower too:
    # M[i, :] = -L[i, :] - sum_{j<i} L[i, j] M[j, :]. Start from M = -L and finish row i by
    # row i, each from the already finished rows above it.
    m = tl.where(lower, -(kk * decay * beta[:, None]), 0.0)
    for i in range(1, length):
        pick = rows == i
        row = tl.sum(tl.where(pick[:, None], m, 0.0), axis=0)  # -L[i, :] (zero for columns >= i)
        row = row + tl.sum(row[:, None] * m, axis=0)
        m = tl.where(pick[:, None], row[None, :], m)
    t_inv = m + tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)

    w = tl.dot(t_inv, k * (beta * tl.exp(g_cum))[:, None], input_precision=PRECISION)
    out_rows = (tok * NUM_V_HEADS + head).to(tl.int64)
    tl.store(w_ptr + out_rows[:, None] * DK + kcols[None, :], w, mask=row_mask[:, None] & kmask[None, :])
    for v0 in range(0, DV, BV):
        vcols = v0 + tl.arange(0, BV)
        vmask = row_mask[:, None] & (vcols < DV)[None, :]
        v = tl.load(
            v_ptr + tok[:, None] * stride_vt + head * stride_vh + vcols[None, :], mask=vmask, other=0.0
        ).to(tl.float32)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + out_rows[:, None] * DV + vcols[None, :], u, mask=vmask)


@triton.jit
def _chunk_scan_kernel(
    k_ptr, gcum_ptr, w_ptr, u_ptr, hbuf_ptr, ssm_ptr,
    seq_first_chunk_ptr, seq_num_chunks_ptr, seq_slot_ptr, seq_has_init_ptr, seq_bound_ptr, bound_slot_ptr,
    chunk_start_ptr, chunk_len_ptr,
    stride_kt, stride_kh, stride_s0, stride_s1, stride_s2, stride_s3,
    NUM_V_HEADS, GROUP, DK, DV,
    USE_L2NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kcols, kmask = tile(0, BK, DK)
    vcols, vmask = tile(tl.program_id(2), BV, DV)
    state_mask = kmask[:, None] & vmask[None, :]
    state_off = head * stride_s1 + kcols[:, None] * stride_s2 + vcols[None, :] * stride_s3

    first = tl.load(seq_first_chunk_ptr + seq)
    num_chunks = tl.load(seq_num_chunks_ptr + seq)
    slot = tl.load(seq_slot_ptr + seq)
    has_init = tl.load(seq_has_init_ptr + seq)
    bound = tl.load(seq_bound_ptr + seq)  # this segment's row in the boundary -> capture-slot table

    # A slot without an initial state is never read (it may hold NaN).
    if has_init != 0:
        state = tl.load(ssm_ptr + slot * stride_s0 + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    cap = tl.load(bound_slot_ptr + bound)
    if cap >= 0:
        tl.store(ssm_ptr + cap * stride_s0 + state_off, state.to(ssm_ptr.dtype.element_ty), mask=state_mask)

    for c in range(num_chunks):
        chunk = first + c
        start, length, _, row_mask, tok = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, BT)
        hrow = (chunk * NUM_V_HEADS + head).to(tl.int64) * DK
        tl.store(hbuf_ptr + (hrow + kcols[:, None]) * DV + vcols[None, :], state, mask=state_mask)

        v_new = _corrected_values(
            w_ptr,
            u_ptr,
            tok,
            row_mask,
            head,
            state,
            NUM_V_HEADS,
            kcols,
            kmask,
            vcols,
            vmask,
            DK,
            DV,
            PRECISION,
        )
        g_cum = tl.load(gcum_ptr + tok * NUM_V_HEADS + head, mask=row_mask, other=0.0)
        g_last = tl.load(gcum_ptr + (start + length - 1) * NUM_V_HEADS + head)
        k = _load_qk_rows(k_ptr, tok, row_mask, head // GROUP, stride_kt, stride_kh, kcols, kmask, USE_L2NORM)
        k_decayed = k * tl.exp(g_last - g_cum)[:, None]  # padding rows of k are zero
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PRECISION)

        cap = tl.load(bound_slot_ptr + bound + c + 1)
        if cap >= 0:
            tl.store(
                ssm_ptr + cap * stride_s0 + state_off, state.to(ssm_ptr.dtype.element_ty), mask=state_mask
            )

    tl.debug_barrier()  # every thread has read the initial state before the slot is overwritten
    tl.store(ssm_ptr + slot * stride_s0 + state_off, state.to(ssm_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, gcum_ptr, w_ptr, u_ptr, hbuf_ptr, o_ptr,
    chunk_start_ptr, chunk_len_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    NUM_V_HEADS, GROUP, DK, DV, scale,
    USE_L2NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    _, _, rows, row_mask, tok = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, BT)
    kcols, kmask = tile(0, BK, DK)
    vcols, vmask = tile(tl.program_id(2), BV, DV)

    key_head = head // GROUP
    q = _load_qk_rows(q_ptr, tok, row_mask, key_head, stride_qt, stride_qh, kcols, kmask, USE_L2NORM) * scale
    k = _load_qk_rows(k_ptr, tok, row_mask, key_head, stride_kt, stride_kh, kcols, kmask, USE_L2NORM)
    g_cum = tl.load(gcum_ptr + tok * NUM_V_HEADS + head, mask=row_mask, other=0.0)

    hrow = (chunk * NUM_V_HEADS + head).to(tl.int64) * DK
    state = tl.load(
        hbuf_ptr + (hrow + kcols[:, None]) * DV + vcols[None, :],
        mask=kmask[:, None] & vmask[None, :],
        other=0.0,
    )
    v_new = _corrected_values(
        w_ptr, u_ptr, tok, row_mask, head, state, NUM_V_HEADS, kcols, kmask, vcols, vmask, DK, DV, PRECISION
    )

    # Padding rows are excluded too: their g_cum reads as 0, which would make the exponent > 0.
    causal = (rows[:, None] >= rows[None, :]) & row_mask[:, None]
    decay = tl.exp(tl.where(causal, g_cum[:, None] - g_cum[None, :], 0.0))
    attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
    o = tl.dot(q * tl.exp(g_cum)[:, None], state, input_precision=PRECISION)
    o += tl.dot(attn, v_new, input_precision=PRECISION)
    tl.store(
        o_ptr + tok[:, None] * stride_ot + head * stride_oh + vcols[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_mask[:, None] & vmask[None, :],
    )


def _checked(args: _Args) -> _Args:
    """``args`` with 3-D q, k, v of one token count, whole key-head groups and all tensors on one
    device; q, k, v get a unit last stride (the other strides go to the kernels)."""
    q, k, v = args.q, args.k, args.v
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"expected q, k [T, Hk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    args.group()
    check_device(q, k, v, args.g, args.beta, args.ssm_state)
    return replace(args, q=last_dim_contiguous(q), k=last_dim_contiguous(k), v=last_dim_contiguous(v))


def _chunk_gated_delta_rule(args: GdnChunkArgs) -> torch.Tensor:
    """Chunked gated delta rule over a varlen batch; returns ``o [T, Hv, Dv]`` in ``v.dtype``."""
    args = _checked(args)
    v, chunk_size = args.v, args.chunk_size
    segs = varlen_segments(v.shape[0], args.batch)
    num_chunks = [-(-n // chunk_size) for n in segs.lengths]
    # The reference's validation and "state after pos tokens = state after ceil(pos/C) chunks" plan.
    plan = _plan_captures(segs.lengths, num_chunks, chunk_size, segs.captures)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if segs.num_seqs == 0:
        return out
    tables = _ChunkTables.build(segs, num_chunks, chunk_size, plan)
    call = _ChunkCall.make(args, out, tables, min(chunk_size, max(segs.lengths)))
    if tables.total_chunks > 0:
        call.prep()
    call.scan(segs, tables)
    if tables.total_chunks > 0:
        call.output()
    if tables.extra_dst:
        ssm_state = args.ssm_state
        src = torch.tensor(tables.extra_src, dtype=torch.long, device=ssm_state.device)
        dst = torch.tensor(tables.extra_dst, dtype=torch.long, device=ssm_state.device)
        ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
    return out


@dataclass(frozen=True)
class _ChunkTables:
    """The chunk table (one row per chunk of ``chunk_size`` tokens from each segment's start) and
    the boundary table (boundary ``j`` of segment ``b`` = "after ``j`` chunks", ``j = 0..nc_b``,
    at row ``bound_row[b] + j``), with the capture slot of each boundary (-1: none)."""

    chunk_start: list[int]  # first token of each chunk
    chunk_len: list[int]
    first_chunk: list[int]  # per segment: its first chunk's row
    num_chunks: list[int]  # per segment
    bound_row: list[int]  # per segment: its boundary 0's row
    bound_slot: list[int]
    # a second capture of one boundary: copied from the first's slot after the scan
    extra_src: list[int]
    extra_dst: list[int]

    @property
    def total_chunks(self) -> int:
        return len(self.chunk_start)

    @classmethod
    def build(
        cls, segs: Segments, num_chunks: list[int], chunk_size: int, plan: dict[int, list[tuple[int, int]]]
    ) -> _ChunkTables:
        chunk_start: list[int] = []
        chunk_len: list[int] = []
        first_chunk: list[int] = []
        bound_row: list[int] = []
        num_bounds = 0
        for b, length in enumerate(segs.lengths):
            first_chunk.append(len(chunk_start))
            bound_row.append(num_bounds)
            num_bounds += num_chunks[b] + 1
            for i in range(num_chunks[b]):
                chunk_start.append(segs.bounds[b] + i * chunk_size)
                chunk_len.append(min(chunk_size, length - i * chunk_size))
        bound_slot = [-1] * num_bounds
        extra_src: list[int] = []
        extra_dst: list[int] = []
        for step, entries in plan.items():
            for seq, slot in entries:
                row = bound_row[seq] + step
                if bound_slot[row] < 0:
                    bound_slot[row] = slot
                else:
                    extra_src.append(bound_slot[row])
                    extra_dst.append(slot)
        return cls(
            chunk_start, chunk_len, first_chunk, num_chunks, bound_row, bound_slot, extra_src, extra_dst
        )


@dataclass(frozen=True)
class _ChunkCall:
    """One ``chunk_gated_delta_rule`` call's tensors, fp32 workspaces and tile sizes, shared by
    its three launches."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    ssm_state: torch.Tensor
    out: torch.Tensor
    chunk_start: torch.Tensor  # the chunk table on the device
    chunk_len: torch.Tensor
    total_chunks: int
    # workspaces (fp32): within-chunk cumulative decay, WY factors, state entering each chunk
    gcum: torch.Tensor
    w_buf: torch.Tensor
    u_buf: torch.Tensor
    hbuf: torch.Tensor
    group: int
    bt: int  # tokens per chunk tile
    bk: int
    use_l2: bool
    precision: str

    @classmethod
    def make(
        cls, args: GdnChunkArgs, out: torch.Tensor, tables: _ChunkTables, tokens_per_tile: int
    ) -> _ChunkCall:
        q, k, v = args.q, args.k, args.v
        num_tokens, num_v_heads, head_v_dim = v.shape
        head_k_dim = k.shape[2]
        device, rows = v.device, max(num_tokens, 1)
        return cls(
            q, k, v, args.g, args.beta, args.ssm_state, out,
            index_tensor(tables.chunk_start, device), index_tensor(tables.chunk_len, device), tables.total_chunks,
            torch.empty(rows, num_v_heads, dtype=torch.float32, device=device),
            torch.empty(rows, num_v_heads, head_k_dim, dtype=torch.float32, device=device),
            torch.empty(rows, num_v_heads, head_v_dim, dtype=torch.float32, device=device),
            torch.empty(
                max(tables.total_chunks, 1), num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
            ),
            args.group(), block(tokens_per_tile), block(head_k_dim), args.use_qk_l2norm,
            dot_precision(),
        )  # fmt: skip

    def _dims(self) -> tuple[int, int, int, int]:
        """Value heads, group, Dk, Dv: the kernels' runtime shape arguments."""
        return (self.v.shape[1], self.group, self.k.shape[2], self.v.shape[2])

    def prep(self) -> None:
        """Step 1: one program per (chunk, value head)."""
        k, v, g, beta = self.k, self.v, self.g, self.beta
        bt, bk = self.bt, self.bk
        _chunk_prep_kernel[(self.total_chunks, self.v.shape[1])](
            k, v, g, beta, self.chunk_start, self.chunk_len, self.gcum, self.w_buf, self.u_buf,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), *self._dims(),
            USE_L2NORM=self.use_l2, BT=bt, BK=bk, BV=min(block(v.shape[2]), 64), PRECISION=self.precision,
            num_warps=8 if bt * bk >= 64 * 128 else 4,
        )  # fmt: skip

    def scan(self, segs: Segments, tables: _ChunkTables) -> None:
        """Step 2: one program per (segment, value head, Dv tile); few programs, so narrow Dv
        tiles when that is short of the GPU."""
        num_v_heads, head_v_dim, device = self.v.shape[1], self.v.shape[2], self.v.device
        bv = min(block(head_v_dim), 32)
        while bv > 16 and segs.num_seqs * num_v_heads * triton.cdiv(head_v_dim, bv) < 2 * num_sms(device):
            bv //= 2
        k = self.k
        _chunk_scan_kernel[(segs.num_seqs, num_v_heads, triton.cdiv(head_v_dim, bv))](
            k, self.gcum, self.w_buf, self.u_buf, self.hbuf, self.ssm_state,
            index_tensor(tables.first_chunk, device), index_tensor(tables.num_chunks, device),
            index_tensor(segs.slots, device), index_tensor(segs.has_init, device),
            index_tensor(tables.bound_row, device), index_tensor(tables.bound_slot, device),
            self.chunk_start, self.chunk_len,
            k.stride(0), k.stride(1), *self.ssm_state.stride(), *self._dims(),
            USE_L2NORM=self.use_l2, BT=self.bt, BK=self.bk, BV=bv, PRECISION=self.precision,
            num_warps=4,
        )  # fmt: skip

    def output(self) -> None:
        """Step 3: one program per (chunk, value head, Dv tile)."""
        q, k, out = self.q, self.k, self.out
        head_k_dim, head_v_dim = k.shape[2], self.v.shape[2]
        bv = min(block(head_v_dim), 32)
        _chunk_output_kernel[(self.total_chunks, self.v.shape[1], triton.cdiv(head_v_dim, bv))](
            q, k, self.gcum, self.w_buf, self.u_buf, self.hbuf, out, self.chunk_start, self.chunk_len,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
            *self._dims(), head_k_dim**-0.5,
            USE_L2NORM=self.use_l2, BT=self.bt, BK=self.bk, BV=bv, PRECISION=self.precision,
            num_warps=4,
        )  # fmt: skip


#: The Triton op: captures anywhere (the kernels above take them on their chunk grid only).
chunk_gated_delta_rule = gdn_chunk_op(captures_anywhere(_chunk_gated_delta_rule))


@triton.jit
def _recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slot_ptr, o_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_bt, stride_bh, stride_ot, stride_oh, stride_s0, stride_s1, stride_s2, stride_s3,
    GROUP, DK, DV, scale,
    USE_L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    kcols, kmask = tile(0, BK, DK)
    vcols, vmask = tile(tl.program_id(2), BV, DV)

    q = tl.load(q_ptr + n * stride_qt + key_head * stride_qh + kcols, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_kt + key_head * stride_kh + kcols, mask=kmask, other=0.0).to(tl.float32)
    if USE_L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    g = tl.load(g_ptr + n * stride_gt + head * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + n * stride_bt + head * stride_bh).to(tl.float32)
    v = tl.load(v_ptr + n * stride_vt + head * stride_vh + vcols, mask=vmask, other=0.0).to(tl.float32)

    slot = tl.load(slot_ptr + n)
    state_ptrs = (
        ssm_ptr
        + slot * stride_s0
        + head * stride_s1
        + kcols[:, None] * stride_s2
        + vcols[None, :] * stride_s3
    )
    state_mask = kmask[:, None] & vmask[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(k[:, None] * state, axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    o = tl.sum(q[:, None] * state, axis=0)
    tl.store(state_ptrs, state.to(ssm_ptr.dtype.element_ty), mask=state_mask)
    tl.store(o_ptr + n * stride_ot + head * stride_oh + vcols, o.to(o_ptr.dtype.element_ty), mask=vmask)


def _recurrent_gated_delta_rule(args: GdnStepArgs) -> torch.Tensor:
    """One decode token per sequence, state updated in place on ``ssm_state[state_slots]``."""
    args = _checked(args)
    q, k, v, g, beta, ssm_state = args.q, args.k, args.v, args.g, args.beta, args.ssm_state
    state_slots = args.state_slots
    num_seqs, num_v_heads, head_v_dim = v.shape
    head_k_dim = k.shape[2]
    if state_slots.numel() != num_seqs:
        raise ValueError(f"{state_slots.numel()} state slots for {num_seqs} decode tokens")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    slots = state_slots.to(device=ssm_state.device, dtype=torch.int64)
    # One program per (sequence, value head, Dv tile); narrow tiles when the batch is small.
    bv = min(block(head_v_dim), 64)
    while bv > 16 and num_seqs * num_v_heads * triton.cdiv(head_v_dim, bv) < 4 * num_sms(v.device):
        bv //= 2
    _recurrent_step_kernel[(num_seqs, num_v_heads, triton.cdiv(head_v_dim, bv))](
        q, k, v, g, beta, ssm_state, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        *ssm_state.stride(),
        args.group(), head_k_dim, head_v_dim, head_k_dim**-0.5,
        USE_L2NORM=args.use_qk_l2norm, BK=block(head_k_dim), BV=bv,
        num_warps=4,
    )  # fmt: skip
    return out


#: The Triton op.
recurrent_gated_delta_rule = gdn_step_op(_recurrent_gated_delta_rule)
