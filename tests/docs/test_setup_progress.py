"""tools/setup.sh says what it is doing, step by step, on stderr, and installs the same things.

Run on a copy of the script and pyproject.toml whose ``.venv/bin/python`` is a stub that records
its arguments: no network, no real installs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None, reason="tools/setup.sh is a bash script")
def test_setup_prints_each_step_and_installs_what_it_did(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "setup.sh", tmp_path / "tools" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    log = tmp_path / "calls.txt"
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n', encoding="utf-8")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "DELTASERVE_TORCH_VERSION": "9.9.9"}
    run = [str(tmp_path / "tools" / "setup.sh")]
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # progress is on stderr
    lines = r.stderr.splitlines()
    steps = ("virtual environment", "pip", "torch==9.9.9", "libibverbs", "deltaserve")
    for i, what in enumerate(steps, start=1):
        assert any(line.startswith(f"deltaserve setup [{i}/5] ") and what in line for line in lines), r.stderr
    assert lines[-1].startswith("deltaserve: environment ready in .venv")
    assert log.read_text(encoding="utf-8").splitlines() == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==9.9.9",
        "-m pip install -q -e .[test,triton,plot,cluster,remote]",
    ]
    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == ""  # up to date: a no-op, silent
