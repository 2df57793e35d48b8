"""The long-reuse workload: open-loop conversations whose next turn comes back after
hundreds of other requests, heavy-tailed think times, deterministic under a seed."""

from __future__ import annotations

import statistics

from deltaserve.tools.workloads import (
    LARGE_WORKLOADS,
    ArrivalParams,
    Codec,
    RequestSpec,
    WorkloadParams,
    describe_reuse,
    expand,
    make_workload,
    plan_arrivals,
    reuse_distances,
    workload_names,
)


def _build(codec: Codec, seed: int = 0, **kw: object) -> list[tuple[RequestSpec, list[int]]]:
    return expand(make_workload(WorkloadParams(name="long-reuse", seed=seed, **kw), codec))  # type: ignore[arg-type]


def test_default_reuse_distances_are_in_the_hundreds(tiny_codec: Codec) -> None:
    reqs = _build(tiny_codec)
    d = describe_reuse(reqs)
    assert d["median"] >= 100 and d["p90"] >= 400, d
    assert len(reqs) > 2000 and len({s.session for s, _ in reqs}) == 800


def test_think_times_are_heavy_tailed_and_arrivals_open_loop(tiny_codec: Codec) -> None:
    w = make_workload(WorkloadParams(name="long-reuse", sessions=300), tiny_codec)
    reqs = expand(w)
    thinks = sorted(s.delay_s for s, _ in reqs if s.parent is not None)
    assert statistics.mean(thinks) > 1.3 * statistics.median(thinks)  # lognormal: mean above median
    assert thinks[-1] > 8 * statistics.median(thinks)
    roots = w.roots()
    times = [r.arrival_s for r in roots]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0  # type: ignore[operator]
    plan = plan_arrivals(roots, ArrivalParams(), seed=0)
    assert plan["mode"] == "trace" and plan["times"] == times
    assert plan_arrivals(roots, ArrivalParams(rate=2.0), seed=0)["mode"] == "poisson"


def test_turns_grow_the_context_and_apps_share_a_system_prompt(tiny_codec: Codec) -> None:
    reqs = _build(tiny_codec, sessions=60, tenants=3)
    by_rid = {s.rid: (s, r) for s, r in reqs}
    for spec, _ in reqs:
        if spec.parent is not None:
            parent, reply = by_rid[spec.parent]
            head = parent.prompt_ids + reply
            assert spec.prompt_ids[: len(head)] == head  # the reply comes back verbatim
            assert len(spec.prompt_ids) > len(head)
    roots = [s for s, _ in reqs if s.parent is None]
    apps = {s.meta["app"] for s in roots}
    assert len(apps) >= 2
    for app in apps:
        prompts = [s.prompt_ids for s in roots if s.meta["app"] == app]
        if len(prompts) > 1:
            shared = min(
                next((i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b), 0) for p in prompts[1:]
            )
            assert shared >= 500  # the app's system prompt (about 1000 tokens)
    assert max(s.turn for s, _ in reqs) >= 4 and statistics.mean(s.turn for s, _ in reqs) < 3


def test_deterministic_under_seed(tiny_codec: Codec) -> None:
    a = _build(tiny_codec, seed=3, sessions=40)
    b = _build(tiny_codec, seed=3, sessions=40)
    c = _build(tiny_codec, seed=4, sessions=40)
    key = [(s.rid, s.prompt_ids, s.max_tokens, s.delay_s, s.arrival_s) for s, _ in a]
    assert key == [(s.rid, s.prompt_ids, s.max_tokens, s.delay_s, s.arrival_s) for s, _ in b]
    assert [s.prompt_ids for s, _ in a] != [s.prompt_ids for s, _ in c]
    assert reuse_distances(a) == reuse_distances(b)


def test_run_by_name_only() -> None:
    assert LARGE_WORKLOADS == ("long-reuse",)
    assert "long-reuse" not in workload_names("all") and "long-reuse" not in workload_names("pressure")
    assert workload_names("long-reuse") == ["long-reuse"]
