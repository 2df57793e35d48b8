"""Paged KV cache reference ops: ``store_kv`` and ``paged_attention`` (prefill with a cached prefix, decode).

Contract (docs/contracts.md, "Cache tensors" and "Kernel ops"); the Triton path must match it exactly.

* ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``; the flat KV slot of the token at position
  ``p`` of a sequence is ``block_table[p // block_size] * block_size + p % block_size``.
* ``store_kv(key, value, k_cache, v_cache, slot_mapping)``: ``key, value [T, Hkv, D]`` written to
  their flat slots; slot ``-1`` means "do not store" (e.g. padding).
* ``paged_attention(q [T, Hq, D], ..., block_tables [B, M], cu_seqlens_q [B+1], seq_lens [B], scale)``:
  query token ``j`` of segment ``b`` sits at position ``seq_lens[b] - qlen_b + j`` and attends
  causally to positions ``[0, that]``, all read from the paged cache (so ``store_kv`` this step's
  keys first). Query head ``h`` reads KV head ``h // (Hq // Hkv)``. Decode is ``qlen_b == 1``.
  Softmax in float32; output ``[T, Hq, Dv]`` in ``q.dtype``.

This is the oracle, so prefill segments are written for clarity: one sequence at a time, gather
its K/V through its block table into a dense ``[seq_len, Hkv, D]`` tensor, masked softmax. The
decodes (one query each) are the CPU serving path's hot loop: all of them in one batch, each KV
head's slice of the gathered context read in place (``_batched_decode``).
"""

from __future__ import annotations

import torch

from deltaserve.kernels.op_args import AttentionArgs, StoreKVArgs, paged_attention_op, store_kv_op

__all__ = ["paged_attention", "store_kv"]

# Query rows per score tile: bounds the [Hq, tile, seq_len] fp32 score matrix of a long prefill.
_QUERY_TILE = 512


def _store_kv(args: StoreKVArgs) -> None:
    """Write ``key/value [T, Hkv, D]`` into the paged caches at ``slot_mapping [T]``; ``-1`` is skipped."""
    k_cache, v_cache = args.k_cache, args.v_cache
    block_size = k_cache.shape[1]
    slots = args.slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    # (block, offset) indexing instead of a flat view: works for any cache strides.
    block, offset = slots // block_size, slots % block_size
    k_cache[block, offset] = args.key.to(k_cache.device)[keep].to(k_cache.dtype)
    v_cache[block, offset] = args.value.to(v_cache.device)[keep].to(v_cache.dtype)


#: The reference op.
store_kv = store_kv_op(_store_kv)


def _paged_attention(args: AttentionArgs) -> torch.Tensor:
    """Causal attention of each segment's queries over its whole paged context; see module docstring."""
    q, k_cache, v_cache, block_tables, scale = (
        args.q,
        args.k_cache,
        args.v_cache,
        args.block_tables,
        args.scale,
    )
    num_tokens, num_q_heads, _ = q.shape
    _, block_size, _, head_v_dim = v_cache.shape
    group = args.group()
    bounds = [int(b) for b in args.cu_seqlens_q.tolist()]
    context_lens = [int(n) for n in args.seq_lens.tolist()]
    out = torch.zeros(num_tokens, num_q_heads, head_v_dim, dtype=q.dtype, device=q.device)

    # Decode segments (one query token) are batched: one gather and two batched matmuls for all
    # of them instead of a Python iteration each — this is the CPU serving path, not only the oracle.
    decodes = [b for b in range(len(context_lens)) if bounds[b + 1] - bounds[b] == 1]
    if decodes:
        _batched_decode(q, k_cache, v_cache, block_tables, bounds, context_lens, decodes, scale, group, out)
        done = set(decodes)
    else:
        done = set()

    for b, context in enumerate(context_lens):
        q_start, q_end = bounds[b], bounds[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or b in done:
            continue
        if q_len > context:
            raise ValueError(f"segment {b}: {q_len} query tokens but seq_len {context}")
        num_blocks = -(-context // block_size)
        blocks = block_tables[b, :num_blocks].to(device=k_cache.device, dtype=torch.long)
        # Dense [context, Hq, D] view of the sequence: blocks in table order, tail of the last block cut.
        keys = k_cache[blocks].flatten(0, 1)[:context].to(q.device).float()
        values = v_cache[blocks].flatten(0, 1)[:context].to(q.device).float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        key_pos = torch.arange(context, device=q.device)

        for tile_start in range(0, q_len, _QUERY_TILE):
            tile_end = min(tile_start + _QUERY_TILE, q_len)
            queries = q[q_start + tile_start : q_start + tile_end].float()  # [n, Hq, D]
            query_pos = context - q_len + torch.arange(tile_start, tile_end, device=q.device)
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
            # Every query sees at least position 0, so no row is fully masked (no NaN softmax).
            visible = key_pos[None, :] <= query_pos[:, None]  # [n, context]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_start + tile_start : q_start + tile_end] = torch.einsum("hqk,khd->qhd", probs, values).to(
                q.dtype
            )
    return out


#: The reference op.
paged_attention = paged_attention_op(_paged_attention)


def _batched_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bounds: list[int],
    context_lens: list[int],
    decodes: list[int],
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    """Attention of one query token per listed segment, all segments in one batched computation.

    The context is read once: the blocks are gathered into ``[Bd, K, Hkv, D]`` and each KV
    head's slice of it (row stride ``Hkv * D``) goes to the batched products as it is, without
    the head-major copy an einsum over all heads makes, nor a head-repeated copy per query head.
    """
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    contexts = [context_lens[b] for b in decodes]
    if min(contexts) < 1:
        raise ValueError("a decode segment needs seq_len >= 1")
    num_blocks = -(-max(contexts) // block_size)
    rows = torch.tensor(decodes, device=block_tables.device)
    tables = block_tables[rows, :num_blocks].to(device=k_cache.device, dtype=torch.long)  # [Bd, nb]
    batch, width = len(decodes), num_blocks * block_size
    flat = tables.reshape(-1)
    keys = k_cache.index_select(0, flat).view(batch, width, num_kv_heads, -1).to(q.device).float()
    values = v_cache.index_select(0, flat).view(batch, width, num_kv_heads, -1).to(q.device).float()
    # Positions past a sequence's end (block tails, other requests' stale data) may hold any
    # value, even inf/NaN: a zero probability times NaN is NaN, so zero them (in the gathered
    # copy: only each sequence's tail).
    for i, context in enumerate(contexts):
        if context < width:
            values[i, context:].zero_()
    token_rows = torch.tensor([bounds[b] for b in decodes], device=q.device)
    queries = (
        q[token_rows].float().view(batch, num_kv_heads, group, -1) * scale
    )  # head h -> kv head h // group
    ctx = torch.tensor(contexts, device=q.device)
    hidden = torch.arange(width, device=q.device)[None, None, :] >= ctx[:, None, None]  # [Bd, 1, K]
    res = torch.empty(batch, num_kv_heads, group, values.shape[-1], dtype=torch.float32, device=q.device)
    for h in range(num_kv_heads):
        scores = torch.bmm(queries[:, h], keys[:, :, h].transpose(1, 2))  # [Bd, group, K]
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        res[:, h] = torch.bmm(probs, values[:, :, h])
    out[token_rows] = res.reshape(batch, num_kv_heads * group, -1).to(q.dtype)
