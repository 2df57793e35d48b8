"""Speculative decoding with sampled requests: seeded runs reproduce, every emitted token has
its log-probability, a greedy request with log-probabilities equals speculation off."""

from __future__ import annotations

from typing import Any

from deltaserve.engine import EngineCore, SamplingParams
from tests.engine.conftest import greedy, run_to_completion
from tests.spec.test_spec_greedy import MAX_TOKENS, _prompts, _replay, _serve, _spec


def _outputs(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[Any]]:
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(p, params, request_id=f"r{i}"))
    return run_to_completion(core)


def test_seeded_sampling_with_drafts_reproduces_and_reports_logprobs(core_factory: Any) -> None:
    prompts = _prompts(10)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    params = SamplingParams(
        temperature=0.7, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
    )
    runs = []
    for _ in range(2):
        core = core_factory(**{"speculative.method": "replay"})
        _replay(core, prompts, off)  # drafts: the greedy outputs (a sampled run accepts some)
        outs = _outputs(core, prompts, params)
        toks = {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}
        for os in outs.values():
            for o in os:
                assert o.logprobs is not None and [lp.token_id for lp in o.logprobs] == o.token_ids
                assert all(len(lp.top) == 2 for lp in o.logprobs)
        assert all(len(t) == MAX_TOKENS for t in toks.values())
        s = _spec(core)
        assert s["spec_decode.num_draft_tokens"] > 0 and s["spec_decode.num_accepted_tokens"] > 0
        runs.append(toks)
    assert runs[0] == runs[1]


def test_greedy_with_logprobs_equals_speculation_off(core_factory: Any) -> None:
    prompts = _prompts(11, n=3)
    params = greedy(MAX_TOKENS, logprobs=1)
    off = _outputs(core_factory(), prompts, params)
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    _replay(core, prompts, {rid: [t for o in os for t in o.token_ids] for rid, os in off.items()})
    on = _outputs(core, prompts, params)
    for rid in off:
        a = [lp for o in off[rid] for lp in (o.logprobs or [])]
        b = [lp for o in on[rid] for lp in (o.logprobs or [])]
        assert [lp.token_id for lp in a] == [lp.token_id for lp in b]
        assert [lp.rank for lp in a] == [lp.rank for lp in b]
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a, b, strict=True))
    assert _spec(core)["spec_decode.num_accepted_tokens"] > 0


def test_stats_prometheus_and_loadgen_report_acceptance(core_factory: Any) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from deltaserve.server.metrics import EngineCollector
    from deltaserve.tools.metrics import format_table, prometheus_stats, spec_summary, stats_delta

    prompts = _prompts(12, n=2)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    before = core.stats()
    _replay(core, prompts, off)
    _serve(core, prompts, greedy(MAX_TOKENS))
    s = core.stats()
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: s, "m"))
    text = generate_latest(registry).decode()
    assert (
        f'deltaserve:spec_decode_num_drafts_total{{model_name="m"}} {float(s["spec_decode.num_drafts"])}'
        in text
    )
    accepted = float(s["spec_decode.num_accepted_tokens_per_pos.0"])
    assert (
        f'deltaserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {accepted}'
        in text
    )
    scraped = prometheus_stats(text)
    assert scraped["spec_decode.num_accepted_tokens"] == s["spec_decode.num_accepted_tokens"] > 0
    summary = spec_summary(stats_delta(before, s))
    assert summary["acceptance_rate"] == s["spec_decode.acceptance_rate"]
    assert summary["tokens_per_verify"] == s["spec_decode.mean_tokens_per_verify"]
    table = format_table([("engine", {"spec_decode": summary})])
    assert "spec decode acceptance" in table and "tokens per verify" in table
    # speculation off: no such series, no such rows
    plain = core_factory().stats()
    assert "spec_decode.num_drafts" not in plain
    assert "spec decode" not in format_table([("engine", {"spec_decode": spec_summary(plain)})])


def test_each_request_logs_its_own_counters(core_factory: Any, caplog: Any) -> None:
    import logging

    prompts = _prompts(13, n=2)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**{"speculative.method": "replay", "logging.level": "debug"})
    _replay(core, prompts, off)
    with caplog.at_level(logging.DEBUG, logger="deltaserve"):
        _serve(core, prompts, greedy(MAX_TOKENS))
    lines = [r for r in caplog.records if getattr(r, "event", "") == "spec.request"]
    assert sorted(r.fields["request_id"] for r in lines) == ["r0", "r1"]  # type: ignore[attr-defined]
    s = _spec(core)
    assert sum(r.fields["accepted"] for r in lines) == s["spec_decode.num_accepted_tokens"]  # type: ignore[attr-defined]
    assert sum(r.fields["verifies"] for r in lines) == s["spec_decode.num_drafts"]  # type: ignore[attr-defined]
    assert not core.speculation.per_request  # type: ignore[union-attr]
