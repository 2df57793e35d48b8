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
``usage``, the engine hit rate from ``/metrics``: deltaserve's, vLLM's or llama-server's
counters), then ``--baseline hf``: the same requests
through transformers ``generate``, greedy, one at a time (an application without a
serving engine). Ratios are against the first column. Everything goes to ``--json``;
``--plot`` draws latency distributions and hit rate per turn.

This module is the command line; the backends are ``tools/backends.py``, the live driver
``tools/live.py`` (``run_live``), the output ``tools/loadgen_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltaserve.logs import get_logger
from deltaserve.tools.backends import Delta, EngineBackend, HFBackend, OpenAIBackend, Sampling
from deltaserve.tools.live import RunResult, run_live
from deltaserve.tools.loadgen_report import agreement_rows, plot, workload_line, write_json
from deltaserve.tools.metrics import format_legend, format_table
from deltaserve.tools.workloads import (
    HFCodec,
    Workload,
    add_workload_args,
    arrival_from_args,
    make_workload,
    params_from_args,
    plan_arrivals,
)

__all__ = [
    "Delta",
    "EngineBackend",
    "HFBackend",
    "OpenAIBackend",
    "RunResult",
    "Sampling",
    "agreement_rows",
    "amain",
    "build_parser",
    "compare_configs",
    "load_tokenizer",
    "main",
    "model_folder",
    "run_live",
    "workload_line",
    "write_json",
]

log = get_logger("deltaserve.loadgen")


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


def _arrivals(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    return plan_arrivals(workload.roots(), arrival_from_args(args), args.seed)


async def _engine_runs(
    args: argparse.Namespace, columns: list[tuple[str, Any]], sampling: Sampling, runs: list[RunResult]
) -> tuple[Any, Workload | None, dict[str, Any] | None]:
    """One in-process engine per column (a loaded model is reused by columns that share it);
    the first core (its tokenizer and model folder serve the other backends), the last
    workload and its arrival plan."""
    from deltaserve.engine import EngineCore

    loaded_cache: dict[tuple[str, ...], Any] = {}
    workload: Workload | None = None
    plan: dict[str, Any] | None = None
    first_core: Any = None
    for label, cfg in columns:
        key = (cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.kernels.backend)
        core = EngineCore(cfg, loaded=loaded_cache.get(key))
        loaded_cache[key] = core.loaded
        first_core = first_core or core
        params = params_from_args(args, block_size=cfg.cache.block_size)
        workload = make_workload(
            params, HFCodec(core.tokenizer, name=f"hf:{Path(str(core.loaded.path)).name}")
        )
        plan = _arrivals(args, workload)
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
    return first_core, workload, plan


async def _openai_run(
    args: argparse.Namespace, cfg: Any, first_core: Any, sampling: Sampling, runs: list[RunResult]
) -> tuple[Workload, dict[str, Any]]:
    """The OpenAI-compatible server at ``--base-url``, on a workload built with its tokenizer."""
    source = args.tokenizer or str(cfg.model.path)
    tokenizer = (
        first_core.tokenizer if first_core is not None and not args.tokenizer else load_tokenizer(source)
    )
    codec = HFCodec(tokenizer, name=f"hf:{Path(source).name}")
    params = params_from_args(args, block_size=cfg.cache.block_size)
    workload = make_workload(params, codec)
    plan = _arrivals(args, workload)
    if not runs:
        log.info("loadgen.workload", workload=workload_line(workload, plan))
    log.info("loadgen.run_start", label="openai", url=args.base_url, workload=workload.name)
    backend = OpenAIBackend(args.base_url, sampling, model=args.model, codec=codec)
    runs.append(
        await run_live(
            backend, workload, plan, label="openai", progress=not args.no_progress, warmup=args.warmup
        )
    )
    return workload, plan


async def _hf_run(
    args: argparse.Namespace, cfg: Any, first_core: Any, sampling: Sampling, runs: list[RunResult]
) -> tuple[Workload, dict[str, Any]]:
    """transformers ``generate`` on the first column's model."""
    model_dir = (
        str(first_core.loaded.path) if first_core is not None else str(model_folder(str(cfg.model.path)))
    )
    backend = HFBackend(model_dir, sampling, device=cfg.model.device, dtype=cfg.model.dtype.value)
    params = params_from_args(args, block_size=cfg.cache.block_size)
    workload = make_workload(
        params, HFCodec(first_core.tokenizer if first_core else load_tokenizer(model_dir))
    )
    plan = _arrivals(args, workload)
    log.info("loadgen.run_start", label="hf", workload=workload.name, arrivals=plan["mode"])
    runs.append(
        await run_live(backend, workload, plan, label="hf", progress=not args.no_progress, warmup=args.warmup)
    )
    return workload, plan


async def amain(args: argparse.Namespace) -> list[RunResult]:
    """Every column in turn: the engine per ``--compare`` entry, ``--backend openai``,
    ``--baseline hf``; the last workload and plan are left on ``args`` for the output."""
    sampling = Sampling(args.temperature, args.top_p, args.ignore_eos, args.sampling_seed)
    backends = list(dict.fromkeys(args.backend))
    if "openai" in backends and not args.base_url:
        raise SystemExit("--backend openai needs --base-url URL")
    columns = compare_configs(args)
    runs: list[RunResult] = []
    first_core, workload, plan = None, None, None
    if "engine" in backends:
        first_core, workload, plan = await _engine_runs(args, columns, sampling, runs)
    if "openai" in backends:
        workload, plan = await _openai_run(args, columns[0][1], first_core, sampling, runs)
    if args.baseline == "hf":
        workload, plan = await _hf_run(args, columns[0][1], first_core, sampling, runs)
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
    columns = [(r.label, r.summary) for r in runs]
    print(format_table(columns, agreement_rows(runs)))
    print(format_legend(columns))
    if args.json:
        write_json(args.json, args, workload, runs)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, runs, title)
        print(f"wrote {args.plot}")
    return runs


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "loadgen")
