"""Logits parity with transformers, through the engine's batch layout and paged caches.

Tolerance: fp32 logits (std ~3 with the test init) must agree within ``ATOL = 1e-4`` and the
greedy argmax must be identical at every compared position. Observed max differences are
1e-5..5e-5 (the chunked GDN scan and paged attention reorder fp32 sums, nothing more).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import Env, EnvFactory
from tests.models.driver import GDN_CHUNK, Work

ATOL = 1e-4
PROMPT_LENS = (1, 63, 64, 65, 150)
NUM_DECODES = 5


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, what
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"{what}: max |logit diff| {diff:.3g} > {ATOL}"
    mismatch = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatch, f"{what}: greedy token differs at rows {mismatch}"
    return diff


def chunk_plan(length: int, chunk: int) -> list[int]:
    """Split a prompt into prefill pieces; every piece but the last is a multiple of 64."""
    assert chunk % GDN_CHUNK == 0
    return [min(chunk, length - s) for s in range(0, length, chunk)]


def test_single_prefill_all_positions(env: Env) -> None:
    """All prompts as prefill segments of ONE forward; logits of every position."""
    runner = env.runner()
    prompts = [random_tokens(n, seed=n) for n in PROMPT_LENS]
    seqs = [runner.add(p) for p in prompts]
    outs = runner.step([Work(s, len(p)) for s, p in zip(seqs, prompts)])
    worst = max(
        assert_matches(out, env.reference(p), f"{env.name} prefill len {len(p)}")
        for out, p in zip(outs, prompts)
    )
    print(f"[parity] {env.name} single prefill: max |diff| {worst:.2e}")


def test_chunked_prefill_then_decode(env: Env) -> None:
    """64-aligned prefill chunks, then decode steps, one sequence per step, caches shared."""
    runner = env.runner()
    worst = 0.0
    for n in PROMPT_LENS:
        tokens = random_tokens(n + NUM_DECODES, seed=1000 + n)
        ref = env.reference(tokens)
        seq = runner.add(tokens)
        pos = 0
        for piece in [*chunk_plan(n, 64), *[1] * NUM_DECODES]:
            (out,) = runner.step([Work(seq, piece)])
            what = f"{env.name} len {n} tokens [{pos}, {pos + piece})"
            worst = max(worst, assert_matches(out, ref[pos : pos + piece], what))
            pos += piece
        runner.release(seq)  # the next prompt reuses this (dirty) live slot from zero state
    print(f"[parity] {env.name} chunked prefill + decode: max |diff| {worst:.2e}")


@pytest.mark.parametrize("kv_fill", [0.0, float("nan")], ids=["kv-zeros", "kv-nan"])
def test_mixed_continuous_batch(env: Env, kv_fill: float) -> None:
    """Decodes of some sequences and prefill chunks of others in the same forwards.

    Sequences join at staggered steps with different chunk sizes; a late one reuses a finished
    sequence's live slot. State slots start as NaN (a fresh sequence must never read its slot);
    with ``kv-nan`` so do the KV caches: block tails and padding entries past ``seq_len`` must be
    masked out, not multiplied by zero (stale inf/NaN in a reused block must not leak).
    """
    runner = env.runner(state_fill=float("nan"), kv_fill=kv_fill, seed=7)
    # (prompt length, prefill chunk, step at which it joins)
    plan = [(150, 64, 0), (65, 128, 0), (1, 64, 1), (64, 64, 2), (130, 128, 3), (63, 64, 9)]
    state = []
    for i, (n, chunk, join) in enumerate(plan):
        tokens = random_tokens(n + NUM_DECODES, seed=2000 + i)
        pieces = [*chunk_plan(n, chunk), *[1] * NUM_DECODES]
        state.append({"tokens": tokens, "pieces": pieces, "join": join, "seq": None, "pos": 0, "ref": None})
    worst, step, mixed_steps = 0.0, 0, 0
    while any(s["pieces"] for s in state):
        active = [s for s in state if s["pieces"] and s["join"] <= step]
        for s in active:
            if s["seq"] is None:
                s["seq"] = runner.add(s["tokens"])
                s["ref"] = env.reference(s["tokens"])
        if active:
            pieces = [s["pieces"].pop(0) for s in active]
            outs = runner.step([Work(s["seq"], p) for s, p in zip(active, pieces)])
            kinds = {p == 1 and s["pos"] > 0 for s, p in zip(active, pieces)}
            mixed_steps += kinds == {True, False}
            for s, piece, out in zip(active, pieces, outs):
                what = f"{env.name} step {step} tokens [{s['pos']}, {s['pos'] + piece})"
                worst = max(worst, assert_matches(out, s["ref"][s["pos"] : s["pos"] + piece], what))
                s["pos"] += piece
                if not s["pieces"]:
                    runner.release(s["seq"])
        step += 1
    assert mixed_steps >= 3, "the schedule should mix decodes and prefills in one forward"
    print(f"[parity] {env.name} mixed batch ({step} steps): max |diff| {worst:.2e}")


def test_block_size_equal_to_gdn_chunk(envs: EnvFactory) -> None:
    """Block size 64 (one block per GDN chunk) on one hybrid config; the others use 16."""
    env = envs.get("qwen3_5-gqa2-ratio2")
    block_size = 64
    runner = env.runner(block_size=block_size, num_blocks=12)
    tokens = random_tokens(150 + 3, seed=3)
    ref = env.reference(tokens)
    seq = runner.add(tokens)
    pos = 0
    for piece in [128, 22, 1, 1, 1]:
        (out,) = runner.step([Work(seq, piece)])
        assert_matches(out, ref[pos : pos + piece], f"block_size {block_size} [{pos}, {pos + piece})")
        pos += piece
