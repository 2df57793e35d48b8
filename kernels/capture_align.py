"""Captures at any token of a chunked GDN scan: pad each off-grid capture up to a chunk boundary.

A chunked GDN kernel materialises the recurrent state only at its chunk boundaries (multiples of
``chunk_size`` from a segment's start, and the segment's end). ``captures_anywhere(op)`` lets a
caller ask for the state after *any* number of tokens ``0 <= pos <= length``: right after every
capture point that is off the grid it inserts no-op tokens up to the next chunk boundary, runs
``op`` on the padded batch with the captures moved onto the grid, and returns the real tokens'
outputs. A no-op token has ``q = k = v = 0``, ``g = 0`` and ``beta = 0``: it neither decays nor
writes the state and its output is zero (the kernels pad a segment's last chunk the same way), so
outputs, final states and captured states are those of the unpadded segment.

Cost: at most one extra (partial) chunk of GDN scan per off-grid capture, and a gather of the
layer's q/k/v/g/beta. A batch whose captures are all on the grid is passed through untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltaserve.kernels.op_args import GdnChunkArgs, check_capture_seq

__all__ = ["PaddedLayout", "captures_anywhere", "padded_layout"]

ChunkOp = Callable[[GdnChunkArgs], torch.Tensor]


@dataclass(frozen=True)
class PaddedLayout:
    """Where every token of the padded batch comes from, and where the captures moved to."""

    src: torch.Tensor  # [T'] index into the real tokens; ``T`` (one past the end) is a no-op token
    keep: torch.Tensor  # [T] position of each real token in the padded batch
    cu_seqlens: torch.Tensor  # [B+1] of the padded batch
    capture_pos: torch.Tensor  # [C] the captures' positions in their padded segments


def _checked_positions(bounds: list[int], seqs: list[int], positions: list[int]) -> dict[int, set[int]]:
    """Capture positions per segment, each checked against its segment."""
    num_seqs = len(bounds) - 1
    if len(seqs) != len(positions):
        raise ValueError("capture_seq, capture_pos and capture_slots must have the same length")
    per_seq: dict[int, set[int]] = {}
    for seq, pos in zip(seqs, positions):
        check_capture_seq(seq, num_seqs)
        length = bounds[seq + 1] - bounds[seq]
        if not 0 <= pos <= length:
            raise ValueError(f"capture_pos {pos} of segment {seq} outside 0..{length}")
        per_seq.setdefault(seq, set()).add(pos)
    return per_seq


def padded_layout(
    cu_seqlens: torch.Tensor, capture_seq: torch.Tensor, capture_pos: torch.Tensor, chunk_size: int
) -> PaddedLayout | None:
    """The padded batch that puts every capture on a chunk boundary; None when all already are.

    Only segments with an off-grid capture are padded; in those, every capture (on-grid ones too:
    padding before them shifts them) is moved, in order, to the next boundary of the padded grid.
    """
    bounds = [int(x) for x in cu_seqlens.tolist()]
    seqs, positions = capture_seq.tolist(), capture_pos.tolist()
    per_seq = _checked_positions(bounds, seqs, positions)

    def off_grid(seq: int, pos: int) -> bool:
        return pos % chunk_size != 0 and pos != bounds[seq + 1] - bounds[seq]

    padded = {seq for seq, points in per_seq.items() if any(off_grid(seq, p) for p in points)}
    if not padded:
        return None
    no_op = bounds[-1]  # the row appended to every input: zeros
    pieces: list[torch.Tensor] = []
    new_bounds = [0]
    moved: dict[tuple[int, int], int] = {}
    for seq in range(len(bounds) - 1):
        start, end = bounds[seq], bounds[seq + 1]
        cursor, out_len = start, 0
        for pos in sorted(per_seq.get(seq, ())) if seq in padded else ():
            pieces.append(torch.arange(cursor, start + pos))
            out_len += start + pos - cursor
            cursor = start + pos
            gap = -out_len % chunk_size if start + pos < end else 0
            if gap:
                pieces.append(torch.full((gap,), no_op))
                out_len += gap
            moved[(seq, pos)] = out_len
        pieces.append(torch.arange(cursor, end))
        new_bounds.append(new_bounds[-1] + out_len + end - cursor)
    src = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    device = cu_seqlens.device
    return PaddedLayout(
        src=src.to(device),
        keep=(src != no_op).nonzero().squeeze(1).to(device),
        cu_seqlens=torch.tensor(new_bounds, dtype=cu_seqlens.dtype, device=device),
        capture_pos=torch.tensor(
            [moved.get((s, p), p) for s, p in zip(seqs, positions)], dtype=capture_pos.dtype, device=device
        ),
    )


def captures_anywhere(op: ChunkOp) -> ChunkOp:
    """``op`` (a ``chunk_gated_delta_rule`` implementation whose captures must sit on chunk
    boundaries) taking captures at any position of a segment."""

    # Every GDN layer of a forward passes the same batch tensors: the layout of the last call is
    # kept (with the tensors it was made from, compared by identity) so it is built once per
    # forward, not once per layer. One tuple, replaced whole: safe across threads.
    last: tuple[tuple[object, ...], PaddedLayout | None] = ((), None)

    @functools.wraps(op)
    def chunk_gated_delta_rule(args: GdnChunkArgs) -> torch.Tensor:
        nonlocal last
        batch, chunk_size = args.batch, args.chunk_size
        capture_seq, capture_pos = batch.capture_seq, batch.capture_pos
        if capture_seq is None or capture_pos is None or batch.capture_slots is None:
            return op(args)
        key, (seen, cached) = (batch.cu_seqlens, capture_seq, capture_pos, chunk_size), last
        if len(seen) == 4 and all(a is b for a, b in zip(seen[:3], key[:3])) and seen[3] == chunk_size:
            layout = cached
        else:
            layout = padded_layout(batch.cu_seqlens, capture_seq, capture_pos, chunk_size)
            last = (key, layout)
        if layout is None:
            return op(args)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[layout.src]

        padded_batch = replace(batch, cu_seqlens=layout.cu_seqlens, capture_pos=layout.capture_pos)
        padded = replace(
            args,
            q=pad(args.q),
            k=pad(args.k),
            v=pad(args.v),
            g=pad(args.g),
            beta=pad(args.beta),
            batch=padded_batch,
        )
        return op(padded)[layout.keep]

    return chunk_gated_delta_rule
