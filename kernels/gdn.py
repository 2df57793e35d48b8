"""Gated DeltaNet (GDN) reference ops: chunked varlen prefill and one-token recurrent decode.

Contract (docs/contracts.md, "Kernel ops"); the Triton path must match it exactly.

Shapes: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g [T, Hv]`` float32 log-decay (<= 0),
``beta [T, Hv]``; ``ssm_state [num_state_slots, Hv, Dk, Dv]`` float32 (or bfloat16: read into
float32, rounded only where a state is stored). Value head ``h`` reads
key/query head ``h // (Hv // Hk)``. With ``use_qk_l2norm`` q and k are L2-normalised as
``x * rsqrt(sum(x^2) + 1e-6)``; q is then scaled by ``Dk ** -0.5``. All math runs in float32;
the output ``[T, Hv, Dv]`` comes back in ``v.dtype``.

Per token, with S the ``[Dk, Dv]`` state of one value head::

    S   <- exp(g_t) * S
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T          # delta rule: write only the error
    o_t  = S^T q_t

``chunk_gated_delta_rule`` computes exactly that over a varlen batch (``cu_seqlens [B+1]``), by
chunks of ``chunk_size`` tokens counted from each segment's start:

* initial state of segment ``b``: ``ssm_state[state_slots[b]]`` if ``has_initial_state[b]``,
  else zeros (the slot's old content is never read, so garbage/NaN in it is harmless);
* final state (after the whole segment) is written to ``ssm_state[state_slots[b]]``;
* capture ``c``: the state after ``capture_pos[c]`` tokens of segment ``capture_seq[c]`` is written
  to ``ssm_state[capture_slots[c]]``. ``capture_seq`` indexes *this call's* batch (0..B-1 of its
  ``cu_seqlens``; a model that passes only the prefill part of a batch subtracts ``num_decodes``).
  Any ``0 <= capture_pos <= length`` works. A multiple of ``chunk_size`` or the segment length
  is a point where the chunked scan materialises the state anyway (the capture is a copy);
  another point costs one extra partial chunk (``kernels/capture_align.py`` pads the segment
  there with no-op tokens, for every backend).
* no other slot of ``ssm_state`` is touched.

``recurrent_gated_delta_rule`` is the decode step: one token per sequence (``T == N``), state read
from and written back to ``ssm_state[state_slots]`` in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels.capture_align import captures_anywhere
from deltaserve.kernels.op_args import (
    GDN_CHUNK_SIZE,
    Capture,
    GdnArgs,
    GdnChunkArgs,
    GdnStepArgs,
    check_capture_seq,
    gdn_chunk_op,
    gdn_step_op,
)

__all__ = ["GDN_CHUNK_SIZE", "chunk_gated_delta_rule", "l2norm", "recurrent_gated_delta_rule"]

_L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = _L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (the FLA / Hugging Face convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(args: GdnArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, optional L2 norm, q scaled by ``Dk**-0.5``, heads expanded from Hk to Hv.

    Normalising before the expansion does the work once per key head; ``repeat_interleave`` gives
    value head ``h`` the key head ``h // (Hv // Hk)``, which is the contract's grouping.
    """
    group = args.group()
    qf, kf = args.q.float(), args.k.float()
    if args.use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * args.q.shape[-1] ** -0.5
    if group > 1:
        qf = qf.repeat_interleave(group, dim=-2)
        kf = kf.repeat_interleave(group, dim=-2)
    return qf, kf


def _read_initial_states(
    ssm_state: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """fp32 copy of ``ssm_state[state_slots]``, zeros where ``has_initial_state`` is False.

    ``torch.where`` (not a multiply by the mask) so a never-initialised slot holding NaN/inf
    cannot leak into a fresh sequence.
    """
    slots = state_slots.to(device=ssm_state.device, dtype=torch.long)
    states = ssm_state.index_select(0, slots).float()
    keep = has_initial_state.to(device=ssm_state.device, dtype=torch.bool).view(-1, 1, 1, 1)
    return torch.where(keep, states, torch.zeros((), dtype=states.dtype, device=states.device))


def _write_states(ssm_state: torch.Tensor, slots: list[int], states: torch.Tensor) -> None:
    if not slots:
        return
    index = torch.tensor(slots, dtype=torch.long, device=ssm_state.device)
    ssm_state.index_copy_(0, index, states.to(device=ssm_state.device, dtype=ssm_state.dtype))


def _plan_captures(
    lengths: list[int], num_chunks: list[int], chunk_size: int, captures: list[Capture]
) -> dict[int, list[tuple[int, int]]]:
    """Map "number of chunks scanned" -> [(segment, slot)] for every requested capture.

    The state after ``pos`` tokens is the state after ``ceil(pos / chunk_size)`` chunks: for
    ``pos % chunk_size == 0`` that is exact, and ``pos == length`` is the end of the (padded) last
    chunk, whose padding tokens leave the state unchanged. Key 0 means "the initial state".
    """
    plan: dict[int, list[tuple[int, int]]] = {}
    for seq, pos, slot in captures:
        check_capture_seq(seq, len(lengths))
        length = lengths[seq]
        if not 0 <= pos <= length or (pos % chunk_size != 0 and pos != length):
            raise ValueError(
                f"capture_pos {pos} of segment {seq} (length {length}) must be a multiple of "
                f"chunk_size={chunk_size} or the segment length"
            )
        step = min(-(-pos // chunk_size), num_chunks[seq])
        plan.setdefault(step, []).append((seq, slot))
    return plan


def _chunk_gated_delta_rule(args: GdnChunkArgs) -> torch.Tensor:
    """Chunked gated delta rule over a varlen batch; returns ``o [T, Hv, Dv]`` in ``v.dtype``.

    Algorithm (per chunk of C tokens, everything batched over all chunks of all segments and heads):

    1. Intra-chunk, independent of the incoming state: with ``G = cumsum(g)`` inside the chunk and
       ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` (0 above the diagonal), the C sequential delta
       updates collapse (WY / UT transform) into ``U = A^-1 (beta * V)`` and
       ``W = A^-1 (beta * exp(G) * K)`` with the unit lower-triangular
       ``A = I + strict_lower(beta_i k_i.k_j D[i, j])``.
    2. Inter-chunk scan (sequential over chunks, batched over segments): with incoming state S,
       ``V' = U - W S`` (the part of the values the old state does not already predict),
       ``O = (Q * exp(G)) S + (Q K^T * D) V'`` and
       ``S <- exp(G_last) S + (K * exp(G_last - G))^T V'``.

    Segments are padded to whole chunks with zero q/k/v, ``g = 0`` and ``beta = 0``: such tokens
    neither decay nor update the state, so the state after the padded last chunk is the state
    after the segment's real last token.
    """
    v, chunk_size, ssm_state, batch = args.v, args.chunk_size, args.ssm_state, args.batch
    num_tokens, num_v_heads, head_v_dim = v.shape
    device = v.device
    bounds = batch.bounds(num_tokens)
    num_seqs = len(bounds) - 1
    lengths = [bounds[b + 1] - bounds[b] for b in range(num_seqs)]
    num_chunks = [-(-n // chunk_size) for n in lengths]
    capture_plan = _plan_captures(lengths, num_chunks, chunk_size, batch.captures())

    # Read every initial state before writing anything, so slot aliasing between one sequence's
    # final state and another's initial state (a caller bug, but cheap to be robust to) is harmless.
    states = _read_initial_states(ssm_state, batch.state_slots, batch.has_initial_state).to(device)
    out = torch.zeros(num_tokens, num_v_heads, head_v_dim, dtype=torch.float32, device=device)

    for seq, slot in capture_plan.get(0, []):
        _write_states(ssm_state, [slot], states[seq : seq + 1])

    if sum(num_chunks) > 0:
        # Padded chunk width. When every segment fits in one chunk (a batch of short prompt
        # tails), pad only to the longest one: the math is the same and a batch of 1-token
        # segments does not cost 64x the work. Longer segments keep the full chunk_size, so
        # chunk boundaries (and captures) stay at multiples of chunk_size.
        width = min(chunk_size, max(lengths))
        token_index, valid = _chunk_tokens(bounds, num_chunks, chunk_size, width, device)
        qf, kf = _prepare_qk(args)

        def chunked(x: torch.Tensor) -> torch.Tensor:
            # [T, H, ...] -> [NC, H, C, ...] with padding positions zeroed
            xc = x.float()[token_index]  # [NC, C, H, ...]
            mask = valid.view(*valid.shape, *([1] * (xc.dim() - 2)))
            xc = torch.where(mask, xc, torch.zeros((), dtype=xc.dtype, device=device))
            return xc.transpose(1, 2)

        chunks = _intra_chunk(chunked(qf), chunked(kf), chunked(v), chunked(args.g), chunked(args.beta))
        o_c, states = _scan_chunks(chunks, states, num_chunks, capture_plan, ssm_state)
        # scatter chunk outputs back to the token axis
        out[token_index[valid]] = o_c.transpose(1, 2)[valid]

    if num_seqs > 0:
        _write_states(ssm_state, [int(s) for s in batch.state_slots.tolist()], states)
    return out.to(v.dtype)


#: The reference op: captures anywhere (the scan above takes them on its chunk grid only).
chunk_gated_delta_rule = gdn_chunk_op(captures_anywhere(_chunk_gated_delta_rule))


def _chunk_tokens(
    bounds: list[int], num_chunks: list[int], chunk_size: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NC, width]`` token index of every chunk's rows (0 on padding) and which rows are real."""
    num_seqs = len(num_chunks)
    chunk_first = torch.tensor(
        [bounds[b] + i * chunk_size for b in range(num_seqs) for i in range(num_chunks[b])],
        dtype=torch.long,
        device=device,
    )
    chunk_end = torch.tensor(
        [bounds[b + 1] for b in range(num_seqs) for _ in range(num_chunks[b])],
        dtype=torch.long,
        device=device,
    )
    token_index = chunk_first[:, None] + torch.arange(width, device=device)[None, :]
    valid = token_index < chunk_end[:, None]  # [NC, C]
    return torch.where(valid, token_index, torch.zeros_like(token_index)), valid


@dataclass
class _Chunks:
    """Phase 1's per-chunk quantities (``[NC, H, C, ...]``), independent of the incoming state."""

    u: torch.Tensor  # A^-1 (beta V)
    w: torch.Tensor  # A^-1 (beta exp(G) K)
    attn: torch.Tensor  # (Q K^T) * D, causal with the diagonal
    q_decayed: torch.Tensor  # Q exp(G)
    k_decayed: torch.Tensor  # K exp(G_last - G)
    decay: torch.Tensor  # exp(G_last), [NC, H, 1, 1]


def _intra_chunk(
    q_c: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, g_c: torch.Tensor, beta_c: torch.Tensor
) -> _Chunks:
    """Phase 1 (see ``chunk_gated_delta_rule``): the WY factors and decayed operands per chunk."""
    width, head_v_dim, head_k_dim = q_c.shape[-2], v_c.shape[-1], k_c.shape[-1]
    g_cum = g_c.cumsum(dim=-1)
    causal = torch.ones(width, width, dtype=torch.bool, device=q_c.device).tril()
    # Mask *before* exp: above the diagonal G_i - G_j >= 0 and could overflow.
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = ((k_c @ k_c.transpose(-1, -2)) * decay * beta_c[..., :, None]).tril(-1)
    rhs = torch.cat(
        [v_c * beta_c[..., None], k_c * (beta_c * g_cum.exp())[..., None]],
        dim=-1,
    )
    # unitriangular=True: the solver reads only the strict lower part and assumes ones on the
    # diagonal, i.e. it solves (I + system) X = rhs, one solve for both right-hand sides.
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_c, w_c = solved.split([head_v_dim, head_k_dim], dim=-1)
    return _Chunks(
        u=u_c,
        w=w_c,
        attn=(q_c @ k_c.transpose(-1, -2)) * decay,
        q_decayed=q_c * g_cum.exp()[..., None],
        k_decayed=k_c * (g_cum[..., -1:] - g_cum).exp()[..., None],
        decay=g_cum[..., -1].exp()[..., None, None],
    )


def _scan_chunks(
    chunks: _Chunks,
    states: torch.Tensor,
    num_chunks: list[int],
    capture_plan: dict[int, list[tuple[int, int]]],
    ssm_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: the scan over chunks, all segments at once; the chunk outputs and final states.
    Captures are written as their boundary is reached.

    Segments are sorted by chunk count (descending) so the segments still running at step i are
    a prefix of the order: each step is a slice, and the Python loop runs max(num_chunks) times
    instead of once per chunk of every segment.
    """
    device, num_seqs = states.device, len(num_chunks)
    order = sorted(range(num_seqs), key=lambda b: -num_chunks[b])
    rank = {b: r for r, b in enumerate(order)}
    first_chunk = [0] * num_seqs
    for b in range(1, num_seqs):
        first_chunk[b] = first_chunk[b - 1] + num_chunks[b - 1]
    first_chunk_sorted = torch.tensor([first_chunk[b] for b in order], dtype=torch.long, device=device)
    running = states[torch.tensor(order, dtype=torch.long, device=device)]
    o_c = torch.empty_like(chunks.u)
    active_per_step = [sum(1 for b in order if num_chunks[b] > step) for step in range(num_chunks[order[0]])]
    for step, active in enumerate(active_per_step):
        idx = first_chunk_sorted[:active] + step
        s = running[:active]
        v_new = chunks.u[idx] - chunks.w[idx] @ s
        o_c[idx] = chunks.q_decayed[idx] @ s + chunks.attn[idx] @ v_new
        running[:active] = s * chunks.decay[idx] + chunks.k_decayed[idx].transpose(-1, -2) @ v_new
        for seq, slot in capture_plan.get(step + 1, []):
            r = rank[seq]
            _write_states(ssm_state, [slot], running[r : r + 1])
    return o_c, running[torch.tensor([rank[b] for b in range(num_seqs)], dtype=torch.long, device=device)]


def _recurrent_gated_delta_rule(args: GdnStepArgs) -> torch.Tensor:
    """One decode token per sequence: ``q, k [N, Hk, Dk]``, ``v [N, Hv, Dv]``, ``g, beta [N, Hv]``.

    Reads ``ssm_state[state_slots]``, applies one step of the recurrence, writes the new state back
    to the same slots (in place) and returns ``o [N, Hv, Dv]`` in ``v.dtype``. ``state_slots``
    are distinct (each sequence has its own live slot).

    The state is the large operand (``Hv * Dk * Dv`` floats per sequence, streamed from memory
    every step), so it is read once and updated in place, with no gathered copy: with
    ``d = exp(g)`` and ``S`` the old state, ``k^T (d S) = d (k^T S)`` and
    ``q^T S' = d (q^T S) + (q . k) delta``, so one batched product ``[q; k]^T S`` gives both the
    prediction and the output, then ``S' = d S + k delta^T`` is two in-place passes.
    """
    v, g, beta, ssm_state = args.v, args.g, args.beta, args.ssm_state
    qf, kf = _prepare_qk(args)
    if ssm_state.dtype != torch.float32 or ssm_state.device != v.device or v.device.type != "cpu":
        # (on an accelerator the slot list would cost a host sync per layer; it runs the Triton op)
        return _recurrent_gathered(args, qf, kf)
    decay = g.float().exp()  # [N, H]
    # q^T S and k^T S of every sequence, each from its slot (a view: nothing is copied)
    qk = torch.stack((qf, kf), dim=-2)  # [N, H, 2, Dk]
    slots = [int(x) for x in args.state_slots.tolist()]
    read = torch.stack([torch.bmm(qk[n], ssm_state[slot]) for n, slot in enumerate(slots)])  # [N, H, 2, Dv]
    decay_col = decay[..., None]
    delta = (v.float() - decay_col * read[:, :, 1]) * beta.float()[..., None]  # [N, H, Dv]
    out = decay_col * read[:, :, 0] + (qf * kf).sum(-1, keepdim=True) * delta
    for n, slot in enumerate(slots):
        state = ssm_state[slot]  # [H, Dk, Dv], updated in place
        state.mul_(decay[n].view(-1, 1, 1))
        state.baddbmm_(kf[n].unsqueeze(-1), delta[n].unsqueeze(-2))
    return out.to(v.dtype)


#: The reference op.
recurrent_gated_delta_rule = gdn_step_op(_recurrent_gated_delta_rule)


def _recurrent_gathered(args: GdnStepArgs, qf: torch.Tensor, kf: torch.Tensor) -> torch.Tensor:
    """The decode step on an fp32 copy of the states (a state tensor in another dtype or on
    another device than the inputs, or not on the CPU), written back converted; ``qf, kf`` are
    ``_prepare_qk``'s."""
    v, g, beta, ssm_state = args.v, args.g, args.beta, args.ssm_state
    slots = args.state_slots.to(device=ssm_state.device, dtype=torch.long)
    s = ssm_state.index_select(0, slots).float().to(v.device)  # [N, H, Dk, Dv]
    s = s * g.float().exp()[..., None, None]
    predicted = torch.einsum("nhk,nhkv->nhv", kf, s)
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + kf[..., :, None] * delta[..., None, :]
    out = torch.einsum("nhk,nhkv->nhv", qf, s)
    ssm_state.index_copy_(0, slots, s.to(device=ssm_state.device, dtype=ssm_state.dtype))
    return out.to(v.dtype)
