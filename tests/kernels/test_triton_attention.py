"""Triton ``store_kv`` / ``paged_attention`` vs the PyTorch reference ops (checked in test_attention.py).

Runs under ``TRITON_INTERPRET=1`` on the CPU or on a CUDA device; skipped otherwise.
Tolerances: fp32 ``atol=rtol=1e-5``; bf16 ``atol=rtol=2e-2`` (bf16 output, and on a GPU bf16
probabilities in the P·V product); ``store_kv`` must match exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from deltaserve.kernels.attention import paged_attention as ref_attention
from deltaserve.kernels.attention import store_kv as ref_store
from deltaserve.kernels.op_args import AttentionArgs
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}
NUM_BLOCKS = 64

# (cached prefix, new query tokens). Decodes first, as the runner orders them: at / across block
# boundaries and a fresh one-token prompt; then an empty segment and prefills with fresh, mid-block
# and block-aligned cached prefixes.
CASES = [(16, 1), (15, 1), (17, 1), (0, 1), (9, 0), (0, 7), (5, 3), (16, 16), (32, 9), (40, 25)]


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


def build_batch(
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Random caches + one step's new K/V (with a padding row, slot -1) and queries."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in CASES)
    tables, slots, new_slots, queries = [], [], [], []
    for cached, n in CASES:
        length = cached + n
        table = [free.pop() for _ in range(math.ceil(length / block_size))]
        tables.append(table + [0] * (max_blocks - len(table)))
        flat = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        slots += flat[:cached]
        new_slots += flat[cached:]
        queries.append(torch.randn(n, num_q_heads, head_dim, generator=gen))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    batch = {
        "k_cache": rand(*cache_shape),
        "v_cache": rand(*cache_shape),
        "old_k": rand(len(slots), num_kv_heads, head_dim),
        "old_v": rand(len(slots), num_kv_heads, head_dim),
        "old_slots": torch.tensor(slots, dtype=torch.long, device=DEVICE),
        "new_k": rand(len(new_slots) + 1, num_kv_heads, head_dim),
        "new_v": rand(len(new_slots) + 1, num_kv_heads, head_dim),
        "new_slots": torch.tensor([*new_slots, -1], dtype=torch.long, device=DEVICE),
        "q": torch.cat(queries).to(DEVICE, dtype),
        "block_tables": torch.tensor(tables, dtype=torch.long, device=DEVICE),
        "cu": torch.tensor([0, *torch.tensor([n for _, n in CASES]).cumsum(0).tolist()], device=DEVICE),
        "seq_lens": torch.tensor([c + n for c, n in CASES], device=DEVICE),
    }
    return batch


def store_both(tops: Ops, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the prefix and this step's K/V with both ops; the caches must come out identical."""
    k_ref, v_ref = b["k_cache"].clone(), b["v_cache"].clone()
    k_tri, v_tri = b["k_cache"].clone(), b["v_cache"].clone()
    for key, value, slots in [
        (b["old_k"], b["old_v"], b["old_slots"]),
        (b["new_k"], b["new_v"], b["new_slots"]),
    ]:
        ref_store(key, value, k_ref, v_ref, slots)
        tops.store_kv(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    return k_tri, v_tri


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_paged_attention_matches_reference(
    tops: Ops, block_size: int, num_q_heads: int, num_kv_heads: int, rng: torch.Generator
) -> None:
    from deltaserve.kernels.triton.attention import paged_attention_impl

    b = build_batch(block_size, num_q_heads, num_kv_heads, 16, torch.float32, rng)
    k_cache, v_cache = store_both(tops, b)
    args = (b["q"], k_cache, v_cache, b["block_tables"], b["cu"], b["seq_lens"], 0.25)
    ref = ref_attention(*args)
    out = tops.paged_attention(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **FP32)
    # Small tiles: several query tiles per prefill, several key steps per program, and decode
    # contexts split across 3 programs merged by the combine kernel.
    tiled = paged_attention_impl(AttentionArgs(*args), num_splits=3, block_q=4, block_n=16)
    torch.testing.assert_close(tiled, ref, **FP32)


def test_paged_attention_bf16_odd_head_dim(tops: Ops, rng: torch.Generator) -> None:
    from deltaserve.kernels.triton.attention import paged_attention_impl

    b = build_batch(8, 8, 2, 24, torch.bfloat16, rng)  # GQA 4, head dim 24 (masked tail)
    k_cache, v_cache = store_both(tops, b)
    args = (b["q"], k_cache, v_cache, b["block_tables"], b["cu"], b["seq_lens"], 24**-0.5)
    ref = ref_attention(*args)
    out = tops.paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16)
    split = paged_attention_impl(AttentionArgs(*args), num_splits=2, block_n=16)
    torch.testing.assert_close(split.float(), ref.float(), **BF16)


def test_long_prefill_after_cached_prefix(tops: Ops, rng: torch.Generator) -> None:
    block_size, cached, new = 16, 37, 150
    length = cached + new
    num_blocks = math.ceil(length / block_size)
    table = torch.randperm(num_blocks, generator=rng).tolist()
    k_cache = torch.randn(num_blocks, block_size, 1, 16, generator=rng).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, 1, 16, generator=rng).to(DEVICE)
    q = torch.randn(new, 2, 16, generator=rng).to(DEVICE)
    args = (
        q, k_cache, v_cache, torch.tensor([table], device=DEVICE), torch.tensor([0, new], device=DEVICE),
        torch.tensor([length], device=DEVICE), 0.25,
    )  # fmt: skip
    torch.testing.assert_close(tops.paged_attention(*args), ref_attention(*args), **FP32)


def test_store_kv_strided_dtype_cast_and_skip(tops: Ops, rng: torch.Generator) -> None:
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # key/value as strided views of one fused projection (row stride 3 * 2 * 16), as the model has them.
    qkv = torch.randn(3, 3 * 2 * 16, generator=rng).to(DEVICE)
    key, value = qkv[:, 32:64].reshape(3, 2, 16), qkv[:, 64:].reshape(3, 2, 16)
    assert not key.is_contiguous()
    slots = torch.tensor([13, -1, 2], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref_store(key, value, k_ref, v_ref, slots)
    tops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.count_nonzero(k_cache.float().abs().sum(-1)) == 2 * 2


def test_query_longer_than_context_rejected(tops: Ops) -> None:
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError):
        tops.paged_attention(
            torch.zeros(3, 1, 16, device=DEVICE), cache, cache, torch.zeros(1, 2, dtype=torch.long, device=DEVICE),
            torch.tensor([0, 3]), torch.tensor([2]), 1.0,
        )  # fmt: skip
