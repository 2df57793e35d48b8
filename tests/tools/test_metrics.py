"""Metrics arithmetic on a hand-made timeline (every number below is computed by hand)."""

from __future__ import annotations

import math

import pytest

from deltaserve.tools.metrics import (
    TABLE_ROWS,
    RequestRecord,
    distribution,
    e2e,
    format_table,
    hit_rate_per_turn,
    itls,
    lookup,
    percentile,
    stats_delta,
    summarize,
    tpot,
    ttft,
)


def rec(
    rid: str, submit: float, times: list[float], prompt: int, cached: int, turn: int = 0
) -> RequestRecord:
    return RequestRecord(
        rid=rid, session=rid, turn=turn, arrival_s=submit, submit_s=submit,
        first_token_s=times[0] if times else None, token_times=list(times), finish_s=times[-1] if times else None,
        num_prompt_tokens=prompt, num_cached_tokens=cached, num_output_tokens=len(times),
        max_tokens=len(times), finish_reason="length", output_token_ids=list(range(len(times))),
    )  # fmt: skip


@pytest.fixture
def timeline() -> list[RequestRecord]:
    return [
        rec("a", 0.0, [0.5, 0.6, 0.8, 1.1], prompt=100, cached=64, turn=0),
        rec("b", 1.0, [1.2, 1.3], prompt=50, cached=32, turn=1),
        rec("c", 2.0, [3.0], prompt=30, cached=0, turn=1),
    ]


def test_per_request(timeline: list[RequestRecord]) -> None:
    a, b, c = timeline
    assert ttft(a) == pytest.approx(0.5) and ttft(b) == pytest.approx(0.2) and ttft(c) == pytest.approx(1.0)
    assert tpot(a) == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert tpot(b) == pytest.approx(0.1)
    assert tpot(c) is None  # one token: no TPOT
    assert itls(a) == pytest.approx([0.1, 0.2, 0.3])
    assert itls(c) == []
    assert e2e(a) == pytest.approx(1.1) and e2e(b) == pytest.approx(0.3) and e2e(c) == pytest.approx(1.0)


def test_percentiles() -> None:
    xs = [0.5, 0.2, 1.0]
    assert percentile(xs, 50) == pytest.approx(0.5)
    assert percentile(xs, 90) == pytest.approx(0.9)  # rank 1.8: 0.5 + 0.8 * 0.5
    assert percentile(xs, 99) == pytest.approx(0.99)
    assert percentile(xs, 0) == 0.2 and percentile(xs, 100) == 1.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    ys = list(range(1, 11))  # 1..10
    assert percentile(ys, 50) == pytest.approx(5.5)
    assert percentile(ys, 90) == pytest.approx(9.1)
    assert percentile(ys, 99) == pytest.approx(9.91)
    d = distribution(ys)
    assert d["mean"] == 5.5 and d["count"] == 10 and d["min"] == 1 and d["max"] == 10


def test_summary(timeline: list[RequestRecord]) -> None:
    s = summarize(timeline)
    assert s["requests"] == s["completed"] == 3 and s["failed"] == 0
    assert s["duration_s"] == pytest.approx(3.0)  # first send 0.0 .. last finish 3.0
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(7 / 3)
    assert s["total_throughput"] == pytest.approx((180 + 7) / 3)
    assert s["ttft_s"]["mean"] == pytest.approx(1.7 / 3)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["ttft_s"]["p90"] == pytest.approx(0.9)
    assert s["tpot_s"]["mean"] == pytest.approx(0.15)
    assert s["tpot_s"]["count"] == 2
    assert s["itl_s"]["count"] == 4
    assert s["itl_s"]["mean"] == pytest.approx(0.7 / 4)  # 0.1 0.2 0.3 0.1
    assert s["itl_s"]["p50"] == pytest.approx(0.15)  # sorted 0.1 0.1 0.2 0.3: rank 1.5
    assert s["e2e_s"]["p50"] == pytest.approx(1.0)
    assert s["e2e_s"]["mean"] == pytest.approx(2.4 / 3)
    assert s["prefix_hit_rate"] == pytest.approx(96 / 180)
    assert s["hit_rate_per_turn"] == {"0": pytest.approx(0.64), "1": pytest.approx(32 / 80)}
    assert hit_rate_per_turn(timeline) == {0: pytest.approx(0.64), 1: pytest.approx(0.4)}
    assert s["engine_hit_rate"] is None and s["checkpoints"]["stored"] is None and s["preemptions"] is None


def test_failed_requests_are_counted_not_measured(timeline: list[RequestRecord]) -> None:
    bad = rec("d", 0.5, [], prompt=1000, cached=0)
    bad.error, bad.finish_reason = "PromptTooLongError: too long", "error"
    s = summarize([*timeline, bad])
    assert s["requests"] == 4 and s["completed"] == 3 and s["failed"] == 1
    assert s["prefix_hit_rate"] == pytest.approx(96 / 180)
    assert s["ttft_s"]["count"] == 3


def test_engine_stats_in_summary_and_delta() -> None:
    before = {"prefix_cache.query_tokens": 24, "prefix_cache.hit_tokens": 0, "checkpoints.stored": 1,
              "checkpoints.skipped_budget": 0, "checkpoints.skipped_pool": 0, "checkpoints.evicted": 0,
              "scheduler.preemptions": 0, "scheduler.running": 1, "kv.usage": 0.1, "kv.evicted_blocks": 0,
              "prefix_cache.hit_rate": 0.0, "checkpoints.attached": 1}  # fmt: skip
    after = {"prefix_cache.query_tokens": 224, "prefix_cache.hit_tokens": 50, "checkpoints.stored": 11,
             "checkpoints.skipped_budget": 2, "checkpoints.skipped_pool": 3, "checkpoints.evicted": 4,
             "scheduler.preemptions": 5, "scheduler.running": 0, "kv.usage": 0.5, "kv.evicted_blocks": 6,
             "prefix_cache.hit_rate": 50 / 224, "checkpoints.attached": 9}  # fmt: skip
    d = stats_delta(before, after)
    assert d["prefix_cache.query_tokens"] == 200 and d["prefix_cache.hit_tokens"] == 50
    assert d["prefix_cache.hit_rate"] == pytest.approx(0.25)
    assert d["checkpoints.stored"] == 10
    assert d["scheduler.running"] == 0 and d["kv.usage"] == 0.5 and d["checkpoints.attached"] == 9  # gauges
    s = summarize([rec("a", 0.0, [0.1, 0.2], 10, 0)], d)
    assert s["engine_hit_rate"] == pytest.approx(0.25)
    assert s["checkpoints"] == {"stored": 10, "skipped": 5, "skipped_budget": 2, "skipped_pool": 3, "evicted": 4,
                                "restored": None, "bytes_used": None}  # fmt: skip
    assert s["preemptions"] == 5 and s["kv_evicted_blocks"] == 6


def test_table(timeline: list[RequestRecord]) -> None:
    a = summarize(timeline)
    b = summarize([rec(r.rid, r.submit_s, [r.submit_s + 2 * (t - r.submit_s) for t in r.token_times],
                       r.num_prompt_tokens, 0, r.turn) for r in timeline])  # fmt: skip
    text = format_table([("engine", a), ("hf", b)], [("same prompts as first", ["ref", "3/3"])])
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "engine", "hf", "/engine"]
    ttft_line = next(line for line in lines if line.startswith("TTFT mean"))
    assert ttft_line.split()[-3:] == ["566.7", "1133.3", "2.00x"]
    assert any(line.startswith("hit rate turn 1") for line in lines)
    assert lines[-1].split()[-2:] == ["ref", "3/3"]
    for _, path, _ in TABLE_ROWS:
        assert path.split(".")[0] in a, path
    assert lookup(a, "ttft_s.p99") == a["ttft_s"]["p99"] and lookup(a, "nope.x") is None


def test_record_roundtrip(timeline: list[RequestRecord]) -> None:
    d = timeline[0].to_dict()
    assert RequestRecord.from_dict(d) == timeline[0]
