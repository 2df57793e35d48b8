"""Causal depthwise conv1d (the GDN short convolution) in Triton, on slot-indexed conv state.

Same signatures and semantics as ``kernels/conv1d.py`` (the oracle) and docs/contracts.md:
``x [T, C]``, ``weight [C, K]``, ``bias [C]`` or None, ``conv_state [slots, C, K - 1]`` holding the
last ``K - 1`` inputs, oldest first; ``y = act(bias + sum_i weight[:, i] * x_ext[t + i])`` with
``x_ext`` = the segment's conv state followed by its inputs; SiLU fused; fp32 math, output in
``x.dtype``.

``causal_conv1d_varlen`` launches:

1. ``_conv_varlen_kernel``, one program per (token tile of a segment, channel tile), reading taps
   that fall before the segment from its initial state (zeros without one; never read then);
2. ``_conv_state_kernel`` for the captures, then again for the final states: one program per
   (state to write, channel tile) gathers the ``K - 1`` inputs ending at the given position (from
   the segment's inputs, or the tail of its initial state for positions < K - 1). Captures run
   first because they may read the initial state that the final-state write replaces.

``causal_conv1d_update``: one program per (sequence, channel tile) reads the window, writes the
output and the shifted state in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.conv1d import checked_captures
from deltaserve.kernels.op_args import ConvArgs, ConvStepArgs, ConvVarlenArgs, conv_step_op, conv_varlen_op
from deltaserve.kernels.triton._common import (
    Segments,
    block,
    check_device,
    index_tensor,
    next_pow2,
    tile,
    varlen_segments,
)

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]

_TOKEN_TILE = 32  # conv varlen tile: 32 tokens x 64 channels (no register spills on sm_90)
_VARLEN_CHANNEL_TILE = 64
_CHANNEL_TILE = 256  # decode / state kernels: one row of channels


def _activation_flag(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")


@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, state_ptr,
    tile_seq_ptr, tile_start_ptr, tile_off_ptr, tile_len_ptr, seq_slot_ptr, seq_has_init_ptr,
    stride_xt, stride_yt, stride_wc, stride_wk, stride_s0, stride_s1, stride_s2,
    C,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    work = tl.program_id(0)  # the token tile's row in the work table
    seq = tl.load(tile_seq_ptr + work)
    seg_start = tl.load(tile_start_ptr + work)  # token index of the segment's first input
    offset = tl.load(tile_off_ptr + work)  # first row of this tile, counted in the segment
    length = tl.load(tile_len_ptr + work)
    slot = tl.load(seq_slot_ptr + seq)
    has_init = tl.load(seq_has_init_ptr + seq)
    rows = tl.arange(0, BT)
    row_mask = rows < length
    cols, col_mask = tile(tl.program_id(1), BC, C)

    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(KW):
        pos = offset + rows + (i - (KW - 1))  # input index in the segment; < 0: from the state
        in_x = row_mask & (pos >= 0)
        xv = tl.load(
            x_ptr + (seg_start + pos)[:, None] * stride_xt + cols[None, :],
            mask=in_x[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if has_init != 0:
            in_state = row_mask & (pos < 0)
            sv = tl.load(
                state_ptr
                + slot * stride_s0
                + cols[None, :] * stride_s1
                + (pos + (KW - 1))[:, None] * stride_s2,
                mask=in_state[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            xv += sv
        wi = tl.load(w_ptr + cols * stride_wc + i * stride_wk, mask=col_mask, other=0.0).to(tl.float32)
        acc += xv * wi[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + (seg_start + offset + rows)[:, None] * stride_yt + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr,
    job_seq_ptr, job_pos_ptr, job_dst_ptr, seq_start_ptr, seq_slot_ptr, seq_has_init_ptr,
    stride_xt, stride_s0, stride_s1, stride_s2,
    C,
    KW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    job = tl.program_id(0)
    seq = tl.load(job_seq_ptr + job)
    n_inputs = tl.load(job_pos_ptr + job)
    dst = tl.load(job_dst_ptr + job)
    seg_start = tl.load(seq_start_ptr + seq)
    slot = tl.load(seq_slot_ptr + seq)
    has_init = tl.load(seq_has_init_ptr + seq)
    cols, col_mask = tile(tl.program_id(1), BC, C)
    j = tl.arange(0, BW)
    j_mask = j < KW - 1
    pos = n_inputs - (KW - 1) + j  # input index in the segment of state column j
    value = tl.load(
        x_ptr + (seg_start + pos)[None, :] * stride_xt + cols[:, None],
        mask=col_mask[:, None] & (j_mask & (pos >= 0))[None, :],
        other=0.0,
    ).to(state_ptr.dtype.element_ty)
    if has_init != 0:
        old = tl.load(
            state_ptr + slot * stride_s0 + cols[:, None] * stride_s1 + (pos + (KW - 1))[None, :] * stride_s2,
            mask=col_mask[:, None] & (j_mask & (pos < 0))[None, :],
            other=0.0,
        )
        value = tl.where((pos < 0)[None, :], old, value)
    tl.debug_barrier()  # dst may be the slot read above (final state of a short segment)
    tl.store(
        state_ptr + dst * stride_s0 + cols[:, None] * stride_s1 + j[None, :] * stride_s2,
        value,
        mask=col_mask[:, None] & j_mask[None, :],
    )


def _prepared(args: ConvArgs) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """The SiLU flag, ``x`` (``[T, C]`` or ``[N, C]``) with a unit channel stride and the output
    ``y`` like it, once the activation and the devices are checked."""
    silu = _activation_flag(args.activation)
    rows, channels = args.x.shape
    check_device(args.x, args.weight, args.bias, args.conv_state)
    x = args.x if args.x.stride(-1) == 1 else args.x.contiguous()
    return silu, x, torch.empty(rows, channels, dtype=x.dtype, device=x.device)


def _causal_conv1d_varlen(args: ConvVarlenArgs) -> torch.Tensor:
    """Varlen causal conv over ``cu_seqlens`` segments; returns ``y [T, C]`` in ``x.dtype``."""
    silu, x, y = _prepared(args)
    weight, bias, conv_state = args.weight, args.bias, args.conv_state
    segs = varlen_segments(x.shape[0], args.batch)
    captures = checked_captures(segs.lengths, segs.captures)
    if segs.num_seqs == 0:
        return y
    seq_slot = index_tensor(segs.slots, x.device)
    seq_init = index_tensor(segs.has_init, x.device)
    _launch_conv(x, weight, bias, y, conv_state, segs, seq_slot, seq_init, silu)
    if weight.shape[-1] > 1:
        seq_start = index_tensor(segs.bounds[:-1], x.device)
        finals = [(b, segs.lengths[b], segs.slots[b]) for b in range(segs.num_seqs)]
        # captures first: they may read an initial state that the finals overwrite
        for job in (captures, finals):
            if job:
                _launch_state_writes(x, weight.shape[-1], conv_state, job, seq_start, seq_slot, seq_init)
    return y


#: The Triton op.
causal_conv1d_varlen = conv_varlen_op(_causal_conv1d_varlen)


def _launch_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    conv_state: torch.Tensor,
    segs: Segments,
    seq_slot: torch.Tensor,
    seq_init: torch.Tensor,
    silu: bool,
) -> None:
    """The outputs: one program per (token tile of a segment, channel tile)."""
    tile_seq: list[int] = []
    tile_start: list[int] = []
    tile_off: list[int] = []
    tile_len: list[int] = []
    for b, n in enumerate(segs.lengths):
        for off in range(0, n, _TOKEN_TILE):
            tile_seq.append(b)
            tile_start.append(segs.bounds[b])
            tile_off.append(off)
            tile_len.append(min(_TOKEN_TILE, n - off))
    if not tile_seq:
        return
    channels, device = x.shape[1], x.device
    bc = min(block(channels, 1), _VARLEN_CHANNEL_TILE)
    bt = block(min(_TOKEN_TILE, max(segs.lengths)), 1)
    _conv_varlen_kernel[(len(tile_seq), triton.cdiv(channels, bc))](
        x, weight, bias if bias is not None else weight, y, conv_state,
        index_tensor(tile_seq, device), index_tensor(tile_start, device), index_tensor(tile_off, device),
        index_tensor(tile_len, device), seq_slot, seq_init,
        x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride(),
        channels,
        KW=weight.shape[-1], HAS_BIAS=bias is not None, SILU=silu, BT=bt, BC=bc,
        num_warps=4,
    )  # fmt: skip


def _launch_state_writes(
    x: torch.Tensor,
    kernel: int,
    conv_state: torch.Tensor,
    job: list[tuple[int, int, int]],
    seq_start: torch.Tensor,
    seq_slot: torch.Tensor,
    seq_init: torch.Tensor,
) -> None:
    """Conv states after given inputs of their segments: one program per (state, channel tile)."""
    channels, device = x.shape[1], x.device
    bc = min(block(channels, 1), _CHANNEL_TILE)
    _conv_state_kernel[(len(job), triton.cdiv(channels, bc))](
        x, conv_state,
        index_tensor([j[0] for j in job], device), index_tensor([j[1] for j in job], device),
        index_tensor([j[2] for j in job], device), seq_start, seq_slot, seq_init,
        x.stride(0), *conv_state.stride(),
        channels,
        KW=kernel, BW=max(2, next_pow2(kernel - 1)), BC=bc,
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, state_ptr, slot_ptr,
    stride_xt, stride_yt, stride_wc, stride_wk, stride_s0, stride_s1, stride_s2,
    C,
    KW: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    cols, col_mask = tile(tl.program_id(1), BC, C)
    j = tl.arange(0, BW)
    j_mask = j < KW - 1
    mask2 = col_mask[:, None] & j_mask[None, :]
    state_row = state_ptr + slot * stride_s0 + cols * stride_s1
    old = tl.load(state_row[:, None] + j[None, :] * stride_s2, mask=mask2, other=0.0)  # window columns 0..K-2
    xv = tl.load(x_ptr + n * stride_xt + cols, mask=col_mask, other=0.0)
    w_old = tl.load(w_ptr + cols[:, None] * stride_wc + j[None, :] * stride_wk, mask=mask2, other=0.0)
    w_new = tl.load(w_ptr + cols * stride_wc + (KW - 1) * stride_wk, mask=col_mask, other=0.0)
    acc = tl.sum(old.to(tl.float32) * w_old.to(tl.float32), axis=1) + xv.to(tl.float32) * w_new.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + n * stride_yt + cols, acc.to(y_ptr.dtype.element_ty), mask=col_mask)
    tl.debug_barrier()  # the whole old window is read before it is shifted in place
    # Shift left by one input: column j-1 <- old column j, the last column <- x.
    tl.store(state_row[:, None] + (j - 1)[None, :] * stride_s2, old, mask=mask2 & (j >= 1)[None, :])
    tl.store(state_row + (KW - 2) * stride_s2, xv.to(state_ptr.dtype.element_ty), mask=col_mask)


def _causal_conv1d_update(args: ConvStepArgs) -> torch.Tensor:
    """One token per sequence: ``x [N, C]`` -> ``y [N, C]``; ``conv_state[state_slots]`` shifted in place."""
    silu, x, y = _prepared(args)
    weight, bias, conv_state, state_slots = args.weight, args.bias, args.conv_state, args.state_slots
    num_seqs, channels = x.shape
    kernel = weight.shape[-1]
    if state_slots.numel() != num_seqs:
        raise ValueError(f"{state_slots.numel()} state slots for {num_seqs} decode tokens")
    if num_seqs == 0:
        return y
    if kernel < 2:
        raise ValueError("causal_conv1d_update needs a conv kernel of width >= 2 (a non-empty state)")
    slots = state_slots.to(device=conv_state.device, dtype=torch.int64)
    bc = min(block(channels, 1), _CHANNEL_TILE)
    _conv_update_kernel[(num_seqs, triton.cdiv(channels, bc))](
        x, weight, bias if bias is not None else weight, y, conv_state, slots,
        x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride(),
        channels,
        KW=kernel, BW=max(2, next_pow2(kernel - 1)), HAS_BIAS=bias is not None, SILU=silu, BC=bc,
        num_warps=4,
    )  # fmt: skip
    return y


#: The Triton op.
causal_conv1d_update = conv_step_op(_causal_conv1d_update)
