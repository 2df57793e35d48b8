"""Load-test metrics: pure functions over recorded request timelines. Torch-free.

Times in a ``RequestRecord`` are seconds since the start of the run. Definitions (the
usual serving-benchmark ones):

* TTFT — first output token received minus the time the request was sent;
* TPOT — (last token - first token) / (output tokens - 1), per request with >= 2 tokens;
* ITL — every gap between two consecutive output tokens of a request;
* E2E — last token (finish) minus the time the request was sent;
* throughput — completed requests, output tokens and prompt+output tokens per second of
  the run's duration (first send to last finish);
* prefix hit rate — sum of ``num_cached_tokens`` / sum of ``num_prompt_tokens``; per turn
  for multi-turn workloads;
* missed by cause — the engine's ``prefix_cache.miss_tokens.<cause>`` counters over the run
  (``cache/loss.py``) / its ``prefix_cache.query_tokens``: the query causes sum to one minus
  the engine hit rate; ``preemption`` (recomputed after a preemption) is outside that sum.

Percentiles interpolate linearly between closest ranks (numpy's default).

``format_table`` prints summaries side by side; ``format_legend`` (``TABLE_LEGEND``) the notes
loadgen prints under it, saying what each row measures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deltaserve.cache.loss import MISS_CAUSES, MISS_PREFIX


@dataclass
class RequestRecord:
    rid: str
    session: str = ""
    turn: int = 0
    branch: str = ""
    arrival_s: float = 0.0  # when the request became due (arrival / after think time)
    submit_s: float = 0.0  # when it was handed to the backend
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finish_s: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    prompt_hash: str = ""
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None and self.finish_reason in ("stop", "length")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# ---------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def distribution(values: Sequence[float]) -> dict[str, float]:
    return {
        "count": len(values),
        "mean": mean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": float(min(values)) if values else math.nan,
        "max": float(max(values)) if values else math.nan,
    }


# ---------------------------------------------------------------------------- per request
def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token_s is None else r.first_token_s - r.submit_s


def e2e(r: RequestRecord) -> float | None:
    return None if r.finish_s is None else r.finish_s - r.submit_s


def tpot(r: RequestRecord) -> float | None:
    if r.first_token_s is None or r.finish_s is None or r.num_output_tokens < 2:
        return None
    return (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    t = r.token_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def _present(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None]


def hit_rate(records: Iterable[RequestRecord]) -> float:
    rs = list(records)
    prompt = sum(r.num_prompt_tokens for r in rs)
    return sum(r.num_cached_tokens for r in rs) / prompt if prompt else 0.0


def hit_rate_per_turn(records: Iterable[RequestRecord]) -> dict[int, float]:
    by: dict[int, list[RequestRecord]] = {}
    for r in records:
        by.setdefault(r.turn, []).append(r)
    return {t: hit_rate(by[t]) for t in sorted(by)}


# ---------------------------------------------------------------------------- engine stats
#: engine stats that only grow (a run's share is after - before); the rest are gauges
COUNTER_PREFIXES = (
    "requests.",
    "tokens.",
    "steps.",
    "prefix_cache.",
    "checkpoints.",
    "kv.evicted",
    "scheduler.",
    "spec_decode.num_",
)
GAUGES = {
    "scheduler.running", "scheduler.waiting", "scheduler.oldest_waiting_s", "prefix_cache.hit_rate",
    "checkpoints.slots", "checkpoints.used_slots", "checkpoints.attached", "checkpoints.bytes_used",
    "scheduler.step_model.base_ms", "scheduler.step_model.prefill_us_per_token",
    "scheduler.decode_step_prefill_budget", "scheduler.decode_step_trim",
}  # fmt: skip


#: engine stats read from a server's Prometheus ``/metrics`` text: per stat, alternatives tried
#: in order (deltaserve, vLLM, llama.cpp); an alternative is a sum of series and applies only
#: when every one is present. A series is ``name`` or ``name{label=value,...}``; its value sums
#: every sample of that name whose labels include those given, so vLLM's ``engine`` and
#: ``model_name`` labels (one series per engine core and model) are summed over.
#: llama.cpp's ``prompt_tokens_total`` counts prompt tokens computed, excluding those from its
#: cache (``prompt_tokens_cached_total``): the two add up to the tokens looked up.
PROMETHEUS_STATS: dict[str, tuple[tuple[str, ...], ...]] = {
    "prefix_cache.query_tokens": (
        ("deltaserve:prefix_cache_queries_total",),
        ("vllm:prefix_cache_queries_total",),
        ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
    ),
    "prefix_cache.hit_tokens": (
        ("deltaserve:prefix_cache_hits_total",),
        ("vllm:prefix_cache_hits_total",),
        ("llamacpp:prompt_tokens_cached_total",),
    ),
    "scheduler.preemptions": (("deltaserve:num_preemptions_total",), ("vllm:num_preemptions_total",)),
    "tokens.computed": (("deltaserve:computed_tokens_total",),),
    "checkpoints.stored": (("deltaserve:checkpoints_stored_total",),),
    "checkpoints.evicted": (("deltaserve:checkpoints_evicted_total",),),
    "checkpoints.skipped_budget": (("deltaserve:checkpoints_skipped_total{reason=budget}",),),
    "checkpoints.skipped_pool": (("deltaserve:checkpoints_skipped_total{reason=pool}",),),
    "kv.usage": (("deltaserve:kv_cache_usage_perc",), ("vllm:kv_cache_usage_perc",)),
    **{
        f"spec_decode.{name}": (
            (f"deltaserve:spec_decode_{name}_total",),
            (f"vllm:spec_decode_{name}_total",),
        )
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    },
    **{
        MISS_PREFIX + cause: ((f"deltaserve:prefix_cache_miss_tokens_total{{cause={cause}}}",),)
        for cause in MISS_CAUSES
    },
}


def prometheus_stats(text: str) -> dict[str, float]:
    """Engine stats (``PROMETHEUS_STATS`` names) from Prometheus exposition text, with
    ``prefix_cache.hit_rate`` when both token counters are there; {} for text that does not
    parse (prometheus_client's parser raises ``ValueError`` on it)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[tuple[str, dict[str, str], float]] = []
    try:
        for fam in text_string_to_metric_families(text):
            samples += [(s.name, dict(s.labels), float(s.value)) for s in fam.samples]
    except ValueError:
        return {}
    out: dict[str, float] = {}
    for key, alternatives in PROMETHEUS_STATS.items():
        for series in alternatives:
            values = [_series_sum(samples, spec) for spec in series]
            if all(v is not None for v in values):
                out[key] = math.fsum(v for v in values if v is not None)
                break
    if "prefix_cache.query_tokens" in out and "prefix_cache.hit_tokens" in out:
        q = out["prefix_cache.query_tokens"]
        out["prefix_cache.hit_rate"] = out["prefix_cache.hit_tokens"] / q if q else 0.0
    return out


def _series_sum(samples: Sequence[tuple[str, dict[str, str], float]], spec: str) -> float | None:
    """The sum of the samples ``spec`` (``name`` or ``name{k=v,...}``) selects; None if none."""
    name, _, rest = spec.partition("{")
    wanted = dict(item.split("=", 1) for item in rest.rstrip("}").split(",") if item)
    picked = [v for n, labels, v in samples if n == name and wanted.items() <= labels.items()]
    return math.fsum(picked) if picked else None


def stats_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """``after`` with its counters made relative to ``before`` (a warm-up's share removed)."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        if (
            k in before
            and k not in GAUGES
            and k.startswith(COUNTER_PREFIXES)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        ):
            out[k] = v - before[k]
        else:
            out[k] = v
    q = out.get("prefix_cache.query_tokens")
    if q is not None and "prefix_cache.hit_tokens" in out:
        out["prefix_cache.hit_rate"] = out["prefix_cache.hit_tokens"] / q if q else 0.0
    return out


def spec_summary(es: Mapping[str, Any]) -> dict[str, float | None]:
    """Speculative decoding over a run: accepted / drafted tokens, and tokens emitted per verify
    window (accepted + 1 each); None where the engine reports no speculation."""
    drafts, drafted = es.get("spec_decode.num_drafts"), es.get("spec_decode.num_draft_tokens")
    accepted = es.get("spec_decode.num_accepted_tokens")
    if not drafts or drafted is None or accepted is None:
        return {"acceptance_rate": None, "tokens_per_verify": None}
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verify": 1.0 + accepted / drafts,
    }


# ---------------------------------------------------------------------------- summary
def summarize(
    records: Sequence[RequestRecord],
    engine_stats: Mapping[str, Any] | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    if duration_s is None:
        starts = [r.submit_s for r in records]
        ends = [r.finish_s for r in records if r.finish_s is not None]
        duration_s = (max(ends) - min(starts)) if starts and ends else 0.0
    out_tok = sum(r.num_output_tokens for r in ok)
    prompt_tok = sum(r.num_prompt_tokens for r in ok)
    per_sec = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    s: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": per_sec(len(ok)),
        "output_throughput": per_sec(out_tok),
        "total_throughput": per_sec(out_tok + prompt_tok),
        "prompt_tokens": prompt_tok,
        "output_tokens": out_tok,
        "cached_tokens": sum(r.num_cached_tokens for r in ok),
        "ttft_s": distribution(_present(ttft(r) for r in ok)),
        "tpot_s": distribution(_present(tpot(r) for r in ok)),
        "itl_s": distribution([x for r in ok for x in itls(r)]),
        "e2e_s": distribution(_present(e2e(r) for r in ok)),
        "prefix_hit_rate": hit_rate(ok),
        "hit_rate_per_turn": {str(t): v for t, v in hit_rate_per_turn(ok).items()},
    }
    s.update(_engine_summary(engine_stats or {}))
    return s


def _engine_summary(es: Mapping[str, Any]) -> dict[str, Any]:
    """The engine counters a summary shows (None where the backend does not report one)."""
    skipped = [es.get("checkpoints.skipped_budget"), es.get("checkpoints.skipped_pool")]
    return {
        "engine_hit_rate": es.get("prefix_cache.hit_rate"),
        "checkpoints": {
            "stored": es.get("checkpoints.stored"),
            "skipped": sum(x for x in skipped if x is not None)
            if any(x is not None for x in skipped)
            else None,
            "skipped_budget": skipped[0],
            "skipped_pool": skipped[1],
            "evicted": es.get("checkpoints.evicted"),
            "restored": es.get("checkpoints.restored"),
            "bytes_used": es.get("checkpoints.bytes_used"),
        },
        "preemptions": es.get("scheduler.preemptions"),
        "kv_evicted_blocks": es.get("kv.evicted_blocks"),
        "missed": _missed(es),
        "spec_decode": spec_summary(es),
    }


#: the table's miss rows: (summary key under ``missed``, label, the engine's causes summed)
MISS_ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    ("cold", "missed: cold", ("cold",)),
    ("kv_evicted_device", "missed: KV evicted (device)", ("kv_evicted_device",)),
    ("kv_evicted_host", "missed: KV evicted (host)", ("kv_evicted_host",)),
    ("kv_evicted_disk", "missed: KV evicted (disk)", ("kv_evicted_disk",)),
    ("checkpoint_never_captured", "missed: checkpoint never captured", ("checkpoint_never_captured",)),
    ("checkpoint_skipped", "missed: checkpoint skipped", ("checkpoint_skipped",)),
    ("checkpoint_evicted", "missed: checkpoint evicted", ("checkpoint_evicted",)),
    ("granularity", "missed: granularity", ("granularity",)),
    ("in_flight", "missed: in flight", ("in_flight",)),
    ("given_up", "missed: disk hit given up", ("read_budget", "disk_wait", "remote_wait")),
    ("prompt_logprobs", "missed: prompt logprobs", ("prompt_logprobs",)),
    ("preemption", "recomputed after preemption", ("preemption",)),
]


def _missed(es: Mapping[str, Any]) -> dict[str, float | None]:
    """Per ``MISS_ROWS`` key, its tokens / the prompt tokens looked up (None: not reported)."""
    q = es.get("prefix_cache.query_tokens")
    out: dict[str, float | None] = {}
    for key, _, causes in MISS_ROWS:
        values = [es.get(MISS_PREFIX + c) for c in causes]
        known = [v for v in values if v is not None]
        out[key] = math.fsum(known) / q if known and q else None
    return out


# ---------------------------------------------------------------------------- table
#: (label, path into the summary, unit) ; path "a.b" walks nested dicts
TABLE_ROWS: list[tuple[str, str, str]] = [
    ("requests completed", "completed", "n"),
    ("requests failed", "failed", "n"),
    ("duration (s)", "duration_s", "s"),
    ("requests/s", "request_throughput", "rate"),
    ("output tokens/s", "output_throughput", "rate"),
    ("total tokens/s", "total_throughput", "rate"),
    ("TTFT mean (ms)", "ttft_s.mean", "ms"),
    ("TTFT p50 (ms)", "ttft_s.p50", "ms"),
    ("TTFT p90 (ms)", "ttft_s.p90", "ms"),
    ("TTFT p99 (ms)", "ttft_s.p99", "ms"),
    ("TPOT mean (ms)", "tpot_s.mean", "ms"),
    ("TPOT p50 (ms)", "tpot_s.p50", "ms"),
    ("TPOT p90 (ms)", "tpot_s.p90", "ms"),
    ("TPOT p99 (ms)", "tpot_s.p99", "ms"),
    ("ITL mean (ms)", "itl_s.mean", "ms"),
    ("ITL p50 (ms)", "itl_s.p50", "ms"),
    ("ITL p90 (ms)", "itl_s.p90", "ms"),
    ("ITL p99 (ms)", "itl_s.p99", "ms"),
    ("E2E mean (ms)", "e2e_s.mean", "ms"),
    ("E2E p50 (ms)", "e2e_s.p50", "ms"),
    ("E2E p90 (ms)", "e2e_s.p90", "ms"),
    ("E2E p99 (ms)", "e2e_s.p99", "ms"),
    ("prompt tokens", "prompt_tokens", "n"),
    ("output tokens", "output_tokens", "n"),
    ("prefix hit rate (requests)", "prefix_hit_rate", "pct"),
    ("prefix hit rate (engine)", "engine_hit_rate", "pct"),
    ("checkpoints stored", "checkpoints.stored", "n"),
    ("checkpoints skipped", "checkpoints.skipped", "n"),
    ("checkpoints evicted", "checkpoints.evicted", "n"),
    ("KV blocks evicted", "kv_evicted_blocks", "n"),
    ("preemptions", "preemptions", "n"),
]


#: what the table's rows mean, printed under it: (key, note); a row is explained by the key one
#: of whose " / " parts its label contains (README.md's loadgen section repeats the keys)
TABLE_LEGEND: list[tuple[str, str]] = [
    ("requests completed / failed", "requests that finished / ended in an error (latency, token and "
     "requests' hit-rate rows count completed requests only)"),
    ("duration (s) / requests/s / tokens/s", "first send to last finish; the rates are per second "
     "of it (total = prompt + output tokens)"),
    ("prompt tokens / output tokens", "summed over the completed requests"),
    ("TTFT", "time to first token: send to the first output token"),
    ("TPOT", "per request, (last token - first token) / (output tokens - 1); requests of >= 2 tokens"),
    ("ITL", "every gap between two consecutive output tokens (over gaps, not requests)"),
    ("E2E", "send to the last token"),
    ("spec decode acceptance / tokens per verify", "speculative decoding (rows shown when the engine reports it): "
     "accepted / drafted tokens, and tokens emitted per verify window (accepted + 1), warm-up removed"),
    ("prefix hit rate (requests)", "cached / prompt tokens summed over the completed requests, as the "
     "backend reported each one (RequestOutput.num_cached_tokens; usage.prompt_tokens_details over HTTP)"),
    ("prefix hit rate (engine)", "the engine's own counters over the run, warm-up removed: hit / looked-up "
     "prompt tokens of every request it admitted (failed and aborted too); over HTTP read from the "
     "server's /metrics (deltaserve, vLLM, llama-server); - where the backend has none"),
    ("missed: / recomputed after preemption", "the engine's prompt tokens not served from its cache, "
     "by cause (cache/loss.py; docs/cache.md \"Where the hits went\"), as a share of those looked up, warm-up "
     "removed; over HTTP from deltaserve's /metrics. The missed rows sum to 100% - the engine hit rate; "
     "recomputed after preemption is outside that sum. Rows without tokens are left out"),
    ("hit rate turn N", "the requests' hit rate over turn N only (multi-turn workloads; turn 0 is each "
     "conversation's first message, cold unless it shares a prefix)"),
    ("checkpoints stored / skipped / evicted", "GDN state checkpoints the engine captured / did not "
     "capture for lack of a staging budget or a slot / evicted during the run"),
    ("KV blocks evicted", "cached KV blocks evicted during the run"),
    ("preemptions", "running requests freed and recomputed later for lack of cache memory"),
    ("same prompts / outputs as first", "requests whose prompt / output tokens equal the first column's "
     "(the columns ran the identical workload; greedy outputs should agree)"),
    ("/first column", "this column divided by the first (throughputs and latencies; blank for rates)"),
]  # fmt: skip


def format_legend(columns: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> str:
    """The notes of the rows ``format_table(columns)`` shows (per-turn and column-comparison
    notes only where the table has them), wrapped under a ``rows:`` line."""
    import textwrap

    multi = len(columns) > 1
    shown = [
        (label, note)
        for label, note in TABLE_LEGEND
        if (label != "hit rate turn N" or _turn_rows(columns) or not columns)
        and (not label.startswith("missed:") or _miss_rows(columns) or not columns)
        and (label not in ("same prompts / outputs as first", "/first column") or multi or not columns)
        and (
            not label.startswith("spec decode")
            or any(lookup(c, "spec_decode.acceptance_rate") is not None for _, c in columns)
            or not columns
        )
    ]
    width = max(len(label) for label, _ in shown)
    lines = ["rows:"]
    for label, note in shown:
        wrapped = textwrap.wrap(note, width=max(40, 100 - width)) or [""]
        lines.append(f"  {label.ljust(width)}  {wrapped[0]}")
        lines += [f"  {'':{width}}  {more}" for more in wrapped[1:]]
    return "\n".join(lines)


def lookup(summary: Mapping[str, Any], path: str) -> Any:
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _fmt(value: Any, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "pct":
        return f"{value * 100:.1f}%"
    if unit in ("rate", "s"):
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool):
        return ""
    if math.isnan(a) or math.isnan(b) or a == 0:
        return ""
    return f"{b / a:.2f}x"


def format_table(
    columns: Sequence[tuple[str, Mapping[str, Any]]], extra_rows: Sequence[tuple[str, list[str]]] = ()
) -> str:
    """Summaries side by side; every column after the first gets a ratio to the first."""
    rows: list[tuple[str, str, str]] = list(TABLE_ROWS) + _turn_rows(columns)
    at = next(i for i, (_, path, _) in enumerate(rows) if path == "engine_hit_rate") + 1
    rows[at:at] = _miss_rows(columns)  # under the engine hit rate they complete
    if any(lookup(s, "spec_decode.acceptance_rate") is not None for _, s in columns):
        rows += [
            ("spec decode acceptance", "spec_decode.acceptance_rate", "pct"),
            ("tokens per verify", "spec_decode.tokens_per_verify", "rate"),
        ]
    header = ["metric"]
    for i, (label, _) in enumerate(columns):
        header.append(label)
        if i > 0:
            header.append(f"/{columns[0][0]}")
    table: list[list[str]] = [header]
    for label, path, unit in rows:
        line = [label]
        base = lookup(columns[0][1], path) if columns else None
        for i, (_, s) in enumerate(columns):
            v = lookup(s, path)
            line.append(_fmt(v, unit))
            if i > 0:
                line.append(_ratio(base, v) if unit != "pct" else "")
        table.append(line)
    for label, values in extra_rows:
        line = [label]
        for i, v in enumerate(values):
            line.append(v)
            if i > 0:
                line.append("")
        table.append(line)
    return _render(table)


def _turn_rows(columns: Sequence[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, str, str]]:
    """A hit-rate row per turn seen in any column (none for single-turn workloads)."""
    turns: list[str] = []
    for _, s in columns:
        for t in s.get("hit_rate_per_turn") or {}:
            if t not in turns:
                turns.append(t)
    if len(turns) <= 1:
        return []
    return [(f"hit rate turn {t}", f"hit_rate_per_turn.{t}", "pct") for t in sorted(turns, key=int)]


def _miss_rows(columns: Sequence[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, str, str]]:
    """A row per miss cause some column has tokens of (none for backends without the counters)."""
    return [
        (label, f"missed.{key}", "pct")
        for key, label, _ in MISS_ROWS
        if any(lookup(s, f"missed.{key}") for _, s in columns)
    ]


def _render(table: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header."""
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = []
    for n, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [row[c].rjust(widths[c]) for c in range(1, len(row))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
