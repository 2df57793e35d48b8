#!/usr/bin/env python
"""Load generator: realistic workloads against the engine, side by side with baselines.

    python tools/loadgen.py                                    # chat workload, built-in model
    python tools/loadgen.py --workload shared-prefix --rate 4 --json out.json --plot out.png
    python tools/loadgen.py --workload random --baseline hf    # vs transformers generate
    python tools/loadgen.py --compare base cache.enable_prefix_caching=false scheduler.policy=lpm
    python tools/loadgen.py --compare a.toml b.toml --set model.device=cuda
    python tools/loadgen.py --backend engine openai --base-url http://127.0.0.1:8000   # server overhead
    python tools/loadgen.py --backend openai --base-url http://host:8000 --tokenizer /models/Qwen3.5-4B  # vLLM, SGLang

Workloads (``tools/workloads/``) are deterministic under ``--seed``; multi-turn ones
(chat, agent) build each next prompt from the reply the backend actually generated.
Arrivals: ``--rate`` (Poisson, open loop) or ``--concurrency`` (closed loop of sessions).

Columns: the engine (or one per ``--compare`` entry: a config file, ``base`` for
``--config``/``--set`` as given, or ``key=value[,key=value]`` overrides on top of base;
a fresh engine each, the identical workload), then ``--backend openai``: the same
requests over HTTP to any OpenAI-compatible server (``deltaserve serve``, vLLM, SGLang;
token-id prompts on ``/v1/completions``, TTFT/ITL from SSE arrival times, cached tokens from
``usage``), then ``--baseline hf``: the same requests
through transformers ``generate``, greedy, one at a time (an application without a
serving engine). Ratios are against the first column. Everything goes to ``--json``;
``--plot`` draws latency distributions and hit rate per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.logs import get_logger
from deltaserve.tools.metrics import RequestRecord, format_table, stats_delta, summarize
from deltaserve.tools.workloads import (
    HFCodec,
    RequestSpec,
    Workload,
    add_workload_args,
    arrival_from_args,
    make_workload,
    params_from_args,
    plan_arrivals,
)

log = get_logger("deltaserve.loadgen")


# ============================================================================ backends
@dataclass
class Delta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True
    seed: int | None = None


class EngineBackend:
    """``AsyncEngine`` over one ``EngineCore``."""

    kind = "engine"

    def __init__(self, core: Any, sampling: Sampling) -> None:
        from deltaserve.engine import AsyncEngine

        self.core = core
        self.sampling = sampling
        self.engine = AsyncEngine(core=core)

    @property
    def model_path(self) -> str:
        return str(self.core.loaded.path)

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.shutdown()

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        from deltaserve.engine import SamplingParams

        params = SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            ignore_eos=self.sampling.ignore_eos,
            seed=self.sampling.seed,
        )
        salt = spec.meta.get("cache_salt")
        async for o in self.engine.generate(
            list(spec.prompt_ids), params, request_id=spec.rid, cache_salt=salt
        ):
            yield Delta(
                token_ids=list(o.token_ids),
                finished=o.finished,
                finish_reason=o.finish_reason,
                num_prompt_tokens=o.num_prompt_tokens,
                num_cached_tokens=o.num_cached_tokens,
                error=o.error,
            )

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model_path, "config": self.core.config.to_dict()}


class OpenAIBackend:
    """Any OpenAI-compatible server (deltaserve serve, vLLM, SGLang, ...) over HTTP.

    Each request is a streamed ``POST /v1/completions`` whose ``prompt`` is the workload's
    token ids (the same prompts every backend gets; the server must use the same tokenizer),
    with ``stream_options.include_usage`` and the extras ``ignore_eos`` and
    ``return_token_ids`` (vLLM's names; deltaserve has both). TTFT and ITL are taken from SSE
    arrival times; prompt and cached tokens from the final ``usage``
    (``prompt_tokens_details.cached_tokens``). A server that does not return token ids gets its
    text re-encoded with the workload's tokenizer (token counts then approximate). Engine
    counters are read from ``/metrics`` when it exposes ``deltaserve:`` (or ``vllm:``) ones.
    """

    kind = "openai"

    def __init__(
        self, base_url: str, sampling: Sampling, *, model: str | None = None, codec: Any = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.sampling = sampling
        self.model = model
        self.codec = codec
        self._client: Any = None
        self._last_stats: dict[str, Any] = {}

    @property
    def model_path(self) -> str:
        return self.model or ""

    async def start(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(600.0), limits=limits)
        if self.model is None:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]

    async def refresh_stats(self) -> None:
        self._last_stats = await self._scrape()

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(spec.prompt_ids),
            "max_tokens": spec.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.sampling.ignore_eos,
            "return_token_ids": True,
        }
        if self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        if spec.meta.get("cache_salt"):
            body["cache_salt"] = spec.meta["cache_salt"]
        n_prompt = len(spec.prompt_ids)
        reason: str | None = None
        async with self._client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:500]
                raise RuntimeError(f"HTTP {resp.status_code}: {message}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error mid-stream: {chunk['error'].get('message')}")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    yield Delta(
                        [], finished=True, finish_reason=reason or "length",
                        num_prompt_tokens=usage.get("prompt_tokens") or n_prompt,
                        num_cached_tokens=details.get("cached_tokens") or 0,
                    )  # fmt: skip
                    return
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    if ids is None:
                        text = choice.get("text") or ""
                        ids = (
                            self.codec.encode(text)
                            if (text and self.codec is not None)
                            else ([0] if text else [])
                        )
                    reason = choice.get("finish_reason") or reason
                    if ids:
                        yield Delta(list(ids), num_prompt_tokens=n_prompt)
        yield Delta([], finished=True, finish_reason=reason or "length", num_prompt_tokens=n_prompt)

    async def _scrape(self) -> dict[str, Any]:
        """Engine counters from ``/metrics`` under the stats names the summary uses ({} if none)."""
        try:
            resp = await self._client.get("/metrics")
            if resp.status_code != 200:
                return {}
            from prometheus_client.parser import text_string_to_metric_families

            values: dict[str, float] = {}
            for fam in text_string_to_metric_families(resp.text):
                for sample in fam.samples:
                    label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    values[sample.name + (f"{{{label}}}" if label else "")] = sample.value
        except Exception:  # no metrics endpoint, or not Prometheus text
            return {}
        out: dict[str, Any] = {}
        for key, names in _METRIC_STATS.items():
            for name in names:
                if name in values:
                    out[key] = values[name]
                    break
        if "prefix_cache.query_tokens" in out and "prefix_cache.hit_tokens" in out:
            q = out["prefix_cache.query_tokens"]
            out["prefix_cache.hit_rate"] = out["prefix_cache.hit_tokens"] / q if q else 0.0
        return out

    def stats(self) -> dict[str, Any]:
        return dict(self._last_stats)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "base_url": self.base_url, "model": self.model}


# stats key -> metric names (deltaserve's, then vLLM's) a server's /metrics may expose
_METRIC_STATS = {
    "prefix_cache.query_tokens": ("deltaserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "prefix_cache.hit_tokens": ("deltaserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "scheduler.preemptions": ("deltaserve:num_preemptions_total", "vllm:num_preemptions_total"),
    "tokens.computed": ("deltaserve:computed_tokens_total",),
    "checkpoints.stored": ("deltaserve:checkpoints_stored_total",),
    "checkpoints.evicted": ("deltaserve:checkpoints_evicted_total",),
    "checkpoints.skipped_budget": ("deltaserve:checkpoints_skipped_total{reason=budget}",),
    "checkpoints.skipped_pool": ("deltaserve:checkpoints_skipped_total{reason=pool}",),
    "kv.usage": ("deltaserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
}


class HFBackend:
    """transformers ``generate``: one request at a time, no batching, no prefix cache."""

    kind = "hf"

    def __init__(
        self, model_path: str, sampling: Sampling, *, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.path = model_path
        self.device = device
        from deltaserve.engine.core import resolve_dtype  # the engine's one dtype table

        torch_dtype = resolve_dtype(dtype, torch.device(device))
        self.dtype = str(torch_dtype).removeprefix("torch.")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
        self.sampling = sampling
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self._lock: asyncio.Lock | None = None
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @property
    def model_path(self) -> str:
        return self.path

    async def start(self) -> None:
        self._lock = asyncio.Lock()

    async def stop(self) -> None:
        self._executor.shutdown(wait=True)

    def _generate(self, spec: RequestSpec, put: Any) -> None:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch

        class Streamer(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # the first call carries the prompt
                    self.prompt_seen = True
                    return
                put(value.reshape(-1).tolist())

            def end(self) -> None:
                pass

        ids = torch.tensor([list(spec.prompt_ids)], device=self.device)
        kwargs: dict[str, Any] = {"max_new_tokens": spec.max_tokens, "pad_token_id": 0, "min_new_tokens": 0}
        if self.sampling.ignore_eos:
            kwargs["eos_token_id"] = None
        if self.sampling.temperature > 0:
            if self.sampling.seed is not None:
                torch.manual_seed(self.sampling.seed)
            kwargs.update(
                do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=0
            )
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=Streamer(), **kwargs)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Delta]:
        assert self._lock is not None, "backend not started"
        async with self._lock:  # one request at a time, in arrival order
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[list[int]] = asyncio.Queue()

            def put(tokens: list[int]) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, tokens)

            fut = loop.run_in_executor(self._executor, self._generate, spec, put)
            n = 0
            reason = "length"
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    tokens = getter.result()
                    n += len(tokens)
                    if not self.sampling.ignore_eos and any(t in self.eos_ids for t in tokens):
                        reason = "stop"
                    yield Delta(tokens, num_prompt_tokens=len(spec.prompt_ids))
                    continue
                getter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await getter
                while not queue.empty():
                    tokens = queue.get_nowait()
                    n += len(tokens)
                    yield Delta(tokens, num_prompt_tokens=len(spec.prompt_ids))
                break
            err = fut.exception()
            yield Delta(
                [],
                finished=True,
                finish_reason="error" if err else reason,
                num_prompt_tokens=len(spec.prompt_ids),
                error=f"{type(err).__name__}: {err}" if err else None,
            )

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.path, "device": self.device, "dtype": self.dtype}


# ============================================================================ driver
@dataclass
class RunResult:
    label: str
    backend: dict[str, Any]
    records: list[RequestRecord]
    summary: dict[str, Any]
    engine_stats: dict[str, Any]
    engine_stats_total: dict[str, Any]
    arrivals: dict[str, Any]
    wall_s: float


async def _warmup(backend: Any, n: int, prompt_len: int) -> None:
    """``n`` concurrent requests of the workload's prompt length, not measured. Each has
    its own cache salt, so nothing it caches can ever be hit by the workload."""

    async def one(i: int) -> None:
        spec = RequestSpec(
            rid=f"warmup-{i}",
            prompt_ids=[0] * prompt_len,
            max_tokens=8,
            meta={"cache_salt": f"loadgen-warmup-{i}"},
        )
        async for _ in backend.stream(spec):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))


async def run_live(
    backend: Any,
    workload: Workload,
    arrival_plan: dict[str, Any],
    *,
    label: str,
    progress: bool = True,
    warmup: int = 2,
) -> RunResult:
    """Send the workload through ``backend``; one ``RequestRecord`` per request."""
    from tqdm import tqdm

    await backend.start()
    try:
        roots = workload.roots()
        await _warmup(backend, warmup, min(max((len(r.prompt_ids) for r in roots), default=16), 1024))
        refresh = getattr(backend, "refresh_stats", None)  # a remote server: scrape its counters now
        if refresh is not None:
            await refresh()
        stats_before = backend.stats()
        records: list[RequestRecord] = []
        bar = tqdm(
            total=workload.expected_requests(), desc=label, unit="req", disable=not progress, leave=False
        )
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        async def run_one(spec: RequestSpec, due: float) -> RequestRecord:
            rec = RequestRecord(
                rid=spec.rid, session=spec.session, turn=spec.turn, branch=spec.branch, arrival_s=due,
                submit_s=now(), num_prompt_tokens=len(spec.prompt_ids), max_tokens=spec.max_tokens,
                prompt_hash=spec.describe()["prompt_hash"],
            )  # fmt: skip
            try:
                async for d in backend.stream(spec):
                    t = now()
                    if d.token_ids:
                        if rec.first_token_s is None:
                            rec.first_token_s = t
                        rec.token_times.extend([t] * len(d.token_ids))
                        rec.output_token_ids.extend(d.token_ids)
                    rec.num_prompt_tokens = d.num_prompt_tokens or rec.num_prompt_tokens
                    rec.num_cached_tokens = d.num_cached_tokens
                    if d.finished:
                        rec.finish_s = t
                        rec.finish_reason = d.finish_reason
                        rec.error = d.error
            except Exception as e:  # typed engine errors (too long, overloaded, ...)
                rec.error = f"{type(e).__name__}: {e}"
                rec.finish_reason = "error"
                log.warning("loadgen.request_failed", rid=spec.rid, error=rec.error)
            rec.num_output_tokens = len(rec.output_token_ids)
            records.append(rec)
            bar.update(1)
            done = [r for r in records if r.ok]
            if done:
                hit = sum(r.num_cached_tokens for r in done) / max(sum(r.num_prompt_tokens for r in done), 1)
                bar.set_postfix(hit=f"{hit:.0%}", refresh=False)
            return rec

        async def run_tree(spec: RequestSpec, due: float) -> None:
            rec = await run_one(spec, due)
            if not rec.ok:
                return
            children = workload.follow_ups(spec, rec.output_token_ids)
            await asyncio.gather(*(after_delay(c) for c in children))

        async def after_delay(child: RequestSpec) -> None:
            if child.delay_s > 0:
                await asyncio.sleep(child.delay_s)
            await run_tree(child, now())

        if arrival_plan["mode"] == "closed":
            sem = asyncio.Semaphore(int(arrival_plan["concurrency"]))

            async def session(root: RequestSpec) -> None:
                async with sem:
                    await run_tree(root, now())

            await asyncio.gather(*(session(r) for r in roots))
        else:

            async def timed(root: RequestSpec, at: float) -> None:
                delay = at - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                await run_tree(root, at)

            await asyncio.gather(*(timed(r, t) for r, t in zip(roots, arrival_plan["times"], strict=True)))
        wall = now()
        bar.close()
        if refresh is not None:
            await refresh()
        stats_after = backend.stats()
    finally:
        await backend.stop()
    engine_stats = stats_delta(stats_before, stats_after) if stats_after else {}
    records.sort(key=lambda r: (r.submit_s, r.rid))
    summary = summarize(records, engine_stats or None)
    log.info(
        "loadgen.run_done",
        label=label,
        requests=len(records),
        wall_s=round(wall, 2),
        out_tok_s=round(summary["output_throughput"], 1),
        hit_rate=round(summary["prefix_hit_rate"], 3),
    )
    return RunResult(
        label=label,
        backend=backend.describe(),
        records=records,
        summary=summary,
        engine_stats=engine_stats,
        engine_stats_total=dict(stats_after),
        arrivals=dict(arrival_plan),
        wall_s=wall,
    )


# ============================================================================ configs
def compare_configs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(label, EngineConfig) per column: ``--compare`` entries, else the base config."""
    from deltaserve.engine.cli import config_from_args
    from deltaserve.engine.config import EngineConfig, parse_override

    base_overrides = dict(parse_override(s) for s in args.set)
    if not args.compare:
        return [("engine", config_from_args(args))]
    out: list[tuple[str, Any]] = []
    for entry in args.compare:
        if entry in ("base", "-"):
            label, cfg = "base", config_from_args(args)
        elif Path(entry).suffix.lower() in (".toml", ".json", ".yaml", ".yml") or Path(entry).is_file():
            label, cfg = Path(entry).stem, EngineConfig.load(entry, base_overrides)
        elif "=" in entry:
            extra = dict(parse_override(s) for s in entry.split(","))
            label, cfg = entry, EngineConfig.load(args.config, {**base_overrides, **extra})
        else:
            raise SystemExit(f"--compare {entry!r}: not a config file, 'base', or key=value overrides")
        labels = [lbl for lbl, _ in out]
        if label in labels:
            label = f"{label}#{len(out) + 1}"
        out.append((label, cfg))
    return out


# ============================================================================ output
def workload_line(workload: Workload, plan: dict[str, Any]) -> str:
    p = workload.describe()
    keys = ("sessions", "turns", "num_requests", "prefix_len", "prompt_len", "output_len", "tool_len",
            "num_prefixes", "suffixes_per_prefix", "branches", "think_time")  # fmt: skip
    parts = [
        f"{k}={p[k]}" for k in keys if p.get(k) is not None and (k != "think_time" or workload.multi_turn)
    ]
    arr = plan["mode"] + (f" rate={plan['rate']}/s" if plan.get("rate") else "")
    arr += f" concurrency={plan['concurrency']}" if plan.get("concurrency") else ""
    return f"workload {workload.name} ({', '.join(parts)}; {p['expected_requests']} requests; {arr}; seed={workload.seed})"


def agreement_rows(runs: Sequence[RunResult]) -> list[tuple[str, list[str]]]:
    """Did every column send the same prompts and get the same outputs as the first?"""
    if len(runs) < 2:
        return []
    first_p = {r.rid: r.prompt_hash for r in runs[0].records}
    first_o = {r.rid: r.output_token_ids for r in runs[0].records}
    prompts, outputs = ["ref"], ["ref"]
    for run in runs[1:]:
        same_p = sum(1 for r in run.records if first_p.get(r.rid) == r.prompt_hash)
        same_o = sum(1 for r in run.records if first_o.get(r.rid) == r.output_token_ids)
        prompts.append(f"{same_p}/{len(run.records)}")
        outputs.append(f"{same_o}/{len(run.records)}")
    return [("same prompts as first", prompts), ("same outputs as first", outputs)]


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str, args: argparse.Namespace, workload: Workload, runs: Sequence[RunResult]) -> None:
    first = runs[0].summary
    ratios = {}
    for run in runs[1:]:
        ratios[run.label] = {
            k: (run.summary[k] / first[k] if isinstance(first.get(k), (int, float)) and first[k] else None)
            for k in ("request_throughput", "output_throughput", "total_throughput")
        } | {
            f"{k}.{q}": (
                run.summary[k][q] / first[k][q] if first[k][q] and not math.isnan(first[k][q]) else None
            )
            for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")
            for q in ("mean", "p50", "p90", "p99")
        }
    doc = {
        "tool": "deltaserve.loadgen",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:] if args.argv is None else args.argv,
        "workload": {"name": workload.name, "params": workload.describe()},
        "arrivals": runs[0].arrivals,
        "runs": [
            {
                "label": run.label,
                "backend": run.backend["kind"],
                "model": run.backend.get("model"),
                "config": run.backend.get("config", {k: v for k, v in run.backend.items() if k != "kind"}),
                "wall_s": run.wall_s,
                "summary": run.summary,
                "engine_stats": run.engine_stats,
                "engine_stats_total": run.engine_stats_total,
                "records": [r.to_dict() for r in run.records],
            }
            for run in runs
        ],
        "comparison": {
            "reference": runs[0].label,
            "ratios": ratios,
            "agreement": dict(agreement_rows(runs)),
        },  # fmt: skip
    }
    Path(path).write_text(json.dumps(_clean(doc), indent=1))


def plot(path: str, runs: Sequence[RunResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deltaserve.tools.metrics import e2e, itls, tpot, ttft

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    panels = [
        ("TTFT (ms)", lambda rs: [ttft(r) for r in rs]),
        ("TPOT (ms)", lambda rs: [tpot(r) for r in rs]),
        ("inter-token latency (ms)", lambda rs: [x for r in rs for x in itls(r)]),
        ("end-to-end latency (ms)", lambda rs: [e2e(r) for r in rs]),
    ]
    for ax, (name, get) in zip(axes.flat, panels, strict=False):
        for run in runs:
            xs = sorted(1000 * x for x in get([r for r in run.records if r.ok]) if x is not None)
            if xs:
                ax.plot(
                    xs, [(i + 1) / len(xs) for i in range(len(xs))], label=run.label, drawstyle="steps-post"
                )
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if "inter" not in name else "fraction of gaps")
        ax.set_title(f"{name.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[4]
    turns = sorted({int(t) for run in runs for t in run.summary["hit_rate_per_turn"]})
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        hr = run.summary["hit_rate_per_turn"]
        ax.bar(
            [t + i * width for t in turns], [100 * hr.get(str(t), 0.0) for t in turns], width, label=run.label
        )
    ax.set_xticks([t + width * (len(runs) - 1) / 2 for t in turns], [str(t) for t in turns])
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("prefix hit rate per turn")
    ax.legend(fontsize=8)
    ax = axes.flat[5]
    for run in runs:
        rs = sorted((r for r in run.records if r.ok), key=lambda r: r.submit_s)
        ax.scatter([r.submit_s for r in rs], [1000 * (ttft(r) or 0) for r in rs], s=10, label=run.label)
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over the run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main
def build_parser() -> argparse.ArgumentParser:
    from deltaserve.engine.cli import add_config_args

    parser = argparse.ArgumentParser(
        prog="loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_args(parser)
    add_workload_args(parser)
    g = parser.add_argument_group("runs")
    g.add_argument(
        "--backend", nargs="+", choices=["engine", "openai"], default=["engine"],
        help="columns: the in-process engine (default) and/or an OpenAI-compatible server at --base-url",
    )  # fmt: skip
    g.add_argument(
        "--base-url", metavar="URL", help="--backend openai: the server, e.g. http://127.0.0.1:8000"
    )
    g.add_argument(
        "--model",
        metavar="NAME",
        help="--backend openai: the model name to send (default: the first of /v1/models)",
    )
    g.add_argument(
        "--tokenizer", metavar="PATH",
        help="--backend openai: the tokenizer that builds the workload (default: the config's model.path)",
    )  # fmt: skip
    g.add_argument("--baseline", choices=["hf"], help="also run the requests through transformers generate")
    g.add_argument(
        "--compare", nargs="+", metavar="CONFIG",
        help="one column per entry: a config file, 'base', or key=value[,key=value] overrides of base",
    )  # fmt: skip
    g.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="concurrent warm-up requests per column, not measured (default 2)",
    )
    s = parser.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="generate exactly --output-len tokens (default; the built-in model has random weights)",
    )  # fmt: skip
    o = parser.add_argument_group("output")
    o.add_argument(
        "--json", metavar="FILE", help="write config, workload, per-request records, summaries, stats"
    )
    o.add_argument("--plot", metavar="FILE.png", help="latency distributions and hit rate per turn")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--log-level", default="info", help="structlog level (default %(default)s)")
    parser.set_defaults(argv=None)
    return parser


async def amain(args: argparse.Namespace) -> list[RunResult]:
    from deltaserve.engine import EngineCore

    sampling = Sampling(args.temperature, args.top_p, args.ignore_eos, args.sampling_seed)
    backends = list(dict.fromkeys(args.backend))
    if "openai" in backends and not args.base_url:
        raise SystemExit("--backend openai needs --base-url URL")
    columns = compare_configs(args)
    runs: list[RunResult] = []
    loaded_cache: dict[tuple[str, ...], Any] = {}
    workload: Workload | None = None
    first_core: Any = None
    for label, cfg in columns if "engine" in backends else []:
        key = (cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.kernels.backend)
        core = EngineCore(cfg, loaded=loaded_cache.get(key))
        loaded_cache[key] = core.loaded
        first_core = first_core or core
        params = params_from_args(args, block_size=cfg.cache.block_size)
        workload = make_workload(
            params, HFCodec(core.tokenizer, name=f"hf:{Path(str(core.loaded.path)).name}")
        )
        plan = plan_arrivals(workload.roots(), arrival_from_args(args), args.seed)
        if not runs:
            log.info("loadgen.workload", workload=workload_line(workload, plan))
        log.info("loadgen.run_start", label=label, workload=workload.name, arrivals=plan["mode"])
        runs.append(
            await run_live(
                EngineBackend(core, sampling), workload, plan, label=label,
                progress=not args.no_progress, warmup=args.warmup,
            )
        )  # fmt: skip
        del core
    if "openai" in backends:
        cfg = columns[0][1]
        source = args.tokenizer or str(cfg.model.path)
        tokenizer = (
            first_core.tokenizer if first_core is not None and not args.tokenizer else load_tokenizer(source)
        )
        codec = HFCodec(tokenizer, name=f"hf:{Path(source).name}")
        params = params_from_args(args, block_size=cfg.cache.block_size)
        workload = make_workload(params, codec)
        plan = plan_arrivals(workload.roots(), arrival_from_args(args), args.seed)
        if not runs:
            log.info("loadgen.workload", workload=workload_line(workload, plan))
        log.info("loadgen.run_start", label="openai", url=args.base_url, workload=workload.name)
        backend = OpenAIBackend(args.base_url, sampling, model=args.model, codec=codec)
        runs.append(
            await run_live(
                backend, workload, plan, label="openai", progress=not args.no_progress, warmup=args.warmup
            )
        )
    if args.baseline == "hf":
        cfg = columns[0][1]
        model_dir = (
            str(first_core.loaded.path) if first_core is not None else str(model_folder(str(cfg.model.path)))
        )
        backend = HFBackend(model_dir, sampling, device=cfg.model.device, dtype=cfg.model.dtype.value)
        params = params_from_args(args, block_size=cfg.cache.block_size)
        workload = make_workload(
            params, HFCodec(first_core.tokenizer if first_core else load_tokenizer(model_dir))
        )
        plan = plan_arrivals(workload.roots(), arrival_from_args(args), args.seed)
        log.info("loadgen.run_start", label="hf", workload=workload.name, arrivals=plan["mode"])
        runs.append(
            await run_live(
                backend, workload, plan, label="hf", progress=not args.no_progress, warmup=args.warmup
            )
        )
    assert workload is not None
    args._workload = workload
    args._plan = plan
    return runs


def model_folder(path: str) -> Path:
    """The folder of a model path (``builtin:NAME`` is built on first use)."""
    if path.startswith("builtin:"):
        from deltaserve.models import ensure_builtin_model

        return Path(ensure_builtin_model(path.split(":", 1)[1]))
    return Path(path)


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer of a model path or folder (for workloads sent over HTTP)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_folder(path)))


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    from deltaserve.logs import configure_logging

    configure_logging(args.log_level)
    from deltaserve.engine import install_uvloop

    install_uvloop()  # uvloop when installed, else the default asyncio loop
    runs = asyncio.run(amain(args))
    workload: Workload = args._workload
    title = workload_line(workload, args._plan)
    print(title)
    print(format_table([(r.label, r.summary) for r in runs], agreement_rows(runs)))
    if args.json:
        write_json(args.json, args, workload, runs)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, runs, title)
        print(f"wrote {args.plot}")
    return runs


if __name__ == "__main__":
    main()
