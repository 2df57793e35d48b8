"""Logits parity with transformers, through the engine's batch layout and paged caches.

Tolerance: tests/tolerances.py (``|diff| <= 1e-4 * (1 + max|logit| of the row)``, derived there
from float64 runs). fp32 logits here have std ~3 and rows' largest |logit| 8..61; observed
differences use <= ~10% of the tolerance (the chunked GDN scan and paged attention reorder fp32
sums, nothing more). ``test_tolerance_catches_small_bugs`` shows real bugs exceed it many times.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.models.conftest import Env, EnvFactory
from tests.models.driver import GDN_CHUNK, Work
from tests.tolerances import assert_logits_close, tolerance_used

PROMPT_LENS = (1, 63, 64, 65, 150)
NUM_DECODES = 5


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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
        assert_logits_close(out, env.reference(p), f"{env.name} prefill len {len(p)}")
        for out, p in zip(outs, prompts)
    )
    print(f"[parity] {env.name} single prefill: {worst:.1%} of the tolerance")


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
            worst = max(worst, assert_logits_close(out, ref[pos : pos + piece], what))
            pos += piece
        runner.release(seq)  # the next prompt reuses this (dirty) live slot from zero state
    print(f"[parity] {env.name} chunked prefill + decode: {worst:.1%} of the tolerance")


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
                worst = max(worst, assert_logits_close(out, s["ref"][s["pos"] : s["pos"] + piece], what))
                s["pos"] += piece
                if not s["pieces"]:
                    runner.release(s["seq"])
        step += 1
    assert mixed_steps >= 3, "the schedule should mix decodes and prefills in one forward"
    print(f"[parity] {env.name} mixed batch ({step} steps): {worst:.1%} of the tolerance")


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
        assert_logits_close(out, ref[pos : pos + piece], f"block_size {block_size} [{pos}, {pos + piece})")
        pos += piece


# A real bug must exceed the tolerance this many times over (measured: >= ~7x for the subtlest).
BUG_FACTOR = 4.0


def test_tolerance_catches_small_bugs(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tolerance is not vacuous: small, realistic engine bugs fail it by a wide margin.

    Each bug is replayed on a 150-token prompt (prefill 128 + 22) followed by decode steps, and
    the decode logits are compared with transformers exactly as the parity tests do.
    """
    n = 150
    tokens = random_tokens(n + NUM_DECODES, seed=77)
    ref = env.reference(tokens)[n:]

    def decode_logits(bug: str | None) -> torch.Tensor:
        prompt = tokens[:10] + tokens[11:] if bug == "prompt token dropped" else tokens
        runner = env.runner()
        seq = runner.add(prompt)
        for piece in chunk_plan(len(prompt) - NUM_DECODES, 128):
            runner.step([Work(seq, piece)])
        with monkeypatch.context() as m:
            if bug == "caches rounded to bf16":
                for t in [*runner.caches.k_cache, *runner.caches.v_cache, *runner.caches.state_tensors()]:
                    t.copy_(t.to(torch.bfloat16).to(t.dtype))
            elif bug == "GDN state replays a token":
                runner.step([Work(seq, 1)])
                seq.num_computed -= 1  # recompute it: KV rewritten identically, the state updated twice
            elif bug == "decode at position + 1":
                forward = runner.model.forward

                def shifted(batch: Any, caches: Any) -> torch.Tensor:
                    return forward(dataclasses.replace(batch, positions=batch.positions + 1), caches)

                m.setattr(runner.model, "forward", shifted)
            return torch.cat([runner.step([Work(seq, 1)])[0] for _ in range(NUM_DECODES)])

    assert_logits_close(decode_logits(None), ref, f"{env.name} clean")
    bugs = ["caches rounded to bf16", "decode at position + 1", "prompt token dropped"]
    if env.loaded.model.num_gdn_layers:
        bugs.append("GDN state replays a token")
    for bug in bugs:
        out = decode_logits(bug)
        with pytest.raises(AssertionError, match="exceeds"):
            assert_logits_close(out, ref, f"{env.name} {bug}")
        used = tolerance_used(out, ref)
        assert used > BUG_FACTOR, f"{env.name} {bug}: only {used:.2f}x the tolerance"
        print(f"[tolerance] {env.name} {bug}: {used:.1f}x the tolerance")
