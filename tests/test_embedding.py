"""deltaserve embedded in an application: import names, stdout and logging belong to the app.

The tests share one run of a throw-away application, as a subprocess (``sys.executable``,
no PYTHONPATH tweaks) from its own folder, which holds modules named like our source
folders (``models.py``, ``engine.py``, ``scheduler.py``, a ``cache/`` package): the app's
names must win for the app, and deltaserve must not pick them up. One process keeps the
cost at one torch import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

TIMEOUT_S = 300  # generous for a loaded machine; a run takes a few seconds

SHADOWS = {
    "models.py": "NAME = 'app models'\n",
    "engine.py": "NAME = 'app engine'\n",
    "scheduler.py": "NAME = 'app scheduler'\n",
    "cache/__init__.py": "NAME = 'app cache'\n",
}

# One process (one torch import) in two phases. Phase 1: the app has configured no
# logging; it imports its own shadowing modules first and prints only its own lines.
# Phase 2: it configures stdlib logging to stderr at DEBUG and runs three more engines.
APP = """\
import asyncio
import json
import logging
import sys

import cache
import engine
import models
import scheduler

from deltaserve import AsyncEngine, EngineConfig, SamplingParams

OWN = {"models": "app models", "engine": "app engine", "scheduler": "app scheduler", "cache": "app cache"}


async def serve(overrides: dict, max_tokens: int) -> tuple[str, int, str]:
    config = EngineConfig.load(None, overrides={"cache.memory_bytes": 64 << 20, **overrides})
    async with AsyncEngine(config) as eng:
        text, n, reason = "", 0, None
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        async for out in eng.generate("Hello, how are you?", params):
            text += out.text
            n += len(out.token_ids)
            reason = out.finish_reason
    return text, n, reason


print("app: start")
print("=== phase 1", file=sys.stderr, flush=True)
text, n, reason = asyncio.run(
    serve(
        {
            "cache.memory_bytes": 16 << 20,
            "cache.kv_cache_bytes": 32 << 20,  # beyond the budget: a capacity warning is logged
            "scheduler.max_num_seqs": 4,
            "logging.level": "info",
            "logging.stats_interval_s": 0.001,  # engine.stats records after every step (INFO)
        },
        max_tokens=6,
    )
)
print("app: text " + json.dumps(text))
print(f"app: tokens {n} {reason}")
assert {name: sys.modules[name].NAME for name in OWN} == OWN, "an app module was replaced"
print("app: own modules intact")

logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
for label, overrides in {
    "error": {"logging.level": "error", "logging.stats_interval_s": 0.001},
    "info": {"logging.level": "info", "logging.stats_interval_s": 0.001},
    "nostats": {"logging.level": "debug", "logging.stats_interval_s": 0},
}.items():
    print(f"=== phase 2 {label}", file=sys.stderr, flush=True)
    asyncio.run(serve(overrides, max_tokens=4))
print("app: done")
"""


@pytest.fixture(scope="module")
def app_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """The application's run: its own folder as the working directory, no PYTHONPATH."""
    root = tmp_path_factory.mktemp("app")
    for name, body in {**SHADOWS, "app.py": APP}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body, encoding="utf-8")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    # The tiny model's ops are too small to gain from intra-op threads; on a busy machine
    # spinning OpenMP workers make a run several times slower (tests/kernels does the same).
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run(
        [sys.executable, "app.py"], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def stderr_phases(r: subprocess.CompletedProcess[str]) -> dict[str, str]:
    parts = re.split(r"^=== phase (.+)\n", r.stderr, flags=re.M)
    phases = dict(zip(parts[1::2], parts[2::2]))
    assert list(phases) == ["1", "2 error", "2 info", "2 nostats"], r.stderr[-4000:]
    return phases


def records(text: str, event: str) -> list[str]:
    """Lines of phase 2's handler format (``LEVEL logger: event k=v ...``) for one event."""
    return re.findall(rf"^\w+ deltaserve[\w.]*: {event}\b.*$", text, re.M)


def test_app_with_shadowing_modules_is_served(app_run: subprocess.CompletedProcess[str]) -> None:
    """(a) The app's models.py / engine.py / scheduler.py / cache/ neither break deltaserve
    nor get replaced by it; the request is served."""
    lines = app_run.stdout.splitlines()
    assert isinstance(json.loads(lines[1].removeprefix("app: text ")), str)
    m = re.fullmatch(r"app: tokens (\d+) (stop|length)", lines[2])
    assert m and 1 <= int(m.group(1)) <= 6, lines[2]
    assert lines[3] == "app: own modules intact"


def test_stdout_is_the_applications(app_run: subprocess.CompletedProcess[str]) -> None:
    """(b) stdout holds exactly what the application printed; with no logging configured,
    Python's last-resort handler prints warnings (and not INFO records) to stderr."""
    lines = app_run.stdout.splitlines()
    assert len(lines) == 5, app_run.stdout
    assert lines[0] == "app: start" and lines[1].startswith("app: text ") and lines[4] == "app: done"
    assert lines[2].startswith("app: tokens ") and lines[3] == "app: own modules intact"
    phase1 = stderr_phases(app_run)["1"]
    assert "engine.capacity" in phase1 and "explicit pool sizes" in phase1, phase1[-4000:]
    assert "engine.ready" not in phase1 and "engine.stats" not in phase1


def test_logging_level_applies_to_the_apps_handlers(app_run: subprocess.CompletedProcess[str]) -> None:
    """(c) logging.level = "error": no INFO records reach the app's DEBUG handler; "info": they do."""
    phases = stderr_phases(app_run)
    assert records(phases["2 error"], "engine.ready") == []
    assert records(phases["2 error"], "engine.stats") == []
    assert [line.split()[0] for line in records(phases["2 info"], "engine.ready")] == ["INFO"]


def test_stats_interval_zero_logs_no_stats(app_run: subprocess.CompletedProcess[str]) -> None:
    """(d) logging.stats_interval_s = 0: no engine.stats lines, even at debug."""
    phases = stderr_phases(app_run)
    assert records(phases["2 info"], "engine.stats"), "control: an interval > 0 logs engine.stats"
    assert records(phases["2 nostats"], "engine.ready")
    assert records(phases["2 nostats"], "engine.stats") == []
