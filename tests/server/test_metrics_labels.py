"""The metrics a dashboard reads, against a live server on the built-in model: every series has
``model_name``; the request-phase histograms move with a request and add up; every query of
``examples/grafana.json`` names only metrics ``/metrics`` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.cache.loss import MISS_CAUSES

from .conftest import MODEL, Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana.json"
PHASES = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "time_per_output_token_seconds",
)


async def scrape(served: Served) -> dict[str, float]:
    """Every sample by name (+ labels other than model_name), asserting model_name on each."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(served.url + "/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == MODEL, s
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "le")
            if "le" not in labels:
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


async def test_every_series_has_model_name_and_the_phases_add_up(served: Served) -> None:
    before = await scrape(served)
    client = served.client()
    done = await client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 5
    after = await scrape(served)  # the alias "tiny" is still counted under the first name
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    for name in PHASES:
        assert delta[f"deltaserve:{name}_count"] == 1, name
    s = {name: delta[f"deltaserve:{name}_sum"] for name in PHASES}
    assert all(v >= 0 for v in s.values()), s
    # engine-side queue + prefill fit inside the server-side time to first token
    assert (
        s["request_queue_time_seconds"] + s["request_prefill_time_seconds"]
        <= s["time_to_first_token_seconds"]
    )
    assert 0 < s["request_decode_time_seconds"] <= s["e2e_request_latency_seconds"]
    # the mean per output token after the first: decode time over the 4 gaps
    assert s["time_per_output_token_seconds"] == pytest.approx(s["request_decode_time_seconds"] / 4)
    assert delta["deltaserve:request_success_total{finished_reason=length}"] == 1
    # every prompt token the cache did not serve is under one cause (preemption: outside the query)
    misses = {k: v for k, v in delta.items() if k.startswith("deltaserve:prefix_cache_miss_tokens_total{")}
    assert len(misses) == len(MISS_CAUSES)
    queried = delta["deltaserve:prefix_cache_queries_total"] - delta["deltaserve:prefix_cache_hits_total"]
    assert queried > 0
    assert (
        sum(
            v for k, v in misses.items() if k != "deltaserve:prefix_cache_miss_tokens_total{cause=preemption}"
        )
        == queried
    )


def promql_metrics(expr: str) -> list[str]:
    """The metric names a PromQL expression reads (label matchers, ranges and grouping removed;
    a name followed by ``(`` is a function)."""
    e = re.sub(r"\{[^}]*\}", "", expr)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", e)
    return re.findall(r"[A-Za-z_][\w:]*(?![\w:]|\s*\()", e)


async def test_promql_metrics() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(deltaserve:x_bucket{model_name="$m"}[$__rate_interval])))'
    )
    assert promql_metrics(expr) == ["deltaserve:x_bucket"]
    assert promql_metrics("rate(a:b_sum[5m]) / rate(a:b_count[5m])") == ["a:b_sum", "a:b_count"]


async def test_the_dashboard_reads_only_exported_metrics(served: Served) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        # a labelled counter exports a series once it has one: an error response, a finish
        bad = await http.post(served.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 404
        ok = await http.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
        text = (await http.get(served.url + "/metrics")).text
    exported = {name.split("{")[0] for name in await scrape(served)}
    exported |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}  # buckets
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    assert len(exprs) >= 20
    read: set[str] = set()
    for expr in exprs:
        names = promql_metrics(expr)
        assert names, expr
        assert not set(names) - exported, (expr, set(names) - exported)
        assert 'model_name="$model_name"' in expr, expr
        read |= set(names)
    assert re.fullmatch(r"label_values\(([\w:]+), model_name\)", variable["definition"]).group(1) in exported  # type: ignore[union-attr]
    for name in PHASES:  # the latency histograms a vLLM dashboard shows are all on it
        assert f"deltaserve:{name}_bucket" in read, name
