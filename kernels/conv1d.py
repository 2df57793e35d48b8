"""Causal depthwise conv1d reference ops on slot-indexed conv state (the GDN short convolution).

Contract (docs/contracts.md, "Kernel ops"); the Triton path must match it exactly.

Shapes: ``x [T, C]`` (pre-activation ``in_proj_qkv`` outputs, channels q | k | v),
``weight [C, K]``, ``bias [C]`` or None, ``conv_state [num_state_slots, C, K - 1]``.
A slot's conv state holds the last ``K - 1`` *inputs* of the conv, oldest first, time on the last
axis (the Hugging Face layout). Output ``y[t, c] = act(bias[c] + sum_i weight[c, i] * x_ext[t + i, c])``
where ``x_ext`` is the segment's conv state followed by its inputs; ``act`` is SiLU for
``activation="silu"`` (or ``"swish"``) and the identity for None. Math in float32, output in
``x.dtype``.

``causal_conv1d_varlen`` (prefill, ``cu_seqlens [B+1]``):

* initial state of segment ``b`` = ``conv_state[state_slots[b]]`` if ``has_initial_state[b]``,
  else zeros (the slot's old content is never read);
* final state (last ``K - 1`` inputs of state + segment; segments shorter than ``K - 1`` keep the
  tail of the old state) is written to ``conv_state[state_slots[b]]``;
* capture ``c``: the state after ``capture_pos[c]`` inputs of segment ``capture_seq[c]`` (an index
  into *this call's* batch) is written to ``conv_state[capture_slots[c]]``. Any
  ``0 <= capture_pos <= length`` works here; the scheduler only asks for GDN chunk boundaries.

``causal_conv1d_update`` (decode): one token per sequence, ``x [N, C]``, state updated in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    capture_seq: torch.Tensor | None = None,
    capture_pos: torch.Tensor | None = None,
    capture_slots: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Varlen causal conv over ``cu_seqlens`` segments; returns ``y [T, C]`` in ``x.dtype``.

    Every segment is laid out as ``[its K-1 state rows | its inputs]`` in one long time-major
    ``[*, C]`` buffer and convolved at once as K shifted multiply-adds (no padding): output row
    ``start_b + t`` then sees exactly ``x_ext_b[t : t + K]``. Rows that straddle two segments
    are computed and ignored, which is cheaper than one pass per segment. Shift-and-add in the
    time-major layout, not ``F.conv1d``: oneDNN's depthwise convolution over a ``[C, T]`` buffer
    took ~20-40 ms per layer for a 512-token prefill on the CPU, the K multiply-adds ~1 ms, and
    the output comes out ``[T, C]`` contiguous (no transposed copy before the activation).
    """
    num_tokens, channels = x.shape
    width = weight.shape[-1] - 1
    device = x.device
    bounds = [int(b) for b in cu_seqlens.tolist()]
    num_seqs = len(bounds) - 1
    if bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T={num_tokens}, got {bounds[0]}..{bounds[-1]}")

    # Initial states, read before any write (see gdn.py), zeros where there is none: torch.where
    # so a never-initialised slot's NaN/inf cannot leak in.
    slots = state_slots.to(device=conv_state.device, dtype=torch.long)
    init = conv_state.index_select(0, slots).float().to(device)  # [B, C, K-1]
    keep = has_initial_state.to(device=device, dtype=torch.bool).view(-1, 1, 1)
    init = torch.where(keep, init, torch.zeros((), dtype=init.dtype, device=device))
    extended, starts = _extend(x, init, bounds)

    y = torch.empty(num_tokens, channels, dtype=torch.float32, device=device)
    if num_tokens > 0:
        conv = _shifted_conv(extended, weight.float())  # [*, C]
        out_row = torch.cat(
            [
                torch.arange(starts[b], starts[b] + bounds[b + 1] - bounds[b], device=device)
                for b in range(num_seqs)
            ]
        )
        y = conv.index_select(0, out_row)
        if bias is not None:
            y += bias.float()
        y = _activate(y, activation)

    def state_after(b: int, n_inputs: int) -> torch.Tensor:
        # The K-1 rows of x_ext_b ending right after input n_inputs - 1, as [C, K-1].
        return extended[starts[b] + n_inputs : starts[b] + n_inputs + width].t()

    captures = _checked_captures(bounds, capture_seq, capture_pos, capture_slots)
    if captures:
        captured = torch.stack([state_after(seq, pos) for seq, pos, _ in captures])
        index = torch.tensor([dst for _, _, dst in captures], dtype=torch.long, device=conv_state.device)
        conv_state.index_copy_(0, index, captured.to(conv_state.device, conv_state.dtype))
    if num_seqs > 0:
        final = torch.stack([state_after(b, bounds[b + 1] - bounds[b]) for b in range(num_seqs)])
        conv_state.index_copy_(0, slots, final.to(conv_state.device, conv_state.dtype))
    return y.to(x.dtype)


def _extend(x: torch.Tensor, init: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``[sum(K-1+L), C]``: every segment's ``K-1`` initial state rows followed by its inputs
    (fp32, time-major); and where each segment's block starts."""
    width = init.shape[-1]
    xf = x.float()  # [T, C]
    pieces: list[torch.Tensor] = []
    starts: list[int] = []
    offset = 0
    for b in range(len(bounds) - 1):
        starts.append(offset)
        pieces += [init[b].t(), xf[bounds[b] : bounds[b + 1]]]
        offset += width + bounds[b + 1] - bounds[b]
    return (torch.cat(pieces, dim=0) if pieces else xf.new_zeros(0, x.shape[1])), starts


def _shifted_conv(extended: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[j] = sum_i weight[:, i] * extended[j + i]`` for every full window: ``[L-K+1, C]``."""
    taps = weight.shape[-1]
    rows = extended.shape[0] - taps + 1
    out = extended[:rows] * weight[:, 0]
    for i in range(1, taps):
        out.addcmul_(extended[i : i + rows], weight[:, i])
    return out


def _checked_captures(
    bounds: list[int],
    capture_seq: torch.Tensor | None,
    capture_pos: torch.Tensor | None,
    capture_slots: torch.Tensor | None,
) -> list[tuple[int, int, int]]:
    """(segment, inputs before the capture, slot) of every capture, checked against the batch."""
    if capture_seq is None and capture_pos is None and capture_slots is None:
        return []
    if capture_seq is None or capture_pos is None or capture_slots is None:
        raise ValueError("capture_seq, capture_pos and capture_slots must be given together")
    seqs, positions, dst = capture_seq.tolist(), capture_pos.tolist(), capture_slots.tolist()
    if not len(seqs) == len(positions) == len(dst):
        raise ValueError("capture_seq, capture_pos and capture_slots must have the same length")
    num_seqs = len(bounds) - 1
    for seq, pos in zip(seqs, positions):
        if not 0 <= seq < num_seqs:
            raise ValueError(f"capture_seq {seq} outside this call's batch of {num_seqs} segments")
        if not 0 <= pos <= bounds[seq + 1] - bounds[seq]:
            raise ValueError(f"capture_pos {pos} outside segment {seq}")
    return list(zip(seqs, positions, dst))


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per sequence: ``x [N, C]`` -> ``y [N, C]``; ``conv_state[state_slots]`` shifted in place."""
    slots = state_slots.to(device=conv_state.device, dtype=torch.long)
    state = conv_state.index_select(0, slots).float().to(x.device)  # [N, C, K-1]
    window = torch.cat([state, x.float()[:, :, None]], dim=-1)  # [N, C, K], oldest first
    y = (window * weight.float()).sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    y = _activate(y, activation)
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.device, conv_state.dtype))
    return y.to(x.dtype)
