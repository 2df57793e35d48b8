"""The one harness every benchmark in ``tools/bench/`` runs on.

* ``interleaved(cases, rounds)``: the cases run in alternating order, round after round (A B,
  B A, A B, ...), so a burst of load from another process on a shared box lands on both
  sides of a comparison instead of on whichever ran during it. Each call's measure is its
  wall time, or the number the case returns (a case that times only the part that matters,
  or reports a rate, returns it; the harness never mixes the two within one case).
  ``interleaved_async`` is the same for coroutine functions.
* ``repeat(fn, reps)``: one case, timed ``reps`` times (what ``interleaved`` does for one);
  ``timed(fn)``: one call's wall seconds and its value.
* ``spread(values)``: the median with its spread: ``{"median", "min", "max", "q1", "q3", "n"}``.
  Medians are what benchmarks report; min/max and the quartiles say how far to trust them.
* ``box()``: what else ran on the machine: CPU count, load average, torch threads (when
  torch is loaded) and the other processes that used CPU over a short sample (name, pid,
  CPU%), from ``/proc`` (Linux; elsewhere only what the OS tells).
* ``Bench``: one benchmark run: records the box when made and again when written, and
  ``write(path, results)`` writes the one JSON shape every benchmark writes::

      {"tool": "bench_engine", "args": {...the command's options...},
       "box": {"before": box(), "after": box()}, "results": <the benchmark's own rows>}

  ``bench_parser(__doc__)`` makes a benchmark's parser with the ``--json PATH`` option that asks
  for it (``add_json_arg(parser)`` adds the option to another parser).

No torch import here: a benchmark that uses torch has loaded it before ``box()`` runs, and
``box()`` reads its thread count only then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from deltaserve.tools.metrics import percentile

T = TypeVar("T")

#: seconds between the two reads of /proc that give each process's CPU%
SAMPLE_S = 0.25
#: processes below this CPU% (of one core) are not listed as busy
BUSY_PCT = 5.0
#: at most this many busy processes are listed, busiest first
MAX_BUSY = 8


def spread(values: Sequence[float]) -> dict[str, float]:
    """The median of ``values`` and its spread (min, max, quartiles); ``n`` values."""
    if not values:
        raise ValueError("spread() of no values")
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": percentile(ordered, 25),
        "q3": percentile(ordered, 75),
        "n": len(ordered),
    }


def scaled(s: Mapping[str, float], factor: float, digits: int = 3) -> dict[str, float]:
    """``spread`` in other units (``factor`` times each value, rounded); ``n`` kept."""
    return {k: (v if k == "n" else round(v * factor, digits)) for k, v in s.items()}


def show(s: Mapping[str, float], factor: float = 1.0, fmt: str = ".2f") -> str:
    """``median (min-max)`` for a table cell."""
    return f"{s['median'] * factor:{fmt}} ({s['min'] * factor:{fmt}}-{s['max'] * factor:{fmt}})"


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Wall seconds of one call of ``fn``, and what it returned."""
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def _measure(fn: Callable[[], float | None]) -> float:
    t0 = time.perf_counter()
    value = fn()
    elapsed = time.perf_counter() - t0
    return elapsed if value is None else float(value)


def interleaved(
    cases: Mapping[str, Callable[[], float | None]], rounds: int, *, warmup: int = 0
) -> dict[str, list[float]]:
    """Each case's measures over ``rounds`` rounds, the cases alternating (forward order in
    even rounds, reversed in odd ones, so neither side always runs first). A case returning
    None is measured by its wall time in seconds; one returning a number, by that number.
    ``warmup`` rounds run first, in the same order, and are not kept."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for r, name in _rounds(list(cases), rounds, warmup):
        value = _measure(cases[name])
        if r >= warmup:
            out[name].append(value)
    return out


async def interleaved_async(
    cases: Mapping[str, Callable[[], Awaitable[float | None]]], rounds: int, *, warmup: int = 0
) -> dict[str, list[float]]:
    """``interleaved`` for coroutine functions (each call awaited before the next starts)."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for r, name in _rounds(list(cases), rounds, warmup):
        t0 = time.perf_counter()
        value = await cases[name]()
        elapsed = time.perf_counter() - t0
        if r >= warmup:
            out[name].append(elapsed if value is None else float(value))
    return out


def _rounds(names: list[str], rounds: int, warmup: int) -> list[tuple[int, str]]:
    """(round, case) in running order: forward in even rounds, reversed in odd ones."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, n) for r in range(warmup + rounds) for n in (names if r % 2 == 0 else names[::-1])]


def repeat(fn: Callable[[], float | None], reps: int, *, warmup: int = 0) -> list[float]:
    """``fn`` measured ``reps`` times (wall seconds, or what it returns), after ``warmup``."""
    return interleaved({"case": fn}, reps, warmup=warmup)["case"]


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (name, user + system clock ticks so far), for every process /proc shows."""
    ticks: dict[int, tuple[str, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        # "pid (comm) state ...": comm may hold spaces and parentheses; the fields follow the last ")"
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))
    return ticks


def busy_processes(sample_s: float = SAMPLE_S) -> list[dict[str, Any]]:
    """The other processes that used at least ``BUSY_PCT`` of a core over ``sample_s``
    seconds, busiest first (at most ``MAX_BUSY``); [] where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    hz = os.sysconf("SC_CLK_TCK")
    first = _cpu_ticks()
    t0 = time.monotonic()
    time.sleep(sample_s)
    second = _cpu_ticks()
    dt = time.monotonic() - t0
    me = os.getpid()
    busy = []
    for pid, (name, now) in second.items():
        if pid == me or pid not in first:
            continue
        pct = 100.0 * (now - first[pid][1]) / hz / dt
        if pct >= BUSY_PCT:
            busy.append({"pid": pid, "name": name, "cpu_pct": round(pct, 1)})
    busy.sort(key=lambda p: -p["cpu_pct"])
    return busy[:MAX_BUSY]


def box() -> dict[str, Any]:
    """What the machine was doing: CPUs, load average, torch threads, busy processes."""
    record: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        record["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        record["loadavg"] = None
    torch = sys.modules.get("torch")
    record["torch_threads"] = torch.get_num_threads() if torch is not None else None
    record["busy"] = busy_processes()
    return record


def describe_box(record: Mapping[str, Any]) -> str:
    """One line for a benchmark's printout: load and the busiest other processes."""
    busy = ", ".join(f"{p['name']} {p['cpu_pct']:.0f}%" for p in record["busy"][:4]) or "none"
    load = record["loadavg"][0] if record["loadavg"] else "?"
    return f"box: {record['cpus']} CPUs, load {load}, torch threads {record['torch_threads']}, busy: {busy}"


def bench_parser(doc: str | None, *, rounds: int | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help (as written), ``--json PATH``, and with
    ``rounds`` given, ``--rounds N`` (interleaved rounds; ``rounds`` is its default)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )
    add_json_arg(parser)
    if rounds is not None:
        parser.add_argument(
            "--rounds", type=int, default=rounds, metavar="N", help="interleaved rounds (default %(default)s)"
        )
    return parser


def add_json_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The ``--json PATH`` option every benchmark takes."""
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="also write the results here (tools/bench/harness.py's shape)",
    )


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class Bench:
    """One benchmark run: the box recorded now (``before``) and when the results are written."""

    def __init__(self, tool: str, args: argparse.Namespace | Mapping[str, Any] | None = None) -> None:
        self.tool = tool
        options = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        self.args = {k: _plain(v) for k, v in options.items() if not callable(v)}
        self.before = box()

    def document(self, results: Any) -> dict[str, Any]:
        """The JSON document of this run (records the box ``after`` now)."""
        return {
            "tool": self.tool,
            "args": self.args,
            "box": {"before": self.before, "after": box()},
            "results": results,
        }

    def write(self, path: str | Path | None, results: Any) -> dict[str, Any]:
        """The document; written to ``path`` (and ``wrote PATH`` printed) unless it is None."""
        doc = self.document(results)
        if path is not None:
            Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
            print(f"wrote {path}")
        return doc
