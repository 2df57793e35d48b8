"""store_kv + paged_attention vs dense causal attention on the unpaged sequence (float64, per query)."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.kernels.attention import paged_attention, store_kv

HEAD_DIM = 16
NUM_BLOCKS = 64


def oracle_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the *last* n positions of a context whose keys/values [L, Hkv, D] are given."""
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(n, num_q_heads, values.shape[-1], dtype=torch.float64)
    for j in range(n):
        pos = length - n + j
        for h in range(num_q_heads):
            kh = keys[: pos + 1, h // group].double()
            logits = kh @ q[j, h].double() * scale
            weights = torch.exp(logits - logits.max())
            out[j, h] = (weights / weights.sum()) @ values[: pos + 1, h // group].double()
    return out


def flat_slots(block_table: list[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


# (cached prefix length, new query tokens): fresh prefill, cached prefixes ending mid-block and on a
# block boundary, decodes at / across block boundaries.
CASES = [(0, 7), (5, 3), (16, 1), (15, 1), (17, 1), (3, 16), (32, 9), (0, 1), (40, 25)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_paged_prefill_and_decode_match_dense(
    block_size: int, num_q_heads: int, num_kv_heads: int, rng: torch.Generator
) -> None:
    k_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=rng)
    v_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=rng)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=rng).tolist()  # shuffled, non-contiguous
    scale = HEAD_DIM**-0.5
    # Decodes first, as in a real batch; then prefills.
    cases = sorted(CASES, key=lambda c: c[1] != 1)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in cases)

    tables, dense_k, dense_v, queries = [], [], [], []
    new_k, new_v, new_slots = [], [], []
    for cached, n in cases:
        length = cached + n
        table = [free_blocks.pop() for _ in range(math.ceil(length / block_size))]
        keys = torch.randn(length, num_kv_heads, HEAD_DIM, generator=rng)
        values = torch.randn(length, num_kv_heads, HEAD_DIM, generator=rng)
        # The cached prefix was stored by an earlier step.
        store_kv(
            keys[:cached],
            values[:cached],
            k_cache,
            v_cache,
            torch.tensor(flat_slots(table, range(cached), block_size), dtype=torch.long),
        )
        new_k.append(keys[cached:])
        new_v.append(values[cached:])
        new_slots += flat_slots(table, range(cached, length), block_size)
        tables.append(table + [0] * (max_blocks - len(table)))
        dense_k.append(keys)
        dense_v.append(values)
        queries.append(torch.randn(n, num_q_heads, HEAD_DIM, generator=rng))

    # This step's keys, with a padding row (slot -1) that must be skipped.
    pad = torch.full((1, num_kv_heads, HEAD_DIM), 1e4)
    store_kv(
        torch.cat([*new_k, pad]),
        torch.cat([*new_v, pad]),
        k_cache,
        v_cache,
        torch.tensor([*new_slots, -1], dtype=torch.long),
    )
    assert not (k_cache == 1e4).any()

    q = torch.cat(queries)
    cu = torch.tensor([0, *torch.tensor([n for _, n in cases]).cumsum(0).tolist()])
    seq_lens = torch.tensor([c + n for c, n in cases])
    out = paged_attention(q, k_cache, v_cache, torch.tensor(tables), cu, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(len(cases)):
        ref = oracle_attention(queries[b], dense_k[b], dense_v[b], scale)
        torch.testing.assert_close(out[int(cu[b]) : int(cu[b + 1])].double(), ref, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_only_mapped_slots(rng: torch.Generator) -> None:
    k_cache = torch.zeros(4, 4, 2, HEAD_DIM)
    v_cache = torch.zeros(4, 4, 2, HEAD_DIM)
    key = torch.randn(3, 2, HEAD_DIM, generator=rng)
    value = torch.randn(3, 2, HEAD_DIM, generator=rng)
    store_kv(key, value, k_cache, v_cache, torch.tensor([13, -1, 2]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[0, 2], value[2])
    assert torch.count_nonzero(k_cache.abs().sum(-1)) == 2 * 2  # two tokens x two heads


def test_bf16_cache_and_queries(rng: torch.Generator) -> None:
    block_size, length = 8, 20
    k_cache = torch.zeros(6, block_size, 1, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    table = [4, 0, 2]
    keys = torch.randn(length, 1, HEAD_DIM, generator=rng)
    values = torch.randn(length, 1, HEAD_DIM, generator=rng)
    store_kv(keys, values, k_cache, v_cache, torch.tensor(flat_slots(table, range(length), block_size)))
    q = torch.randn(2, 2, HEAD_DIM, generator=rng).bfloat16()
    out = paged_attention(
        q, k_cache, v_cache, torch.tensor([table]), torch.tensor([0, 2]), torch.tensor([length]), 0.25
    )
    assert out.dtype == torch.bfloat16
    ref = oracle_attention(q, keys.bfloat16(), values.bfloat16(), 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_long_prefill_spans_several_query_tiles(rng: torch.Generator) -> None:
    # More query rows than the reference's score tile, so tiling must not change the result.
    block_size, length = 16, 600
    num_blocks = math.ceil(length / block_size)
    table = torch.randperm(num_blocks, generator=rng).tolist()
    k_cache = torch.zeros(num_blocks, block_size, 1, 8)
    v_cache = torch.zeros_like(k_cache)
    keys = torch.randn(length, 1, 8, generator=rng)
    values = torch.randn(length, 1, 8, generator=rng)
    store_kv(keys, values, k_cache, v_cache, torch.tensor(flat_slots(table, range(length), block_size)))
    q = torch.randn(length, 2, 8, generator=rng)
    out = paged_attention(
        q, k_cache, v_cache, torch.tensor([table]), torch.tensor([0, length]), torch.tensor([length]), 8**-0.5
    )
    # Dense causal attention via matrices (the per-query oracle would be slow at this length).
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double().expand(-1, 2, -1)) * 8**-0.5
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double().expand(-1, 2, -1))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [1, 3])
def test_decodes_ignore_stale_nan_past_their_end(num_decodes: int, rng: torch.Generator) -> None:
    """Cache rows past a decode's context (its last block's tail, here NaN and inf) must not
    reach its output, whether it decodes alone or batched with longer sequences."""
    block_size, num_kv_heads, num_q_heads = 4, 2, 4
    k_cache = torch.full((8, block_size, num_kv_heads, HEAD_DIM), float("nan"))
    v_cache = torch.full((8, block_size, num_kv_heads, HEAD_DIM), float("inf"))
    lengths = [5, 9, 2][:num_decodes]
    tables, dense = [], []
    next_block = 0
    for length in lengths:
        table = list(range(next_block, next_block + math.ceil(length / block_size)))
        next_block += len(table)
        keys = torch.randn(length, num_kv_heads, HEAD_DIM, generator=rng)
        values = torch.randn(length, num_kv_heads, HEAD_DIM, generator=rng)
        store_kv(keys, values, k_cache, v_cache, torch.tensor(flat_slots(table, range(length), block_size)))
        tables.append(table + [0] * (3 - len(table)))
        dense.append((keys, values))
    q = torch.randn(num_decodes, num_q_heads, HEAD_DIM, generator=rng)
    cu = torch.arange(num_decodes + 1)
    out = paged_attention(q, k_cache, v_cache, torch.tensor(tables), cu, torch.tensor(lengths), 0.125)
    for b, (keys, values) in enumerate(dense):
        ref = oracle_attention(q[b : b + 1], keys, values, 0.125)
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=1e-5, rtol=1e-5)
