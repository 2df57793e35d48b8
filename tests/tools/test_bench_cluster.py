"""bench_cluster's ``--churn`` without Ray: the option, the schedule, the trigger inside a real
loadgen run (``run_live`` over a scripted backend), and the report rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deltaserve.tools.backends import Delta
from deltaserve.tools.bench.bench_cluster import build_parser
from deltaserve.tools.bench.cluster_churn import (
    ChurnBackend,
    ChurnResult,
    churn_report,
    churn_rows,
    churn_threshold,
)
from deltaserve.tools.metrics import RequestRecord
from deltaserve.tools.workloads import SyntheticCodec


def test_churn_option_parses_a_share_strictly_between_0_and_1(capsys: pytest.CaptureFixture[str]) -> None:
    p = build_parser()
    assert p.parse_args([]).churn is None
    assert p.parse_args(["--churn", "0.5"]).churn == 0.5
    for bad, why in (
        ("1", "must be > 0 and < 1"),
        ("0", "must be > 0 and < 1"),
        ("half", "a number between"),
    ):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--churn", bad])
        assert e.value.code == 2
        assert f"--churn = {bad!r}: {why}" in capsys.readouterr().err


def test_threshold_leaves_a_before_and_an_after() -> None:
    assert churn_threshold(24, 0.5) == 12
    assert churn_threshold(24, 0.01) == 1  # rounds to 0: at least one before
    assert churn_threshold(24, 0.99) == 23  # rounds to 24: at least one after
    assert churn_threshold(2, 0.5) == 1
    with pytest.raises(ValueError, match="churn needs at least 2 requests, the workload has 1"):
        churn_threshold(1, 0.5)


class ScriptedBackend:
    """A loadgen backend: 4 output tokens per request, ``cached`` tokens each after the kill
    was seen (``killed``), and one request that fails mid-stream."""

    kind = "scripted"

    def __init__(self, fail_rid: str) -> None:
        self.fail_rid = fail_rid
        self.started: list[str] = []
        self.killed = False

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind}

    async def stream(self, spec: Any) -> AsyncIterator[Delta]:
        self.started.append(spec.rid)
        await asyncio.sleep(0.001)
        yield Delta([5, 6], num_prompt_tokens=len(spec.prompt_ids))
        if spec.rid == self.fail_rid:
            raise RuntimeError("server error mid-stream: replica died")
        cached = 0 if self.killed else len(spec.prompt_ids) // 2
        yield Delta([7, 8], finished=True, finish_reason="length", num_prompt_tokens=len(spec.prompt_ids),
                    num_cached_tokens=cached)  # fmt: skip


async def _run(fail_rid: str) -> tuple[Any, ChurnBackend, ScriptedBackend, list[int]]:
    from deltaserve.tools.live import run_live
    from deltaserve.tools.workloads import ArrivalParams, WorkloadParams, make_workload, plan_arrivals

    params = WorkloadParams(
        name="chat", seed=1, sessions=4, turns=3, prefix_len=16, prompt_len=8, output_len=4
    )
    wl = make_workload(params, SyntheticCodec())
    plan = plan_arrivals(wl.roots(), ArrivalParams(concurrency=2), 1)
    inner = ScriptedBackend(fail_rid)
    release = asyncio.Event()
    ended_while_churning: list[int] = []

    async def churn() -> ChurnResult:
        inner.killed = True
        n = len(backend.finished)
        await release.wait()  # the run goes on while the replacement starts
        ended_while_churning.append(len(backend.finished) - n)
        return ChurnResult(killed="r1", replacement="r3", replaced_after_s=2.5)

    backend = ChurnBackend(inner, churn_threshold(wl.expected_requests(), 0.5), churn)
    run = asyncio.ensure_future(run_live(backend, wl, plan, label="churn", progress=False, warmup=2))
    while len(backend.finished) < 9:
        await asyncio.sleep(0.005)
    release.set()
    res = await run
    result = await backend.result(5.0)
    assert result is not None and result.replaced_after_s == 2.5
    return res, backend, inner, ended_while_churning


def test_churn_fires_once_at_the_threshold_while_requests_go_on() -> None:
    res, backend, inner, ended_while_churning = asyncio.run(_run("chat-s3-t0"))
    assert [r for r in inner.started if r.startswith("warmup-")] == ["warmup-0", "warmup-1"]
    assert backend.threshold == 6  # half of 12 expected requests
    assert backend.before is not None and len(backend.before) == 6
    assert not any(r.startswith("warmup-") for r in backend.finished)  # warm-ups are not the workload's
    assert ended_while_churning and ended_while_churning[0] >= 3  # requests kept ending meanwhile
    # the failed root's two follow-ups were never sent: 10 of 12 requests
    assert len(res.records) == 10 and set(backend.finished) == {r.rid for r in res.records}
    assert backend.before == frozenset(backend.finished[:6])

    rep = churn_report(res.records, backend.before, {"retries": 1, "replica_failures": 2, "failed": 1}, None)
    assert rep.done_at_kill == 6 and rep.total == 10
    assert rep.before.requests + rep.after.requests == 10
    failed = next(r for r in res.records if r.rid == "chat-s3-t0")
    assert (failed.rid in backend.before) == (
        rep.before.failed == 1
    ) and rep.before.failed + rep.after.failed == 1


def _rec(rid: str, prompt: int, cached: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(rid=rid, num_prompt_tokens=prompt, num_cached_tokens=cached, finish_s=1.0,
                         finish_reason="length" if ok else "error", error=None if ok else "replica r1 failed")  # fmt: skip


def test_report_rows_split_at_the_kill() -> None:
    records = [_rec("a", 100, 50), _rec("b", 100, 30), _rec("c", 200, 20), _rec("d", 100, 0, ok=False)]
    rep = churn_report(
        records,
        frozenset({"a", "b"}),
        {"retries": 1, "replica_failures": 2, "failed": 1, "requests": 4},
        ChurnResult(killed="r1", replacement="r3", replaced_after_s=12.34),
    )
    assert (rep.before.requests, rep.before.failed, rep.before.hit_rate) == (2, 0, 0.4)
    assert (rep.after.requests, rep.after.failed, rep.after.hit_rate) == (
        2,
        1,
        0.1,
    )  # the failed one: no tokens
    late = churn_report(records, frozenset(r.rid for r in records), {}, ChurnResult(error="no replacement"))
    assert churn_rows([None, None]) == []
    assert churn_rows([rep, None, late]) == [
        ("churn: requests ended at kill", ["2/4", "-", "4/4"]),
        ("hit rate before / after kill %", ["40.0 / 10.0", "-", "25.0 / -"]),
        ("failed before / after kill", ["0 / 1", "-", "1 / 0"]),
        ("ingress retries / replica failures", ["1 / 2", "-", "0 / 0"]),
        ("replacement running after (s)", ["12.3", "-", "no (no replacement)"]),
    ]
    assert rep.to_dict()["result"]["killed"] == "r1"
