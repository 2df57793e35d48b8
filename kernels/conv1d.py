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

from deltaserve.kernels.op_args import (
    Capture,
    ConvStepArgs,
    ConvVarlenArgs,
    check_capture_seq,
    conv_step_op,
    conv_varlen_op,
)

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen", "checked_captures"]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")


def _causal_conv1d_varlen(args: ConvVarlenArgs) -> torch.Tensor:
    """Varlen causal conv over ``cu_seqlens`` segments; returns ``y [T, C]`` in ``x.dtype``.

    Every segment is laid out as ``[its K-1 state rows | its inputs]`` in one long time-major
    ``[*, C]`` buffer and convolved at once as K shifted multiply-adds (no padding): output row
    ``start_b + t`` then sees exactly ``x_ext_b[t : t + K]``. Rows that straddle two segments
    are computed and ignored, which is cheaper than one pass per segment. Shift-and-add in the
    time-major layout, not ``F.conv1d``: oneDNN's depthwise convolution over a ``[C, T]`` buffer
    took ~20-40 ms per layer for a 512-token prefill on the CPU, the K multiply-adds ~1 ms, and
    the output comes out ``[T, C]`` contiguous (no transposed copy before the activation).
    """
    x, weight, conv_state, batch = args.x, args.weight, args.conv_state, args.batch
    num_tokens, channels = x.shape
    width = weight.shape[-1] - 1
    device = x.device
    bounds = batch.bounds(num_tokens)
    num_seqs = len(bounds) - 1

    # Initial states, read before any write (see gdn.py), zeros where there is none: torch.where
    # so a never-initialised slot's NaN/inf cannot leak in.
    slots = batch.state_slots.to(device=conv_state.device, dtype=torch.long)
    init = conv_state.index_select(0, slots).float().to(device)  # [B, C, K-1]
    keep = batch.has_initial_state.to(device=device, dtype=torch.bool).view(-1, 1, 1)
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
        if args.bias is not None:
            y += args.bias.float()
        y = _activate(y, args.activation)

    def state_after(b: int, n_inputs: int) -> torch.Tensor:
        # The K-1 rows of x_ext_b ending right after input n_inputs - 1, as [C, K-1].
        return extended[starts[b] + n_inputs : starts[b] + n_inputs + width].t()

    captures = checked_captures([bounds[b + 1] - bounds[b] for b in range(num_seqs)], batch.captures())
    if captures:
        captured = torch.stack([state_after(seq, pos) for seq, pos, _ in captures])
        index = torch.tensor([dst for _, _, dst in captures], dtype=torch.long, device=conv_state.device)
        conv_state.index_copy_(0, index, captured.to(conv_state.device, conv_state.dtype))
    if num_seqs > 0:
        final = torch.stack([state_after(b, bounds[b + 1] - bounds[b]) for b in range(num_seqs)])
        conv_state.index_copy_(0, slots, final.to(conv_state.device, conv_state.dtype))
    return y.to(x.dtype)


#: The reference op.
causal_conv1d_varlen = conv_varlen_op(_causal_conv1d_varlen)


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


def checked_captures(lengths: list[int], captures: list[Capture]) -> list[Capture]:
    """``captures`` of segments of ``lengths``, each checked: any position in its segment (both
    backends' conv takes a capture anywhere)."""
    for seq, pos, _ in captures:
        check_capture_seq(seq, len(lengths))
        if not 0 <= pos <= lengths[seq]:
            raise ValueError(f"capture_pos {pos} outside segment {seq}")
    return captures


def _causal_conv1d_update(args: ConvStepArgs) -> torch.Tensor:
    """One token per sequence: ``x [N, C]`` -> ``y [N, C]``; ``conv_state[state_slots]`` shifted in place."""
    x, conv_state, bias = args.x, args.conv_state, args.bias
    slots = args.state_slots.to(device=conv_state.device, dtype=torch.long)
    state = conv_state.index_select(0, slots).float().to(x.device)  # [N, C, K-1]
    window = torch.cat([state, x.float()[:, :, None]], dim=-1)  # [N, C, K], oldest first
    y = (window * args.weight.float()).sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    y = _activate(y, args.activation)
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.device, conv_state.dtype))
    return y.to(x.dtype)


#: The reference op.
causal_conv1d_update = conv_step_op(_causal_conv1d_update)
