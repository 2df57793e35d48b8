"""Helpers shared by the Triton kernels: block sizes, index tables, launch settings, tiles.

Everything here but ``tile`` (a ``@triton.jit`` helper, inlined into the kernels that call it)
runs on the host. The kernels themselves never see a Python list: each op turns its
``cu_seqlens`` (etc.) into small int64 "work tables" (one row per program) on the op's device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.kernels.op_args import Capture, VarlenBatch, capture_triples

__all__ = [
    "INTERPRET",
    "Segments",
    "block",
    "check_device",
    "dot_precision",
    "host_lists",
    "index_tensor",
    "last_dim_contiguous",
    "next_pow2",
    "num_sms",
    "tile",
    "varlen_segments",
]

# Read once, the way triton.jit reads it: the kernels in this package were decorated in
# interpreter mode iff this is True (see kernels/ops.py, which refuses a mismatched device).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block(n: int, minimum: int = 16) -> int:
    """A power-of-two block covering ``n``, at least ``minimum`` (tl.dot needs every dim >= 16)."""
    return max(minimum, next_pow2(n))


def host_lists(*tensors: torch.Tensor | None) -> list[list[int] | None]:
    """Python int lists of small index tensors, with ONE device-to-host copy for all of them.

    Each op plans its launch on the host from its batch metadata (cu_seqlens, slots, ...); doing
    that with one ``.tolist()`` per tensor would cost one GPU sync each. None stays None.
    """
    present = [t for t in tensors if t is not None]
    on_device = [t for t in present if t.device.type != "cpu"]
    if len(on_device) > 1:
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in on_device]).cpu()
        pieces = iter(flat.split([t.numel() for t in on_device]))
        moved = {id(t): next(pieces) for t in on_device}
    else:
        moved = {}
    out: list[list[int] | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            out.append([int(v) for v in moved.get(id(t), t).reshape(-1).to(torch.int64).tolist()])
    return out


@dataclass(frozen=True)
class Segments:
    """A varlen batch's metadata as host lists, checked (``varlen_segments``)."""

    bounds: list[int]  # cu_seqlens: segment b is tokens [bounds[b], bounds[b + 1])
    lengths: list[int]
    slots: list[int]  # state slot of each segment
    has_init: list[int]  # 1: the segment starts from its slot's state, 0: from zeros
    captures: list[Capture]  # as given (each op checks their segments and positions)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)


def varlen_segments(num_tokens: int, batch: VarlenBatch) -> Segments:
    """The varlen ops' batch metadata on the host (one copy), with ``cu_seqlens`` running from 0
    to ``num_tokens`` without decreasing, one slot and initial-state flag per segment and the
    capture lists given together and equally long."""
    bounds, slots, has_init, cap_seq, cap_pos, cap_slots = host_lists(
        batch.cu_seqlens,
        batch.state_slots,
        batch.has_initial_state,
        batch.capture_seq,
        batch.capture_pos,
        batch.capture_slots,
    )
    assert bounds is not None and slots is not None and has_init is not None
    if not bounds or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T={num_tokens}, got {bounds}")
    lengths = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    if len(slots) != len(lengths) or len(has_init) != len(lengths):
        raise ValueError(f"state_slots / has_initial_state need {len(lengths)} entries")
    captures = capture_triples(cap_seq, cap_pos, cap_slots)
    return Segments(bounds, lengths, slots, [int(bool(v)) for v in has_init], captures)


def index_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device`` (never empty: Triton wants a real pointer even for grid 0)."""
    return torch.tensor(list(values) if len(values) else [0], dtype=torch.int64, device=device)


def dot_precision() -> str:
    """``input_precision`` of the fp32 ``tl.dot``s (GDN; fp32 attention).

    Default ``"tf32x3"``: three TF32 tensor-core products, accurate to ~fp32 (the reference is
    fp32), without the register spills of ``"ieee"`` (FMA) dots at these tile sizes.
    ``DELTASERVE_TRITON_FP32_DOT=tf32`` trades ~1e-3 relative error for speed; ``ieee`` is exact
    fp32. 16-bit operands (bf16/fp16 attention) always use their native tensor-core path.
    The interpreter ignores this (numpy fp32).
    """
    value = os.environ.get("DELTASERVE_TRITON_FP32_DOT", "tf32x3")
    if value not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"DELTASERVE_TRITON_FP32_DOT={value!r}: expected ieee, tf32 or tf32x3")
    return value


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small fixed number under the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def check_device(*tensors: torch.Tensor) -> None:
    """All op tensors on one device (the Triton path never moves data between devices)."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"Triton ops need all tensors on one device, got {sorted(map(str, devices))}")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last axis has stride 1 (other strides are passed to the kernels)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


@triton.jit
def tile(index, BLOCK: tl.constexpr, size):
    """Tile ``index`` of ``BLOCK`` columns over an axis of ``size``: the column indices and
    which of them are inside the axis (the last tile's tail is masked off)."""
    cols = index * BLOCK + tl.arange(0, BLOCK)
    return cols, cols < size
