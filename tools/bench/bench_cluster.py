"""Prefix-affinity vs power-of-two routing vs one engine, on the same multi-turn workload.

::

    python -m deltaserve.tools.bench.bench_cluster                               # 2 replicas, chat workload
    python -m deltaserve.tools.bench.bench_cluster --replicas 2 --sessions 16 --turns 5 --json bench.json
    python -m deltaserve.tools.bench.bench_cluster --set model.path=/models/Qwen3.5-0.8B --replica-cpus 4
    python -m deltaserve.tools.bench.bench_cluster --routers pow2 --shared-tier --no-single
    python -m deltaserve.tools.bench.bench_cluster --routers pow2 --replicas 3 --churn 0.5 --no-single

One process, in order: a local Ray cluster with N replicas and ``--router prefix``, then the
same with ``--router pow2`` (each application deployed, measured, deleted), then Ray is stopped
and one engine is served by ``deltaserve serve``'s app in this process. Each column is
``tools/loadgen.py``'s OpenAI backend (streamed token-id completions, TTFT from SSE arrival,
cached tokens from ``usage``) on the identical workload (deterministic under ``--seed``; greedy
outputs, so every column sends the same follow-up turns). The table is loadgen's, plus the
requests each replica served. The columns run one after another, not as interleaved rounds
(``tools/bench/harness.py``): each must start on cold caches and the Ray cluster is stopped
before the single engine starts; ``--json`` writes the harness's shape, the box's load included.

``--shared-tier`` adds, after each router's column, the same router with a Mooncake Store
master started here (``cache/remote_master.py``) that the replicas share as their remote cache
tier (``cache.remote``; a fresh master per column, so each starts cold).

``--churn FRACTION``: in every Ray column, once that share of the workload's requests has
ended, one engine replica is killed and Serve starts its replacement while the workload goes
on (``tools/bench/cluster_churn.py``); the table adds the hit rate and failed requests before
and after the kill, the ingress's retries, and when the replacement was running. A request
the killed replica had started streaming fails (its follow-ups are then not sent), so a churn
column may send fewer requests than the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from deltaserve.logs import configure_logging, get_logger
from deltaserve.tools.bench.cluster_churn import (
    ChurnBackend,
    ChurnReport,
    ChurnResult,
    churn_fraction,
    churn_report,
    churn_rows,
    churn_threshold,
)
from deltaserve.tools.bench.harness import Bench, add_json_arg, describe_box

log = get_logger("deltaserve.cluster")


def build_parser() -> argparse.ArgumentParser:
    from deltaserve.engine.cli import add_config_args
    from deltaserve.tools.workloads import add_workload_args

    p = argparse.ArgumentParser(
        prog="python -m deltaserve.tools.bench.bench_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    add_workload_args(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=2)
    g.add_argument("--replica-cpus", type=float, default=1.0)
    g.add_argument(
        "--ray-cpus", type=float, default=None, help="CPUs of the local Ray cluster (default: all)"
    )
    g.add_argument("--routers", nargs="+", default=["prefix", "pow2"], choices=["prefix", "pow2"])
    g.add_argument("--no-single", action="store_true", help="skip the single-engine column")
    g.add_argument(
        "--shared-tier", action="store_true",
        help="also each router with a Mooncake master the replicas share (cache.remote; needs the remote extra)",
    )  # fmt: skip
    g.add_argument(
        "--churn", type=churn_fraction, default=None, metavar="FRACTION",
        help="kill one replica once FRACTION of the requests ended; Serve replaces it mid-run",
    )  # fmt: skip
    g.add_argument("--warmup", type=int, default=2, help="warm-up requests per column (own cache salt)")
    add_json_arg(g)
    g.add_argument("--log-level", default="warning")
    return p


#: seconds the end of a churn column waits for the killed replica's replacement
REPLACE_TIMEOUT_S = 300.0


async def _measure(
    url: str,
    workload_args: argparse.Namespace,
    label: str,
    codec: Any,
    warmup: int,
    churn: Callable[[], Awaitable[ChurnResult]] | None = None,
) -> Any:
    """One column: ``(RunResult, workload, plan, churn)``; ``churn`` is None, or the
    ``ChurnBackend`` (its ``before`` set) and the churn's result."""
    from deltaserve.tools.backends import OpenAIBackend, Sampling
    from deltaserve.tools.live import run_live
    from deltaserve.tools.workloads import arrival_from_args, make_workload, params_from_args, plan_arrivals

    params = params_from_args(workload_args, block_size=workload_args._block_size)
    workload = make_workload(params, codec)
    plan = plan_arrivals(workload.roots(), arrival_from_args(workload_args), workload_args.seed)
    backend: Any = OpenAIBackend(url, Sampling(), model=None, codec=codec)
    if churn is not None:
        threshold = churn_threshold(workload.expected_requests(), workload_args.churn)
        backend = ChurnBackend(backend, threshold, churn)
    res = await run_live(backend, workload, plan, label=label, progress=False, warmup=warmup)
    if not isinstance(backend, ChurnBackend):
        return res, workload, plan, None
    return res, workload, plan, (backend, await backend.result(REPLACE_TIMEOUT_S))


async def _status(url: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/cluster/status")
        return r.json() if r.status_code == 200 else {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from deltaserve.cluster.config import ClusterConfig
    from deltaserve.cluster.local import RayCluster
    from deltaserve.engine.cli import config_from_args
    from deltaserve.models.tokenizer import load_tokenizer
    from deltaserve.tools.workloads import HFCodec

    bench = Bench("bench_cluster", args)
    cfg = config_from_args(args)
    args._block_size = cfg.cache.block_size
    codec = HFCodec(load_tokenizer(str(cfg.model.path)))
    runs: list[Any] = []
    routed: dict[str, dict[str, int]] = {}
    churned: list[ChurnReport | None] = []
    workload = plan = None
    with RayCluster(num_cpus=args.ray_cpus) as rc:
        for router in args.routers:
            for shared in (False, True) if args.shared_tier else (False,):
                cluster = ClusterConfig(
                    replicas=args.replicas,
                    router=router,
                    num_cpus=args.replica_cpus,
                    app_name=f"bench-{router}",
                )
                label = f"{args.replicas}x {router}" + (" + shared tier" if shared else "")
                with _shared_tier(cfg, shared) as run_cfg:
                    url = rc.deploy(run_cfg, cluster)
                    churn = _churn_fn(cluster) if args.churn is not None else None
                    res, workload, plan, ch = asyncio.run(
                        _measure(url, args, label, codec, args.warmup, churn)
                    )
                    st = asyncio.run(_status(url))
                    routed[label] = (st.get("routers") or [{}])[0].get("routed", {})
                    runs.append(res)
                    churned.append(_churn_report(res, ch, st))
                    # each column's numbers as it ends: a run cut short keeps the columns it finished
                    log.info(
                        "bench.column_done", label=label, summary=res.summary, routed=routed[label],
                        churn=churned[-1].to_dict() if churned[-1] is not None else None,
                    )  # fmt: skip
                    rc.undeploy(cluster.app_name)
    if not args.no_single:
        runs.append(asyncio.run(_single(cfg, args, codec)))
        churned.append(None)
    from deltaserve.tools.loadgen_report import agreement_rows, workload_line
    from deltaserve.tools.metrics import format_table

    assert workload is not None or runs
    title = workload_line(workload, plan) if workload is not None else ""
    print(title)
    extra = agreement_rows(runs) + churn_rows(churned)
    print(format_table([(r.label, r.summary) for r in runs], extra))
    for label, per in routed.items():
        print(f"{label}: requests per replica {sorted(per.values(), reverse=True)}")
    results = {
        "workload": title,
        "runs": [{"label": r.label, "summary": r.summary, "wall_s": r.wall_s} for r in runs],
        "routed_per_replica": routed,
        "churn": {r.label: c.to_dict() for r, c in zip(runs, churned, strict=True) if c is not None},
    }
    print(describe_box(bench.before))
    return bench.write(args.json, results)


def _churn_fn(cluster: Any) -> Callable[[], Awaitable[ChurnResult]]:
    """The churn of one column: kill a replica of its app and wait for the replacement (in a
    thread: Ray's calls block)."""
    from deltaserve.tools.bench.cluster_churn import kill_and_replace

    async def churn() -> ChurnResult:
        return await asyncio.to_thread(kill_and_replace, cluster.app_name, cluster.replicas)

    return churn


def _churn_report(res: Any, ch: Any, status: dict[str, Any]) -> ChurnReport | None:
    if ch is None:
        return None
    backend, result = ch
    before = backend.before if backend.before is not None else frozenset(r.rid for r in res.records)
    return churn_report(res.records, before, status.get("ingress") or {}, result)


@contextlib.contextmanager
def _shared_tier(cfg: Any, shared: bool) -> Iterator[Any]:
    """``cfg``, or (``shared``) ``cfg`` with ``cache.remote`` on a master started for the column."""
    if not shared:
        yield cfg
        return
    import msgspec

    from deltaserve.cache.remote_master import free_port, start_master, wait_listening

    port = free_port()
    master = start_master(port)
    try:
        if not wait_listening(master, "127.0.0.1", port):
            raise RuntimeError(f"mooncake_master did not start (exit code {master.poll()})")
        cache = msgspec.structs.replace(
            cfg.cache, remote=f"mooncake://127.0.0.1:{port}", remote_write_bytes_per_s=None
        )
        yield msgspec.structs.replace(cfg, cache=cache)
    finally:
        master.terminate()
        master.wait(timeout=30)


async def _single(cfg: Any, args: argparse.Namespace, codec: Any) -> Any:
    from deltaserve.engine import AsyncEngine
    from deltaserve.server.app import create_app
    from deltaserve.server.serving import BackgroundServer

    async with AsyncEngine(cfg) as engine, BackgroundServer(create_app(engine)) as srv:
        res, _, _, _ = await _measure(srv.url, args, "1 engine", codec, args.warmup)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    run(args)
    return 0


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    sys.exit(run_tool(main, "bench_cluster"))
