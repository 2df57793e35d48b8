"""Prometheus metrics of one server: ``GET /metrics``.

Every app has its own ``CollectorRegistry`` (never the process-global one), so a process — a
test — can run several servers. Names are prefixed ``deltaserve:`` and follow vLLM's where a
counterpart exists, so existing dashboards need only the prefix changed
(``examples/grafana.json`` is one over these names). Every series has the label
``model_name``: the first served name (``--served-model-name``, else ``model.path``), as vLLM.

Measured by the server, per engine request (each of ``n`` completions is one):

* ``deltaserve:request_success_total{finished_reason}`` — stop, length, tool_calls, abort, error;
* ``deltaserve:time_to_first_token_seconds`` — request received to the completion's first token;
* ``deltaserve:inter_token_latency_seconds`` — between consecutive tokens of a completion;
* ``deltaserve:e2e_request_latency_seconds`` — request received to its last token;
* ``deltaserve:request_queue_time_seconds`` — engine arrival to first admission, and
  ``deltaserve:request_prefill_time_seconds`` — first admission to the first token (both
  measured by the engine: ``RequestOutput.queue_time_s`` / ``prefill_time_s``);
* ``deltaserve:request_decode_time_seconds`` — first token to last token;
* ``deltaserve:time_per_output_token_seconds`` — a completion's decode time / (its tokens - 1),
  once per completion of two or more tokens (the mean gap; the gaps themselves are
  ``inter_token_latency_seconds``);
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
  ``engine_requests{outcome=finished|aborted|failed}``, ``engine_steps``, ``engine_steps_failed``,
  ``kv_events_published``, ``kv_events_dropped`` (cache events, ``[kv_events]``),
  ``prefix_cache_hits_by_tier{tier=device|host|disk}``, ``prefix_cache_miss_tokens{cause}`` (every
  prompt token not served from the cache under one cause: ``cache/loss.py``); with a disk tier ``disk_bytes_written``,
  ``disk_bytes_read``, ``disk_queue_drops``, ``disk_write_errors``, ``disk_damaged_items``,
  ``disk_evicted_items``, ``disk_reads``, ``disk_read_wait_seconds``, ``disk_read_timeouts``,
  ``disk_load_wait_seconds`` and gauges ``disk_cache_bytes``, ``disk_cache_items``, ``disk_cache_capacity_bytes``;
  with a remote tier (its hits count as ``tier=disk`` above) ``remote_fetches``, ``remote_hits``,
  ``remote_fetch_misses``, ``remote_read_timeouts``, ``remote_read_wait_seconds``,
  ``remote_damaged_reads``, ``remote_bytes_written``, ``remote_bytes_read``,
  ``remote_items_published``, ``remote_put_drops``, ``remote_call_timeouts``, ``remote_breaker_opens``;
  with speculative decoding (vLLM's names) ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
  ``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos{position}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deltaserve.cache.loss import MISS_CAUSES, MISS_PREFIX

PREFIX = "deltaserve:"
#: the label every series has: the first served name
MODEL_LABEL = "model_name"
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
    "kv_events.published": ("kv_events_published", "Cache events sent to subscribers (kv_events; 0 when off)."),
    "kv_events.dropped": ("kv_events_dropped", "Cache events dropped: the publisher's queue was full (a resync follows)."),
}  # fmt: skip


def _ratio(stats: dict[str, Any], used: str, total: str) -> float:
    t = stats.get(total) or 0
    return float(stats.get(used, 0)) / t if t else 0.0


class EngineCollector(Collector):
    """Engine counters and gauges, read from ``stats()`` when Prometheus scrapes; every family
    labelled ``model_name``."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Any]:
        s = self._stats() or {}
        yield from _gauges(s, self._model)
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
            counter.add_metric([self._model], float(s.get(key, 0)))
            yield counter
        yield from _labelled(s, self._model)
        yield from _tiers(s, self._model)
        if "spec_decode.num_drafts" in s:
            yield from _spec_decode(s, self._model)


# speculative decoding (``speculative.method`` set): stats key -> (name, help), vLLM's names
_SPEC_COUNTERS = {
    "spec_decode.num_drafts": ("spec_decode_num_drafts", "Verify windows (a request's drafts of one step)."),
    "spec_decode.num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_decode.num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}  # fmt: skip


def _spec_decode(s: dict[str, Any], model: str) -> Iterator[Any]:
    """Speculative decoding's counters, and accepted drafts by position in the window."""
    for key, (name, doc) in _SPEC_COUNTERS.items():
        counter = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        counter.add_metric([model], float(s.get(key, 0)))
        yield counter
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Verify windows whose draft at this position (0-based) was accepted.",
        labels=[MODEL_LABEL, "position"],
    )
    prefix = "spec_decode.num_accepted_tokens_per_pos."
    for key, value in s.items():
        if key.startswith(prefix):
            per_pos.add_metric([model, key.removeprefix(prefix)], float(value))
    yield per_pos


# the disk tier's counters (present when ``cache.disk_path`` is set): stats key -> (name, help, scale)
_DISK_COUNTERS = {
    "disk.bytes_written": ("disk_bytes_written", "Bytes written to the disk tier.", 1.0),
    "disk.bytes_read": ("disk_bytes_read", "Bytes read from the disk tier (hits, verified).", 1.0),
    "disk.queue_drops": ("disk_queue_drops", "Items not written: the writer queue was full or the item too large.", 1.0),
    "disk.write_errors": ("disk_write_errors", "Items not written: an I/O error (disk full, ...).", 1.0),
    "disk.damaged_items": ("disk_damaged_items", "Items that failed to verify on read (a miss; forgotten).", 1.0),
    "disk.evicted_items": ("disk_evicted_items", "Items evicted from the disk tier by value per byte.", 1.0),
    "disk.fetches": ("disk_reads", "Hits read from the disk tier before admission.", 1.0),
    "disk.read_wait_ms": ("disk_read_wait_seconds", "Time requests waited for their disk reads (sum).", 1e-3),
    "disk.read_timeouts": ("disk_read_timeouts", "Disk hits given up past cache.disk_read_timeout_s (computed instead).", 1.0),
    "disk.load_wait_ms": ("disk_load_wait_seconds", "Time from admission until a disk hit's loads landed (sum).", 1e-3),
}  # fmt: skip


# the remote tier's counters (present when ``cache.remote`` is set): stats key -> (name, help, scale)
_REMOTE_COUNTERS = {
    "remote.fetches": ("remote_fetches", "Remote hits looked up in the store before admission.", 1.0),
    "remote.hits": ("remote_hits", "Paths read whole from the store and verified (each a hit).", 1.0),
    "remote.fetch_misses": ("remote_fetch_misses", "Fetches that found nothing usable in the store (computed instead).", 1.0),
    "remote.read_timeouts": ("remote_read_timeouts", "Remote hits given up past cache.remote_timeout_s (computed instead).", 1.0),
    "remote.read_wait_ms": ("remote_read_wait_seconds", "Time requests waited for their remote reads (sum).", 1e-3),
    "remote.read_damaged": ("remote_damaged_reads", "Path reads that failed to verify (a miss).", 1.0),
    "remote.bytes_written": ("remote_bytes_written", "Bytes written to the store (objects and path manifests).", 1.0),
    "remote.bytes_read": ("remote_bytes_read", "Bytes read from the store for hits (verified).", 1.0),
    "remote.published": ("remote_items_published", "Checkpoints published with their path (the manifest written last).", 1.0),
    "remote.put_dropped": ("remote_put_drops", "Items not written: the writer queue was full or the store unavailable.", 1.0),
    "remote.timeouts": ("remote_call_timeouts", "Store calls not answered within cache.remote_timeout_s.", 1.0),
    "remote.breaker_opens": ("remote_breaker_opens", "Times the client stopped calling the store after failures (backoff).", 1.0),
}  # fmt: skip


def _remote(s: dict[str, Any], model: str) -> Iterator[Any]:
    """The remote tier's counters (``cache/remote_tier.py``: the tier's, its store's, its client's)."""
    for key, (name, doc, scale) in _REMOTE_COUNTERS.items():
        counter = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        counter.add_metric([model], float(s.get(key, 0)) * scale)
        yield counter


def _tiers(s: dict[str, Any], model: str) -> Iterator[Any]:
    """Prefix hits by the tier that served them, misses by cause; the disk tier's counters and gauges."""
    hits = CounterMetricFamily(
        PREFIX + "prefix_cache_hits_by_tier",
        "Prompt tokens served from the prefix cache, by the tier their KV came from.",
        labels=[MODEL_LABEL, "tier"],
    )
    for tier in ("device", "host", "disk"):
        hits.add_metric([model, tier], float(s.get(f"prefix_cache.hit_tokens_{tier}", 0)))
    yield hits
    misses = CounterMetricFamily(
        PREFIX + "prefix_cache_miss_tokens",
        "Prompt tokens not served from the prefix cache, by cause (preemption: recomputed after one).",
        labels=[MODEL_LABEL, "cause"],
    )
    for cause in MISS_CAUSES:
        misses.add_metric([model, cause], float(s.get(MISS_PREFIX + cause, 0)))
    yield misses
    if "remote.calls" in s:
        yield from _remote(s, model)
    if "disk.capacity_bytes" not in s:
        return
    for key, (name, doc, scale) in _DISK_COUNTERS.items():
        counter = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        counter.add_metric([model], float(s.get(key, 0)) * scale)
        yield counter
    for key, name, doc in (("disk.bytes", "disk_cache_bytes", "Bytes the disk tier holds."),
                           ("disk.items", "disk_cache_items", "Items the disk tier holds."),
                           ("disk.capacity_bytes", "disk_cache_capacity_bytes", "The disk tier's capacity.")):  # fmt: skip
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        gauge.add_metric([model], float(s.get(key, 0)))
        yield gauge


def _gauges(s: dict[str, Any], model: str) -> Iterator[GaugeMetricFamily]:
    """The engine's gauges from one stats snapshot."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
        family.add_metric([model], float(value))
        return family

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


def _labelled(s: dict[str, Any], model: str) -> Iterator[Any]:
    """The engine's labelled families: skipped checkpoints, reuse rates, request outcomes."""
    skipped = CounterMetricFamily(
        PREFIX + "checkpoints_skipped", "Checkpoint captures skipped.", labels=[MODEL_LABEL, "reason"]
    )
    skipped.add_metric([model, "budget"], float(s.get("checkpoints.skipped_budget", 0)))
    skipped.add_metric([model, "pool"], float(s.get("checkpoints.skipped_pool", 0)))
    skipped.add_metric([model, "value"], float(s.get("checkpoints.skipped_value", 0)))
    yield skipped
    reuse = GaugeMetricFamily(
        PREFIX + "checkpoint_reuse_rate",
        "Learned probability that a checkpoint of this class serves a hit (cache value model).",
        labels=[MODEL_LABEL, "kind"],
    )
    for key, value in s.items():
        if key.startswith("checkpoints.reuse."):
            reuse.add_metric([model, key.removeprefix("checkpoints.reuse.")], float(value))
    yield reuse
    if "cache.pages" in s:  # one device budget: the current split of its pages
        pages = GaugeMetricFamily(
            PREFIX + "cache_pages",
            "Pages of the one device cache budget, by use.",
            labels=[MODEL_LABEL, "use"],
        )
        for use in ("kv", "checkpoint", "free"):
            pages.add_metric([model, use], float(s.get(f"cache.pages_{use}", 0)))
        yield pages
        changes = CounterMetricFamily(
            PREFIX + "cache_page_conversions",
            "Pages that changed use, by the use they took.",
            labels=[MODEL_LABEL, "to"],
        )
        changes.add_metric([model, "kv"], float(s.get("cache.pages_to_kv", 0)))
        changes.add_metric([model, "checkpoint"], float(s.get("cache.pages_to_checkpoints", 0)))
        yield changes
    outcome = CounterMetricFamily(
        PREFIX + "engine_requests", "Engine requests by outcome.", labels=[MODEL_LABEL, "outcome"]
    )
    for label, key in (("finished", "requests.finished"), ("aborted", "requests.aborted"),
                       ("failed", "requests.failed")):  # fmt: skip
        outcome.add_metric([model, label], float(s.get(key, 0)))
    yield outcome  # fmt: skip


class Family:
    """A labelled family whose ``model_name`` is fixed: ``labels(...)`` takes the other labels."""

    def __init__(self, family: Counter, model_name: str) -> None:
        self._family = family
        self._model = model_name

    def labels(self, *values: str) -> Any:
        return self._family.labels(self._model, *values)


class ServerMetrics:
    """The server's metrics on a registry of its own, labelled with ``model_name``."""

    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        label = [MODEL_LABEL]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.request_success = Family(
            Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                    [MODEL_LABEL, "finished_reason"], registry=r),
            model_name,
        )  # fmt: skip
        self.http_errors = Family(
            Counter(
                PREFIX + "http_errors", "Error responses by HTTP status.", [MODEL_LABEL, "status"], registry=r
            ),
            model_name,
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects", "Clients that hung up before their response.", label, registry=r
        ).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request received to last token.", E2E_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Engine arrival to first admission (waiting).", TTFT_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First admission to first token (prefill).", TTFT_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token (decode).", E2E_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "A completion's mean time per output token after its first (decode time / (tokens - 1)).",
            ITL_BUCKETS,
        )
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        if stats is not None:
            r.register(EngineCollector(stats, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
