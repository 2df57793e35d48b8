"""Speculative decoding, greedy: outputs identical to speculation off, for every drafter, with
the prefix cache on and off, under preemption and aborts; pools whole after every step."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.spec.replay import ReplayDrafter
from tests.engine.conftest import greedy, run_to_completion

MAX_TOKENS = 37  # not a multiple of a window (k + 1 = 4): the last window is cut by max_tokens


def _prompts(seed: int, n: int = 4, repeat: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(24)]
    out = []
    for _ in range(n):
        p = shared + [rng.randrange(5, 1000) for _ in range(rng.randrange(5, 40))]
        out.append(p + p[-20:] + p[-20:] if repeat else p)  # repeats: prompt lookup finds n-grams
    return out


def _serve(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, params, request_id=f"r{i}"))
    outs = run_to_completion(core)  # integrity after every step; pools whole at the end
    return {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}


def _replay(core: EngineCore, prompts: list[list[int]], expected: dict[str, list[int]]) -> None:
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    assert isinstance(drafter, ReplayDrafter)
    for i, p in enumerate(prompts):
        drafter.record(p, expected[f"r{i}"])


def serve_two_turns(
    core: EngineCore, prompts: list[list[int]], follow: list[list[int]], replay: dict[str, list[int]] | None
) -> tuple[dict[str, list[int]], dict[str, list[Any]], int]:
    """Turn 1 (``r{i}``), then turn 2 (``t2r{i}``: turn 1's prompt, its output and ``follow[i]``),
    greedy; with ``replay`` (an earlier run's tokens by these ids) the replay drafter proposes
    them. Every request's tokens, turn 2's outputs, and the prefix-hit tokens turn 2 added."""
    if replay is not None:
        _replay(core, prompts, replay)
    first = _serve(core, prompts, greedy(MAX_TOKENS))
    second = [p + first[f"r{i}"] + follow[i] for i, p in enumerate(prompts)]
    if replay is not None:
        _replay(core, second, {f"r{i}": replay[f"t2r{i}"] for i in range(len(prompts))})
    before = core.stats()["prefix_cache.hit_tokens"]
    for i, p in enumerate(second):
        core.add_request(core.make_request(p, greedy(MAX_TOKENS), request_id=f"t2r{i}"))
    outs = run_to_completion(core)
    both = {**first, **{rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}}
    return both, outs, core.stats()["prefix_cache.hit_tokens"] - before


def _spec(core: EngineCore) -> dict[str, float]:
    return {k: v for k, v in core.stats().items() if k.startswith("spec_decode.")}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("corrupt", [0, 2])
def test_replay_outputs_equal_speculation_off(core_factory: Any, caching: bool, corrupt: int) -> None:
    prompts = _prompts(0)
    off = _serve(core_factory(**{"cache.enable_prefix_caching": caching}), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{
        "cache.enable_prefix_caching": caching,
        "speculative.method": "replay",
        "speculative.replay_corrupt_every": corrupt,
    })  # fmt: skip
    _replay(core, prompts, off)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    s = _spec(core)
    assert s["spec_decode.num_drafts"] > 0
    if corrupt:
        # every other draft wrong: the rejected positions' states were rolled back
        assert 0.2 < s["spec_decode.acceptance_rate"] < 0.5
        assert s["spec_decode.num_accepted_tokens_per_pos.1"] == 0
    else:
        assert s["spec_decode.acceptance_rate"] == 1.0
        assert s["spec_decode.mean_tokens_per_verify"] > 3.0
    assert (
        s["spec_decode.num_emitted_tokens"]
        == s["spec_decode.num_drafts"] + s["spec_decode.num_accepted_tokens"]
    )


@pytest.mark.parametrize("caching", [True, False])
def test_ngram_outputs_equal_speculation_off(core_factory: Any, caching: bool) -> None:
    prompts = _prompts(1, repeat=True)
    off = _serve(core_factory(**{"cache.enable_prefix_caching": caching}), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{
        "cache.enable_prefix_caching": caching,
        "speculative.method": "ngram",
        "speculative.prompt_lookup_min": 1,
    })  # fmt: skip
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    assert _spec(core)["spec_decode.num_draft_tokens"] > 0


def test_without_roll_back_outputs_differ(core_factory: Any, monkeypatch: Any) -> None:
    """The identity above rests on the roll-back: skipping it changes the outputs."""
    import deltaserve.engine.runner.model_runner as mr

    prompts = _prompts(0)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    _replay(core, prompts, off)
    monkeypatch.setattr(mr, "restore_accepted", lambda *a: None)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) != off


def test_preemption_with_a_small_pool(core_factory: Any) -> None:
    prompts = _prompts(2, n=6)
    small = {"cache.num_kv_blocks": 14, "cache.enable_prefix_caching": True}
    off = _serve(core_factory(**small), prompts, greedy(MAX_TOKENS))
    core = core_factory(**small, **{"speculative.method": "replay", "speculative.replay_corrupt_every": 3})
    _replay(core, prompts, off)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    assert core.stats()["scheduler.preemptions"] > 0
    assert _spec(core)["spec_decode.num_accepted_tokens"] > 0


def test_abort_after_a_verify_leaves_the_others_identical(core_factory: Any) -> None:
    prompts = _prompts(3)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    _replay(core, prompts, off)
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, greedy(MAX_TOKENS), request_id=f"r{i}"))
    got: dict[str, list[int]] = {}
    aborted = False
    while core.has_work():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
        core.check_integrity()
        if not aborted and _spec(core)["spec_decode.num_drafts"] >= 3:
            final = core.abort_request("r1")  # between steps, right after it verified drafts
            assert final is not None and final.finish_reason == "abort"
            aborted = True
            core.check_integrity()
    assert aborted
    assert core.cache.slots.num_free_live == core.cache.slots.num_live
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == off[rid]
    assert got["r1"] == off["r1"][: len(got["r1"])]


def test_stop_token_inside_an_accepted_run(core_factory: Any) -> None:
    prompts = _prompts(4, n=2)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    # a token from the middle of r0's output that did not occur before it: the run stops there
    out0 = off["r0"]
    at = next(i for i in range(5, len(out0)) if out0[i] not in out0[:i])
    stop = out0[at]
    params = greedy(MAX_TOKENS, stop_token_ids=[stop])
    want = _serve(core_factory(), prompts, params)
    assert want["r0"] == out0[: at + 1]
    core = core_factory(**{"speculative.method": "replay"})
    _replay(core, prompts, off)
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, params, request_id=f"r{i}"))
    outs = run_to_completion(core)
    got = {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}
    assert got == want
    assert outs["r0"][-1].finish_reason == "stop"
    assert _spec(core)["spec_decode.acceptance_rate"] == 1.0


def test_multi_turn_prefix_hits_unchanged(core_factory: Any) -> None:
    """Turn 2 of each conversation resumes from the output checkpoint turn 1 captured at a
    boundary a verify window ended on: the same hits as speculation off, the same outputs."""
    prompts = _prompts(5, n=3)
    rng = random.Random(7)
    follow = [[rng.randrange(5, 1000) for _ in range(9)] for _ in prompts]

    def two_turns(core: EngineCore, replay: dict[str, list[int]] | None) -> tuple[dict[str, list[int]], int]:
        both, outs, _ = serve_two_turns(core, prompts, follow, replay)
        return both, sum(outs[f"t2r{i}"][-1].num_cached_tokens for i in range(len(prompts)))

    off, off_hits = two_turns(core_factory(), None)
    spec_core = core_factory(**{"speculative.method": "replay"})
    on, on_hits = two_turns(spec_core, off)
    assert on == off
    assert off_hits > sum(len(p) for p in prompts)  # turn 2 hit into turn 1's output
    assert on_hits >= 0.99 * off_hits
    assert _spec(spec_core)["spec_decode.acceptance_rate"] == 1.0


def test_host_tier_under_pressure_with_drafts(core_factory: Any) -> None:
    """Conversations that evict each other to the host tier and come back: outputs identical to
    speculation off, with the tiers moving KV and checkpoints both ways."""
    from tests.engine.test_host_tier import _pressured
    from tests.engine.test_prefix_cache import rand_tokens, serve

    rng = random.Random(31)
    core = _pressured(core_factory, **{"speculative.method": "replay", "speculative.replay_corrupt_every": 3})
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(6)]
    for turn in range(3):
        want = serve(plain, convs, 12, waves=False)
        for c, w in zip(convs, want, strict=True):
            drafter.record(c, w)
        assert serve(core, convs, 12, waves=True) == want, f"turn {turn}"
        convs = [c + w + rand_tokens(rng, 24) for c, w in zip(convs, want, strict=True)]
    s = core.stats()
    assert s["host.kv_demoted_blocks"] > 0 and s["prefix_cache.hit_tokens_host"] > 0
    assert s["spec_decode.num_accepted_tokens"] > 0


def test_windows_stay_in_one_block_and_the_cache_holds_accepted_tokens_only(core_factory: Any) -> None:
    """Every verify window lies in one KV block; after every step, each request's published
    blocks are hashes of its own tokens (accepted drafts only) and cover no more than it computed."""
    from deltaserve.cache.hashing import block_hashes

    prompts = _prompts(6)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    _replay(core, prompts, off)
    bs = core.cache.block_size
    schedule = core.scheduler.schedule
    windows = 0

    def checked_schedule() -> Any:
        nonlocal windows
        out = schedule()
        if out is not None:
            for s in out.seqs[out.num_decodes : out.num_decodes + out.num_verify]:
                assert s.drafts and s.start // bs == (s.end - 1) // bs, (s.start, s.end)
                windows += 1
        return out

    core.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, greedy(MAX_TOKENS), request_id=f"r{i}"))
    while core.has_work():
        core.step()
        core.check_integrity()
        for req in core.scheduler.running:
            seq = req.cache
            assert seq is not None and len(seq.nodes) * bs <= req.num_computed_tokens
            want = block_hashes(req.token_ids[: len(seq.nodes) * bs], bs, seq.salt)
            assert [n.key for n in seq.nodes] == want
    assert windows > 0
