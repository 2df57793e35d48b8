#!/usr/bin/env python
"""One command that proves the GPU path on a lent device machine (docs/gpu.md)::

    tools/gpu_wheels.sh                                  # here: the wheels the device lacks -> .whl/
    python3 tools/gpu_check.py --out $OUT                # there, with .whl carried
    python tools/gpu_check.py --dry-run --out /tmp/gc    # anywhere: the same phases on the CPU, tiny

Phases, in order, each skipped with a note (never overrun) when the ``--budget-s`` left is
below what it needs:

1. ``install``: the wheels of ``.whl/`` into ``--site`` (put first on ``sys.path`` and
   ``PYTHONPATH``), unless the imports already work or on a dry run;
2. ``tests``: pytest on the ``gpu``-marked tests and the Triton kernel tests (on CUDA; on a dry
   run one kernel module under ``TRITON_INTERPRET=1``);
3. ``parity``: greedy tokens of the device engine vs the CPU float32 reference engine, prefix
   cache on == off, a json_schema request (``tools/gpu_check_phases.py``);
4. ``speed``: copy-bandwidth and matmul rooflines measured in this run, decode tok/s per batch
   size, prefill tok/s per prompt length, cold vs warm TTFT on a shared prefix.

Shapes: the built-in tiny model on a dry run; random weights in Qwen3.5-0.8B shape
(``tools/make_shaped_model.py``) on a GPU. Writes ``--out/gpu_check.json`` (every section,
skipped ones with their reason) and prints a short table last. Exit status 0 when every phase
that ran passed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: modules the carried wheels provide (import names)
NEEDED = [
    "msgspec",
    "structlog",
    "xgrammar",
    "zmq",
    "starlette",
    "uvicorn",
    "httptools",
    "pytest_asyncio",
    "jsonschema",
]
SECTIONS = ["env", "install", "tests", "parity", "speed"]


class Budget:
    """The run's time budget: ``remaining()`` seconds; ``allows(need)`` before a phase."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, need_s: float) -> bool:
        return self.remaining() >= need_s


def imports_work() -> list[str]:
    """The ``NEEDED`` modules that do not import."""
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def install(wheels: Path, site: Path, dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return {"skipped": "dry run"}
    missing = imports_work()
    if not missing:
        return {"skipped": "imports already work"}
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return {
            "ok": False,
            "error": f"no wheels in {wheels} (run tools/gpu_wheels.sh first)",
            "missing": missing,
        }
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *files]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    still = imports_work()
    return {"ok": proc.returncode == 0 and not still, "wheels": len(files), "still_missing": still,
            "pip_tail": proc.stderr[-2000:]}  # fmt: skip


def run_tests(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    env = dict(os.environ)
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
        cmd = ["-m", "interpret", "tests/kernels/test_triton_conv1d.py"]
    else:
        env.pop("TRITON_INTERPRET", None)
        # gpu-marked tests, and every Triton kernel test (they run on CUDA when it is there)
        cmd = ["-m", "gpu or interpret", "tests/kernels", "tests/engine"]
    timeout = max(10.0, min(args.tests_s, budget.remaining() - args.reserve_s))
    junit = Path(args.out) / "tests.xml"
    # a module that fails to import is reported, and every other test still runs
    full = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
            f"--junitxml={junit}", *cmd]  # fmt: skip
    t = time.monotonic()
    try:
        proc = subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "tail": out[-3000:]}
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"ok": proc.returncode == 0, "rc": proc.returncode, "summary": summary, "seconds": time.monotonic() - t,
            "command": " ".join(cmd), "tail": (proc.stdout + proc.stderr)[-3000:]}  # fmt: skip


def make_plan(args: argparse.Namespace, tmp: Path) -> Any:
    import torch

    from deltaserve.models.builtin import ensure_builtin_model
    from deltaserve.tools.gpu_check_phases import Plan

    tiny = str(ensure_builtin_model("tiny-qwen3.5"))
    if args.dry_run:
        return Plan(device="cpu", dtype="float32", parity_model=tiny, speed_model=tiny, backend="reference",
                    parity_lengths=[1, 5, 40], parity_tokens=4, decode_batches=[1, 4], decode_steps=3,
                    prefill_lengths=[64], ttft_prefix=128, copy_bytes=8 << 20, matmul_n=128,
                    memory_bytes=64 << 20)  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run")
    from deltaserve.tools.make_shaped_model import write_shaped_model

    shaped = str(write_shaped_model(args.shape, tmp / args.shape, "bfloat16"))
    return Plan(device="cuda", dtype="bfloat16", parity_model=shaped, speed_model=shaped, backend="auto",
                parity_lengths=[1, 5, 64, 65, 300], parity_tokens=8, decode_batches=[1, 8, 32, 128],
                decode_steps=32, prefill_lengths=[2048, 8192], ttft_prefix=8192, copy_bytes=2 << 30,
                matmul_n=8192, memory_bytes=16 << 30)  # fmt: skip


def speed(plan: Any, budget: Budget, reserve_s: float) -> dict[str, Any]:
    from deltaserve.tools import gpu_check_phases as ph

    remaining = lambda: budget.remaining() - reserve_s  # noqa: E731
    out: dict[str, Any] = {"model": plan.speed_model, "dtype": plan.dtype}
    out["roofline"] = ph.rooflines(plan)
    core = ph.engine(plan, plan.speed_model, **{"cache.enable_prefix_caching": False})
    out["decode"] = ph.decode_speed(plan, core, out["roofline"], remaining)
    out["decode_profile"] = ph.decode_profile(plan, core) if remaining() > 30 else {"skipped": "budget"}
    out["prefill"] = ph.prefill_speed(plan, core, out["roofline"], remaining)
    core.close()
    del core
    ph.free()
    out["ttft"] = ph.ttft(plan) if remaining() > 30 else {"skipped": "budget"}
    out["ok"] = True
    return out


def run_phase(name: str, args: argparse.Namespace, plan: Any, budget: Budget) -> dict[str, Any]:
    if name == "tests":
        return run_tests(args, budget)
    if name == "parity":
        from deltaserve.tools.gpu_check_phases import parity

        if plan is None:
            raise RuntimeError("no plan (see the plan section)")
        return parity(plan)
    if plan is None:
        raise RuntimeError("no plan (see the plan section)")
    return speed(plan, budget, args.reserve_s)


def phase(result: dict[str, Any], name: str, budget: Budget, need_s: float, fn: Any) -> None:
    if not budget.allows(need_s):
        result[name] = {"skipped": f"budget: {budget.remaining():.0f} s left, needs {need_s:.0f} s"}
        return
    t = time.monotonic()
    try:
        result[name] = fn()
    except Exception as e:  # noqa: BLE001 - a failed phase is a result, the next phases still run
        result[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result[name]["seconds"] = time.monotonic() - t


def env_info(dry_run: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"dry_run": dry_run, "python": platform.python_version(), "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ok": True}  # fmt: skip
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()  # fmt: skip
    except OSError:
        info["commit"] = None
    import deltaserve

    info["deltaserve"] = deltaserve.__file__  # this checkout's, not an installed copy
    if torch.cuda.is_available():
        info["card"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def table(result: dict[str, Any]) -> str:
    """The short summary printed last."""
    lines = [f"gpu_check {'(dry run) ' if result['env'].get('dry_run') else ''}"
             f"card={result['env'].get('card', 'cpu')} commit={result['env'].get('commit')}"]  # fmt: skip
    for name in SECTIONS[1:]:
        r = result.get(name, {})
        state = (
            "skipped: " + r["skipped"]
            if "skipped" in r
            else ("ok" if r.get("ok") else "FAIL " + r.get("error", ""))
        )
        lines.append(f"  {name:<8} {state}")
    tests = result.get("tests", {})
    if tests.get("summary"):
        lines.append(f"  tests: {tests['summary']}")
    sp = result.get("speed", {})
    roof = sp.get("roofline")
    if roof:
        lines.append(
            f"  copy {roof['copy_bytes_per_s'] / 1e9:.1f} GB/s   matmul {roof['matmul_flop_per_s'] / 1e12:.2f} TFLOP/s"
        )
    for row in sp.get("decode", []):
        if "tok_per_s" in row:
            lines.append(
                f"  decode b={row['batch']:<4} {row['tok_per_s']:10.1f} tok/s  {row['of_roofline']:6.1%} of roofline"
            )
    prof = sp.get("decode_profile", {})
    if "launches_per_step" in prof:
        lines.append(f"  decode b=1 step: {prof['launches_per_step']:.0f} launches, {prof['syncs_per_step']:.0f} syncs, "
                     f"{prof['aten_ops_per_step']:.0f} torch ops, {prof['cpu_ms_per_step']:.1f} ms CPU"
                     + (f", {prof['device_ms_per_step']:.2f} ms device" if "device_ms_per_step" in prof else ""))  # fmt: skip
    for row in sp.get("prefill", []):
        if "tok_per_s" in row:
            lines.append(
                f"  prefill {row['tokens']:<6} {row['tok_per_s']:10.1f} tok/s  {row['of_roofline']:6.1%} of roofline"
            )
    ttft = sp.get("ttft", {})
    if "speedup" in ttft:
        lines.append(f"  ttft {ttft['prefix_tokens']}-token prefix: cold {ttft['cold_s'] * 1000:.1f} ms, "
                     f"warm {ttft['warm_s'] * 1000:.1f} ms ({ttft['speedup']:.1f}x)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json (and tests.xml)")
    p.add_argument(
        "--dry-run", action="store_true", help="the CPU, tiny shapes, kernels under TRITON_INTERPRET=1"
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="total time budget (default 8 minutes)")
    p.add_argument("--tests-s", type=float, default=180.0, help="at most this long for the pytest phase")
    p.add_argument("--reserve-s", type=float, default=10.0, help="kept back for writing results")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="the wheels folder (tools/gpu_wheels.sh)")
    p.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "deltaserve-site"))
    p.add_argument("--shape", default="qwen3.5-0.8b", help="tools/make_shaped_model.py shape for speed")
    p.add_argument("--skip", default="", help="comma-separated phases to skip: tests,parity,speed")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {}
    phase(result, "install", budget, 5, lambda: install(Path(args.wheels), Path(args.site), args.dry_run))
    result["env"] = env_info(args.dry_run)
    with tempfile.TemporaryDirectory() as tmp:
        plan: Any = None
        for name, need in [("tests", 30.0), ("parity", 20.0), ("speed", 30.0)]:
            if name in skip:
                result[name] = {"skipped": "--skip"}
                continue
            if name != "tests" and "plan" not in result:
                try:
                    plan = make_plan(args, Path(tmp))
                    result["plan"] = dict(vars(plan))
                except Exception as e:  # noqa: BLE001 - recorded; the phases that need it fail
                    result["plan"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            phase(
                result, name, budget, need, lambda name=name, plan=plan: run_phase(name, args, plan, budget)
            )
    result["seconds"] = args.budget_s - budget.remaining()
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.write(table(result) + "\n")
    failed = [n for n in SECTIONS[1:] if result.get(n, {}).get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's package, also where nothing is installed
    try:
        from deltaserve.engine.cli import run_tool
    except ImportError:  # the device image lacks the dependencies: main's install phase adds them
        raise SystemExit(main()) from None
    raise SystemExit(run_tool(main, "gpu_check"))
