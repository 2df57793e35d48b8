"""The examples run as written (subprocesses, built-in model, CPU); README.md's own code blocks
are run by tests/docs/test_readme.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec

from deltaserve import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300  # generous: a loaded CI machine; each run takes a few seconds


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # run as an application would: deltaserve as installed
    # The tiny model's ops are too small to gain from intra-op threads; on a busy machine
    # spinning OpenMP workers make a run several times slower (tests/kernels does the same).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


# ---------------------------------------------------------------------------- serve.toml
def test_serve_toml_loads_and_is_complete() -> None:
    path = EXAMPLES / "serve.toml"
    config = EngineConfig.load(path)
    assert config.model.path.startswith("builtin:")
    # "complete": every key of every section appears, set or commented out as `# key =`
    text = path.read_text(encoding="utf-8")
    tables = re.split(r"^\[([\w.]+)\]", text, flags=re.M)
    body = dict(zip(tables[1::2], tables[2::2]))
    for section in msgspec.structs.fields(EngineConfig):
        assert section.name in body, f"examples/serve.toml has no [{section.name}]"
        for field in msgspec.structs.fields(section.type):
            if field.name == "policy_options":
                assert "scheduler.policy_options" in body
                continue
            pattern = rf"^#?\s*{field.name}\s*="
            assert re.search(pattern, body[section.name], re.M), (
                f"examples/serve.toml: [{section.name}] lacks {field.name}"
            )


# ---------------------------------------------------------------------------- README
def test_readme_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "tools/setup.sh && .venv/bin/python tools/loadgen.py\n" in text
    assert "tools/setup.sh && .venv/bin/python -m pytest -q -ra -n 2\n" in text
    assert "from engine import" not in text


# ---------------------------------------------------------------------------- chat.py
def test_chat_example_reuses_previous_turns() -> None:
    r = _run(
        [
            str(EXAMPLES / "chat.py"),
            "--turns",
            "3",
            "--max-tokens",
            "8",
            "--set",
            "logging.stats_interval_s=0",
        ],
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    turns = [
        tuple(map(int, m))
        for m in re.findall(
            r"^\[turn (\d+): (\d+) prompt tokens, (\d+) cached, (\d+) generated", r.stdout, re.M
        )
    ]
    assert [t[0] for t in turns] == [1, 2, 3], r.stdout
    assert turns[0][2] == 0  # a cold cache
    prev_prompt, prev_generated = turns[0][1], turns[0][3]
    for _turn, prompt, cached, generated in turns[1:]:
        assert cached > 0, r.stdout  # turn N+1 resumes from turn N
        assert cached % 16 == 0  # whole blocks (the checkpoint unit)
        assert cached >= prev_prompt - 16  # at least the previous prompt, less its partial block
        # the prompt holds the previous prompt and reply (+ end-of-turn token, if cut short)
        assert prompt > prev_prompt + prev_generated
        prev_prompt, prev_generated = prompt, generated
    # stdout is the chat: no log records (they go to stderr)
    for line in r.stdout.splitlines():
        assert not re.match(r"^\d\d:\d\d:\d\d ", line), line
    assert "engine.ready" in r.stderr  # serve.toml: logging.level = "info", to stderr
