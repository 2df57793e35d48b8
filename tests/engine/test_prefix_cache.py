"""A prefix hit never changes an output: cache on == cache off == transformers."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deltaserve.engine import EngineCore
from tests.engine.conftest import greedy, hf_greedy, run_to_completion
from tests.tolerances import assert_logits_close


def tokens_of(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def serve(core: EngineCore, prompts: list[Any], max_tokens: int = 6, waves: bool = True) -> list[list[int]]:
    """Submit prompts (one wave after another if ``waves``, so later ones can hit)."""
    results: list[list[int]] = []
    if waves:
        for p in prompts:
            req = core.make_request(p, greedy(max_tokens))
            core.add_request(req)
            outs = run_to_completion(core)
            results.append(tokens_of(outs[req.request_id]))
    else:
        reqs = [core.make_request(p, greedy(max_tokens)) for p in prompts]
        for r in reqs:
            core.add_request(r)
        outs = run_to_completion(core)
        results = [tokens_of(outs[r.request_id]) for r in reqs]
    return results


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_multi_turn_chat_hits_tail_and_matches_cache_off(core_factory: Any, hf_tiny: Any) -> None:
    rng = random.Random(1)
    words = [
        "the",
        "cache",
        "keeps",
        "every",
        "state",
        "a",
        "model",
        "needs",
        "to",
        "resume",
        "from",
        "any",
        "turn",
        "of",
        "a",
        "chat",
    ]
    cached = core_factory()
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a terse assistant. " * 6}]
    prev_prompt_len = 0
    for turn in range(4):
        messages.append(
            {"role": "user", "content": " ".join(rng.choice(words) for _ in range(40 + 13 * turn))}
        )
        req = cached.make_request(messages, greedy(8))
        cached.add_request(req)
        out = run_to_completion(cached)[req.request_id]
        warm = tokens_of(out)
        (cold,) = serve(plain, [messages], 8)
        assert warm == cold, f"turn {turn}: cache hit changed the output"
        if turn == 1:  # one warm turn against transformers too
            assert warm == hf_greedy(hf_tiny, req.prompt_token_ids, 8)
        if turn > 0:
            tail = ((prev_prompt_len - 1) // cached.cache.unit) * cached.cache.unit
            assert out[-1].num_cached_tokens >= tail > 0, (
                f"turn {turn}: hit {out[-1].num_cached_tokens} < tail {tail}"
            )
        prev_prompt_len = req.num_prompt_tokens
        reply = cached.tokenizer.decode(warm, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    s = cached.stats()
    assert s["prefix_cache.hit_tokens"] > 0 and s["checkpoints.stored"] > 0


@pytest.mark.parametrize("prefix_len", [130, 200])  # neither is a multiple of 16
def test_shared_system_prompt_not_block_aligned(core_factory: Any, prefix_len: int) -> None:
    rng = random.Random(prefix_len)
    system = rand_tokens(rng, prefix_len)
    prompts = [system + rand_tokens(rng, 30 + 7 * i) for i in range(5)]
    cached = core_factory()
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    assert serve(cached, prompts) == serve(plain, prompts)
    # first request: no hit; second branches at floor(prefix/64)*64 and captures it; later ones hit it
    unit = cached.cache.unit
    assert cached.stats()["prefix_cache.hit_tokens"] >= 3 * (prefix_len // unit) * unit


def test_identical_prompts_twice_and_concurrently(core_factory: Any) -> None:
    rng = random.Random(7)
    p = rand_tokens(rng, 333)
    cached = core_factory()
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    expected = serve(plain, [p])[0]
    assert serve(cached, [p, p]) == [expected, expected]
    assert serve(cached, [p, p, p], waves=False) == [expected] * 3
    assert cached.stats()["prefix_cache.hit_tokens"] >= 320


def test_branching_trajectories(core_factory: Any) -> None:
    rng = random.Random(3)
    trunk = rand_tokens(rng, 260)
    prompts = [trunk + rand_tokens(rng, 40), trunk + rand_tokens(rng, 90), trunk[:200] + rand_tokens(rng, 70)]
    prompts.append(prompts[1] + rand_tokens(rng, 50))
    cached = core_factory(**{"cache.checkpoint_interval": 128})
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    assert serve(cached, prompts) == serve(plain, prompts)
    assert cached.stats()["prefix_cache.hit_tokens"] > 0


def test_decode_output_checkpoint_is_reused(core_factory: Any) -> None:
    """An agent loop resends its own output: the output checkpoint gives the hit."""
    rng = random.Random(5)
    p = rand_tokens(rng, 100)
    cached = core_factory(**{"cache.checkpoint_interval": 0})
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    first = serve(cached, [p], max_tokens=60)[0]  # 159 computed: the last block crossed is at 144
    follow = p + first + rand_tokens(rng, 20)
    req = cached.make_request(follow, greedy(5))
    cached.add_request(req)
    out = run_to_completion(cached)[req.request_id]
    assert out[-1].num_cached_tokens == 144
    assert tokens_of(out) == serve(plain, [follow], 5)[0]


@pytest.mark.parametrize(
    "dotted",
    [
        {"cache.checkpoint_pool_bytes": 1},  # zero checkpoint slots
        {"cache.checkpoint_staging_bytes": 0},  # zero staging budget
        {"cache.num_kv_blocks": 40},  # barely more than one request (≈ 38 blocks)
    ],
    ids=["no-ckpt-slots", "zero-staging", "tiny-kv"],
)
def test_starved_pools_change_nothing(core_factory: Any, dotted: dict[str, Any]) -> None:
    rng = random.Random(11)
    shared = rand_tokens(rng, 300)
    prompts = [shared + rand_tokens(rng, 10 + 5 * i) for i in range(6)]
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    expected = serve(plain, prompts, 8, waves=False)
    starved = core_factory(**dotted)
    assert serve(starved, prompts, 8, waves=False) == expected
    assert serve(starved, prompts[:2], 8) == expected[:2]


def test_one_or_two_checkpoint_slots(core_factory: Any, tiny_loaded: Any) -> None:
    slot = core_factory().cache.config.checkpoint_bytes
    rng = random.Random(12)
    prompts = [rand_tokens(rng, 150 + 40 * i) for i in range(4)]
    prompts += [p + rand_tokens(rng, 20) for p in prompts]
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    expected = serve(plain, prompts, 6, waves=False)
    for n in (1, 2):
        core = core_factory(**{"cache.checkpoint_pool_bytes": n * slot})
        assert core.cache.slots.num_checkpoint == n
        assert serve(core, prompts, 6, waves=False) == expected
        s = core.stats()
        assert s["checkpoints.skipped_pool"] + s["checkpoints.evicted"] > 0


def test_cache_salt_keeps_tenants_apart(core_factory: Any) -> None:
    rng = random.Random(21)
    p = rand_tokens(rng, 300)
    core = core_factory()

    def hit(salt: str | None) -> int:
        req = core.make_request(p, greedy(2), cache_salt=salt)
        core.add_request(req)
        return run_to_completion(core)[req.request_id][-1].num_cached_tokens

    assert hit("tenant-a") == 0
    assert hit("tenant-a") == 288
    assert hit("tenant-b") == 0
    assert hit(None) == 0


def sampled_logits(core: EngineCore, prompt: list[int], monkeypatch: Any) -> tuple[torch.Tensor, int]:
    """The logits of every sampled row of one 5-token greedy request, and its cached prompt tokens."""
    rows: list[Any] = []
    forward = core.runner.model.forward

    def spy(batch: Any, caches: Any) -> Any:
        out = forward(batch, caches)
        rows.append(out.clone())
        return out

    monkeypatch.setattr(core.runner.model, "forward", spy)
    req = core.make_request(prompt, greedy(5))
    core.add_request(req)
    outs = run_to_completion(core)[req.request_id]
    monkeypatch.setattr(core.runner.model, "forward", forward)
    return torch.cat(rows), outs[-1].num_cached_tokens


def test_warm_logits_equal_cold_logits(core_factory: Any, monkeypatch: Any) -> None:
    """fp32 logits of every sampled position, warm (restored checkpoint + cached KV) vs cold."""
    rng = random.Random(22)
    first = rand_tokens(rng, 260)
    second = first + rand_tokens(rng, 90)
    warm = core_factory()
    cold = core_factory(**{"cache.enable_prefix_caching": False})
    sampled_logits(warm, first, monkeypatch)
    warm_logits, hit = sampled_logits(warm, second, monkeypatch)
    cold_logits, _ = sampled_logits(cold, second, monkeypatch)
    assert hit == 256
    assert warm_logits.shape == cold_logits.shape == (5, warm.vocab_size)
    assert_logits_close(warm_logits, cold_logits, "warm (restored checkpoint + cached KV) vs cold")
    assert torch.equal(warm_logits.argmax(-1), cold_logits.argmax(-1))


#: no step-time bound on prefill chunks: it follows measured step times, so on a loaded machine
#: the batches (and with them which blocks are evicted before they are asked for again) would
#: change from run to run; the pressure tests assert hits and evictions, so they run untimed
UNTIMED = {"scheduler.decode_step_factor": 0, "scheduler.max_decode_step_ms": 0}


def converse(cached: EngineCore, plain: EngineCore, rng: random.Random, n: int, turns: int = 4) -> None:
    """``n`` conversations side by side for ``turns`` turns; odd ones re-send the model's reply,
    even ones a rewritten one. Cache-on outputs must equal cache-off outputs at every turn."""
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(n)]
    for _turn in range(turns):
        warm = serve(cached, convs, 6, waves=False)
        assert warm == serve(plain, convs, 6, waves=False)
        convs = [
            c + (w if i % 2 else rand_tokens(rng, 4)) + rand_tokens(rng, 24)
            for i, (c, w) in enumerate(zip(convs, warm, strict=True))
        ]


@pytest.mark.parametrize("policy", ["default", "v1"])
def test_more_conversations_than_the_pools_hold_change_nothing(core_factory: Any, policy: str) -> None:
    """Memory pressure: 6 conversations served side by side over 2 checkpoint slots
    and a KV pool that holds about half of them; odd conversations re-send the model's reply,
    even ones a rewritten one. Cache-on outputs equal cache-off outputs at every turn (the
    integrity check runs after every step), and the cache still hits."""
    rng = random.Random(31)
    slot = core_factory().cache.config.checkpoint_bytes
    cached = core_factory(
        **{
            "cache.checkpoint_policy": policy,
            "cache.checkpoint_pool_bytes": 2 * slot,
            "cache.num_kv_blocks": 110,
            "cache.checkpoint_interval": 0,
            **UNTIMED,
        }
    )
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    converse(cached, plain, rng, 6)
    s = cached.stats()
    assert s["prefix_cache.hit_tokens"] > 0
    assert s["checkpoints.evicted"] + s["checkpoints.skipped_pool"] + s["checkpoints.skipped_value"] > 0
    assert s["kv.evicted_blocks"] > 0


@pytest.mark.parametrize(("policy", "overlap"), [("default", False), ("v1", False), ("default", True)])
def test_one_budget_under_pressure_changes_nothing(core_factory: Any, policy: str, overlap: bool) -> None:
    """One device budget (KV and checkpoints in one arena) too small for the conversations:
    pages change use both ways, KV blocks (cached, pinned, private) move out of pages captures
    take, and cache-on outputs still equal cache-off outputs at every turn (integrity checked
    after every step), with async scheduling too."""
    rng = random.Random(32)
    page = 14 * 32 * 1024  # the tiny model's page: 14 KV blocks of 16 tokens, one checkpoint
    cached = core_factory(
        **{
            "cache.checkpoint_policy": policy,
            "cache.num_kv_blocks": None,
            "cache.memory_bytes": (8 + 16) * page,  # 8 live slots, 16 shared pages
            "cache.checkpoint_interval": 64,
            "engine.async_scheduling": overlap,
            **UNTIMED,
        }
    )
    assert cached.capacity.num_pages == 16 and cached.cache.budget is not None
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    converse(cached, plain, rng, 8)
    s = cached.stats()
    assert s["prefix_cache.hit_tokens"] > 0
    assert s["cache.pages_to_kv"] > 0 and s["cache.pages_to_checkpoints"] > 0
    assert s["kv.moved_blocks"] > 0 and s["checkpoints.evicted_for_kv"] > 0
