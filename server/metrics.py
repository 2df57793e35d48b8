"""Prometheus metrics of one server: ``GET /metrics``.

Every app has its own ``CollectorRegistry`` (never the process-global one), so a process — a
test — can run several servers. Names are prefixed ``deltaserve:`` and follow vLLM's where a
counterpart exists, so existing dashboards need only the prefix changed:

Measured by the server, per engine request (each of ``n`` completions is one):

* ``deltaserve:request_success_total{finished_reason}`` — stop, length, tool_calls, abort, error;
* ``deltaserve:time_to_first_token_seconds`` — request received to the completion's first token;
* ``deltaserve:inter_token_latency_seconds`` — between consecutive tokens of a completion;
* ``deltaserve:e2e_request_latency_seconds`` — request received to its last token;
* ``deltaserve:request_prompt_tokens`` / ``deltaserve:request_generation_tokens`` (histograms);
* ``deltaserve:http_errors_total{status}`` — error responses the API returned;
* ``deltaserve:client_disconnects_total`` — clients that hung up before their response (while
  sending the body, or while waiting for a whole response): not errors of the server.

Read from ``AsyncEngine.stats()`` at scrape time (a custom collector, no polling):

* gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (0..1, as
  vLLM), ``checkpoint_pool_usage_perc``, ``live_slots_usage_perc``, ``checkpoints_attached``,
  ``checkpoint_reuse_rate{kind}`` (the value model's learned reuse per capture class),
  ``cache_pages{use=kv|checkpoint|free}`` (the one device budget's current split);
* counters ``prompt_tokens``, ``generation_tokens``, ``computed_tokens`` (prompt tokens actually
  prefilled plus decode tokens), ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens, as
  vLLM), ``num_preemptions``, ``checkpoints_stored``, ``checkpoints_restored``,
  ``checkpoints_evicted``, ``checkpoints_skipped{reason=budget|pool|value}``, ``kv_evicted_blocks``,
  ``kv_moved_blocks``, ``checkpoints_evicted_for_kv``, ``cache_page_conversions{to=kv|checkpoint}``,
  ``engine_requests{outcome=finished|aborted|failed}``, ``engine_steps``, ``engine_steps_failed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "deltaserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# engine stats key -> (metric name, help) for monotonic counters
_ENGINE_COUNTERS = {
    "tokens.prompt": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "tokens.generated": ("generation_tokens", "Generated tokens."),
    "tokens.computed": ("computed_tokens", "Tokens run through the model (prefill not served by the cache, and decodes)."),
    "prefix_cache.query_tokens": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache.hit_tokens": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "scheduler.preemptions": ("num_preemptions", "Requests preempted (freed and recomputed later)."),
    "checkpoints.stored": ("checkpoints_stored", "GDN state checkpoints stored in the prefix cache."),
    "checkpoints.restored": ("checkpoints_restored", "Checkpoints restored into a request's live state."),
    "checkpoints.evicted": ("checkpoints_evicted", "Checkpoints evicted from the pool."),
    "kv.evicted_blocks": ("kv_evicted_blocks", "Cached KV blocks evicted."),
    "kv.moved_blocks": ("kv_moved_blocks", "KV blocks moved out of a page a checkpoint took (one budget)."),
    "checkpoints.evicted_for_kv": ("checkpoints_evicted_for_kv", "Checkpoints evicted to give their page to KV blocks (one budget)."),
    "scheduler.steps": ("engine_steps", "Engine steps run."),
    "steps.failed": ("engine_steps_failed", "Engine steps that raised (their requests ended with an error)."),
}  # fmt: skip


def _ratio(stats: dict[str, Any], used: str, total: str) -> float:
    t = stats.get(total) or 0
    return float(stats.get(used, 0)) / t if t else 0.0


class EngineCollector(Collector):
    """Engine counters and gauges, read from ``stats()`` when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats() or {}
        yield from _gauges(s)
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(s.get(key, 0)))
        yield from _labelled(s)


def _gauges(s: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """The engine's gauges from one stats snapshot."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, value=float(value))

    yield gauge(
        "num_requests_running",
        "Requests running (prefilling or decoding).",
        s.get("scheduler.running", 0),
    )
    yield gauge("num_requests_waiting", "Requests waiting for admission.", s.get("scheduler.waiting", 0))
    yield gauge(
        "kv_cache_usage_perc",
        "KV pool usage, 0..1 (cached blocks count as used).",
        s.get("kv.usage", 0.0),
    )
    yield gauge(
        "checkpoint_pool_usage_perc",
        "Checkpoint slots in use, 0..1.",
        _ratio(s, "checkpoints.used_slots", "checkpoints.slots"),
    )
    yield gauge(
        "live_slots_usage_perc",
        "Live GDN state slots in use, 0..1.",
        _ratio(s, "live_slots.used", "live_slots.total"),
    )
    yield gauge(
        "checkpoints_attached", "Checkpoints held by the prefix cache.", s.get("checkpoints.attached", 0)
    )
    yield gauge(
        "prefix_cache_hit_rate",
        "Hit tokens / query tokens since start.",
        s.get("prefix_cache.hit_rate", 0.0),
    )


def _labelled(s: dict[str, Any]) -> Iterator[Any]:
    """The engine's labelled families: skipped checkpoints, reuse rates, request outcomes."""
    skipped = CounterMetricFamily(
        PREFIX + "checkpoints_skipped", "Checkpoint captures skipped.", labels=["reason"]
    )
    skipped.add_metric(["budget"], float(s.get("checkpoints.skipped_budget", 0)))
    skipped.add_metric(["pool"], float(s.get("checkpoints.skipped_pool", 0)))
    skipped.add_metric(["value"], float(s.get("checkpoints.skipped_value", 0)))
    yield skipped
    reuse = GaugeMetricFamily(
        PREFIX + "checkpoint_reuse_rate",
        "Learned probability that a checkpoint of this class serves a hit (cache value model).",
        labels=["kind"],
    )
    for key, value in s.items():
        if key.startswith("checkpoints.reuse."):
            reuse.add_metric([key.removeprefix("checkpoints.reuse.")], float(value))
    yield reuse
    if "cache.pages" in s:  # one device budget: the current split of its pages
        pages = GaugeMetricFamily(
            PREFIX + "cache_pages", "Pages of the one device cache budget, by use.", labels=["use"]
        )
        for use in ("kv", "checkpoint", "free"):
            pages.add_metric([use], float(s.get(f"cache.pages_{use}", 0)))
        yield pages
        changes = CounterMetricFamily(
            PREFIX + "cache_page_conversions", "Pages that changed use, by the use they took.", labels=["to"]
        )
        changes.add_metric(["kv"], float(s.get("cache.pages_to_kv", 0)))
        changes.add_metric(["checkpoint"], float(s.get("cache.pages_to_checkpoints", 0)))
        yield changes
    outcome = CounterMetricFamily(
        PREFIX + "engine_requests", "Engine requests by outcome.", labels=["outcome"]
    )
    for label, key in (("finished", "requests.finished"), ("aborted", "requests.aborted"),
                       ("failed", "requests.failed")):  # fmt: skip
        outcome.add_metric([label], float(s.get(key, 0)))
    yield outcome  # fmt: skip


class ServerMetrics:
    """The server's metrics on a registry of its own."""

    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.http_errors = Counter(
            PREFIX + "http_errors", "Error responses by HTTP status.", ["status"], registry=r
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects", "Clients that hung up before their response.", registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request received to last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt tokens per request.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        if stats is not None:
            r.register(EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
