"""Metrics arithmetic on a hand-made timeline (every number below is computed by hand)."""

from __future__ import annotations

import math

import pytest

from deltaserve.cache.loss import MISS_CAUSES
from deltaserve.tools.metrics import (
    TABLE_ROWS,
    RequestRecord,
    distribution,
    e2e,
    format_legend,
    format_table,
    hit_rate_per_turn,
    itls,
    lookup,
    percentile,
    prometheus_stats,
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


# ---------------------------------------------------------------------------- peers' /metrics
# Exposition text in each server's format (names, labels and HELP as each one writes them).
VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/models/q08"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="/models/q08"} 600.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="/models/q08"} 1.7640e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/models/q08"} 576.0
vllm:prefix_cache_hits_total{engine="1",model_name="/models/q08"} 224.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/models/q08"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/q08"} 0.25
"""

LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1200
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens served from the cache.
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 800
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 12.5
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 96
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
"""

DELTASERVE_METRICS = """\
# HELP deltaserve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE deltaserve:prefix_cache_queries_total counter
deltaserve:prefix_cache_queries_total{model_name="q08"} 640.0
# HELP deltaserve:prefix_cache_hits_total Prompt tokens served from the prefix cache.
# TYPE deltaserve:prefix_cache_hits_total counter
deltaserve:prefix_cache_hits_total{model_name="q08"} 448.0
# HELP deltaserve:prefix_cache_hits_by_tier_total Prompt tokens served, by tier.
# TYPE deltaserve:prefix_cache_hits_by_tier_total counter
deltaserve:prefix_cache_hits_by_tier_total{model_name="q08",tier="device"} 448.0
# HELP deltaserve:checkpoints_skipped_total Checkpoint captures skipped.
# TYPE deltaserve:checkpoints_skipped_total counter
deltaserve:checkpoints_skipped_total{model_name="q08",reason="budget"} 3.0
deltaserve:checkpoints_skipped_total{model_name="q08",reason="pool"} 1.0
deltaserve:checkpoints_skipped_total{model_name="q08",reason="value"} 5.0
"""


def test_prometheus_stats_of_vllm_sum_over_engine_and_model_labels() -> None:
    stats = prometheus_stats(VLLM_METRICS)
    assert stats == {
        "prefix_cache.query_tokens": 1600.0,
        "prefix_cache.hit_tokens": 800.0,
        "prefix_cache.hit_rate": 0.5,
        "scheduler.preemptions": 2.0,
        "kv.usage": 0.25,
    }


def test_prometheus_stats_of_llamacpp_count_cached_and_computed_prompt_tokens() -> None:
    stats = prometheus_stats(LLAMACPP_METRICS)
    assert stats == {
        "prefix_cache.query_tokens": 2000.0,  # 1200 computed + 800 from the cache
        "prefix_cache.hit_tokens": 800.0,
        "prefix_cache.hit_rate": 0.4,
    }
    # a llama.cpp without the cached-token counter: its prompt counter alone says nothing of hits
    older = "\n".join(line for line in LLAMACPP_METRICS.splitlines() if "cached" not in line)
    assert prometheus_stats(older) == {}
    # the run's share: counters after minus before, the hit rate from those
    before = prometheus_stats(LLAMACPP_METRICS.replace(" 1200", " 200").replace(" 800", " 0"))
    delta = stats_delta(before, stats)
    assert delta["prefix_cache.query_tokens"] == 1800.0 and delta["prefix_cache.hit_tokens"] == 800.0
    assert delta["prefix_cache.hit_rate"] == pytest.approx(800 / 1800)
    assert summarize([], delta)["engine_hit_rate"] == pytest.approx(800 / 1800)


def test_prometheus_stats_of_deltaserve_select_labels() -> None:
    stats = prometheus_stats(DELTASERVE_METRICS)
    assert stats["prefix_cache.hit_rate"] == pytest.approx(0.7)
    assert stats["checkpoints.skipped_budget"] == 3.0 and stats["checkpoints.skipped_pool"] == 1.0
    assert "checkpoints.stored" not in stats  # not exported: absent, not zero


@pytest.mark.parametrize("text", ["", "<html><body>404 not found</body></html>", "just some words\n"])
def test_prometheus_stats_of_other_text_is_empty(text: str) -> None:
    assert prometheus_stats(text) == {}


# deltaserve's misses by cause as server/metrics.py exposes them: every cause, zeros too; the
# query causes (128 + 48 + 16) are the queries' misses (640 - 448); preemption is outside them
MISSES = {"cold": 128.0, "kv_evicted_host": 48.0, "checkpoint_evicted": 16.0, "preemption": 32.0}
DELTASERVE_MISS_METRICS = (
    DELTASERVE_METRICS
    + "# HELP deltaserve:prefix_cache_miss_tokens_total Prompt tokens not served from the prefix cache, "
    "by cause (preemption: recomputed after one).\n"
    "# TYPE deltaserve:prefix_cache_miss_tokens_total counter\n"
    + "".join(
        f'deltaserve:prefix_cache_miss_tokens_total{{model_name="q08",cause="{c}"}} {MISSES.get(c, 0.0)}\n'
        for c in MISS_CAUSES
    )
)


def _miss_lines(table: str) -> list[list[str]]:
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("prefix hit rate (engine)"))
    rows = []
    for line in lines[at + 1 :]:
        if not line.startswith(("missed:", "recomputed")):
            break
        label, _, values = line.partition("  ")
        rows.append([label, *values.split()])
    return rows


def test_miss_rows_from_deltaserve_metrics() -> None:
    stats = prometheus_stats(DELTASERVE_MISS_METRICS)
    assert {k: v for k, v in stats.items() if k.startswith("prefix_cache.miss_tokens.")} == {
        f"prefix_cache.miss_tokens.{c}": MISSES.get(c, 0.0) for c in MISS_CAUSES
    }
    # the run's share (counters after minus before) of the prompt tokens looked up: before it,
    # 320 looked up, 256 hit, 64 cold, 32 recomputed; in the run 320 looked up, 128 missed
    before = DELTASERVE_MISS_METRICS
    for old, new in ((" 640.0", " 320.0"), (" 448.0", " 256.0"), ('"cold"} 128.0', '"cold"} 64.0'),
                     ('"kv_evicted_host"} 48.0', '"kv_evicted_host"} 0.0'),
                     ('"checkpoint_evicted"} 16.0', '"checkpoint_evicted"} 0.0')):  # fmt: skip
        before = before.replace(old, new)
    s = summarize([], stats_delta(prometheus_stats(before), stats))
    assert s["engine_hit_rate"] == pytest.approx(192 / 320)
    assert s["missed"]["cold"] == pytest.approx(64 / 320) and s["missed"]["granularity"] == 0.0
    assert s["missed"]["given_up"] == 0.0 and s["missed"]["preemption"] == 0.0  # 32 before and after
    table = format_table([("openai", s)])
    # under the engine hit rate, the causes with tokens only
    assert _miss_lines(table) == [
        ["missed: cold", "20.0%"],
        ["missed: KV evicted (host)", "15.0%"],
        ["missed: checkpoint evicted", "5.0%"],
    ]
    assert "missed: / recomputed after preemption" in format_legend([("openai", s)])


def test_miss_rows_from_engine_stats_beside_a_backend_without_them() -> None:
    """The in-process engine's stats (``engine.stats()`` keys) beside vLLM's /metrics, which has
    no causes: its cells read -, and the rows show since the engine has tokens there."""
    after = {"prefix_cache.query_tokens": 1000, "prefix_cache.hit_tokens": 600}
    after |= {f"prefix_cache.miss_tokens.{c}": 0 for c in MISS_CAUSES}
    after |= {"prefix_cache.miss_tokens.cold": 250, "prefix_cache.miss_tokens.kv_evicted_device": 100,
              "prefix_cache.miss_tokens.read_budget": 30, "prefix_cache.miss_tokens.disk_wait": 10,
              "prefix_cache.miss_tokens.granularity": 10, "prefix_cache.miss_tokens.preemption": 5}  # fmt: skip
    engine = summarize([], stats_delta({}, after))
    vllm = summarize([], prometheus_stats(VLLM_METRICS))
    assert vllm["missed"] == dict.fromkeys(engine["missed"])  # no counters: none of them
    assert _miss_lines(format_table([("engine", engine), ("vllm", vllm)])) == [
        ["missed: cold", "25.0%", "-"],
        ["missed: KV evicted (device)", "10.0%", "-"],
        ["missed: granularity", "1.0%", "-"],
        ["missed: disk hit given up", "4.0%", "-"],  # read budget + disk wait
        ["recomputed after preemption", "0.5%", "-"],
    ]
    # a backend that reports no cause shows no miss row and no note of them
    assert _miss_lines(format_table([("vllm", vllm)])) == []
    assert "missed:" not in format_legend([("vllm", vllm)])
