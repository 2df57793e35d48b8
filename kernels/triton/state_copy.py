"""Batched state slot copy in Triton: ``copy_state_slots(tensors, src_slots, dst_slots)``.

Same signature and semantics as ``kernels/state_copy.py`` (the oracle): ``t[dst[i]] = t[src[i]]``
on axis 0 of every tensor, as a simultaneous copy (all sources read before any destination is
written), distinct destinations (checked), empty lists a no-op.

One launch copies every (tensor, pair) at once: the kernel gets a table of base addresses (one
per tensor, as int64), the row length and the row stride (dim-0 stride) of each tensor in 32-bit
words, and moves words. Each row must be contiguous and a whole number of words, its stride a
whole number of words (true for the contracts.md state tensors, contiguous or views of a shared
arena, and for the arena's KV block rows; any other tensor falls back to ``index_copy_``). When a slot is both a source and a destination the copy is
staged through a scratch buffer (two launches), which keeps the simultaneous-copy semantics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deltaserve.kernels.op_args import slot_copy_op

__all__ = ["copy_state_slots"]

_WORDS_PER_PROGRAM = 2048


@triton.jit
def _copy_rows_kernel(
    src_base_ptr, dst_base_ptr, row_words_ptr, src_stride_ptr, dst_stride_ptr, src_rows_ptr, dst_rows_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    pair = tl.program_id(1)
    tensor = tl.program_id(2)
    row_words = tl.load(row_words_ptr + tensor)
    if chunk * BLOCK < row_words:
        src = tl.load(src_base_ptr + tensor).to(tl.pointer_type(tl.int32))
        dst = tl.load(dst_base_ptr + tensor).to(tl.pointer_type(tl.int32))
        src_row = tl.load(src_rows_ptr + pair)
        dst_row = tl.load(dst_rows_ptr + pair)
        # int64 strides and rows: an arena's row offset passes 2**31 words on a large GPU
        src_stride = tl.load(src_stride_ptr + tensor)
        dst_stride = tl.load(dst_stride_ptr + tensor)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        words = tl.load(src + src_row * src_stride + offs, mask=mask)
        tl.store(dst + dst_row * dst_stride + offs, words, mask=mask)


def _word_rows(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(32-bit words per slot row, dim-0 stride in words), or None when a row is not contiguous
    whole words or the stride not whole words."""
    if tensor.dim() == 0 or tensor.shape[0] == 0 or not tensor[0].is_contiguous():
        return None
    item = tensor.element_size()
    row_bytes = tensor[0].numel() * item
    stride_bytes = tensor.stride(0) * item
    if row_bytes == 0 or row_bytes % 4 or stride_bytes % 4 or tensor.data_ptr() % 4:
        return None
    if tensor.shape[0] > 1 and stride_bytes < row_bytes:
        return None  # rows overlap: not a slot-major layout
    return row_bytes // 4, stride_bytes // 4


def _launch(
    device: torch.device,
    src_bases: list[int],
    dst_bases: list[int],
    row_words: list[int],
    src_strides: list[int],
    dst_strides: list[int],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    table = torch.tensor(
        [src_bases, dst_bases, row_words, src_strides, dst_strides], dtype=torch.int64, device=device
    )
    grid = (triton.cdiv(max(row_words), _WORDS_PER_PROGRAM), src_rows.numel(), len(row_words))
    _copy_rows_kernel[grid](
        table[0], table[1], table[2], table[3], table[4], src_rows, dst_rows,
        BLOCK=_WORDS_PER_PROGRAM, num_warps=4,
    )  # fmt: skip


def _copy_state_slots(tensors: Sequence[torch.Tensor], src_cpu: torch.Tensor, dst_cpu: torch.Tensor) -> None:
    """Copy ``t[src_slots] -> t[dst_slots]`` on axis 0 of every tensor, in place."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, tuple[int, int]]]] = {}
    for tensor in tensors:
        num_slots = tensor.shape[0] if tensor.dim() else 0
        if (
            int(src_cpu.max()) >= num_slots
            or int(dst_cpu.max()) >= num_slots
            or min(src_cpu.min(), dst_cpu.min()) < 0
        ):
            raise IndexError(f"slot out of range for a tensor of {num_slots} slots")
        words = _word_rows(tensor)
        if words is None:  # not a plain contiguous slot-major tensor: let torch do it
            dev_src, dev_dst = src_cpu.to(tensor.device), dst_cpu.to(tensor.device)
            tensor.index_copy_(0, dev_dst, tensor.index_select(0, dev_src))
            continue
        by_device.setdefault(tensor.device, []).append((tensor, words))

    overlap = bool(set(src_cpu.tolist()) & set(dst_cpu.tolist()))
    pairs = src_cpu.numel()
    for device, group in by_device.items():
        src = src_cpu.to(device)
        dst = dst_cpu.to(device)
        bases = [t.data_ptr() for t, _ in group]
        words = [w for _, (w, _) in group]
        strides = [s for _, (_, s) in group]
        if not overlap:
            _launch(device, bases, bases, words, strides, strides, src, dst)
            continue
        # Stage: sources -> scratch (tensor i owns pairs * words[i] words), then scratch -> destinations.
        scratch = torch.empty(pairs * sum(words), dtype=torch.int32, device=device)
        offsets = [0]
        for w in words[:-1]:
            offsets.append(offsets[-1] + pairs * w)
        scratch_bases = [scratch.data_ptr() + 4 * off for off in offsets]
        rows = torch.arange(pairs, dtype=torch.int64, device=device)
        _launch(device, bases, scratch_bases, words, strides, words, src, rows)
        _launch(device, scratch_bases, bases, words, words, strides, rows, dst)


#: The Triton op (slot lists checked by ``op_args.slot_copy_op``, as for the reference).
copy_state_slots = slot_copy_op(_copy_state_slots)
