"""``tools/gpu_check.py --dry-run``: the device check's every phase runs on the CPU (tiny model,
Triton under the interpreter) and writes each section, so the script a GPU run depends on
keeps working; a spent budget skips phases with a note instead of overrunning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.tools import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(gpu_check.SECTIONS) <= set(result)
    assert result["env"]["dry_run"] is True
    assert result["install"]["skipped"] == "dry run"
    assert result["tests"]["ok"] and " passed" in result["tests"]["summary"]
    parity = result["parity"]
    assert parity["ok"] and parity["fp32_tokens_equal"] and parity["prefix_cache_on_off_equal"]
    assert 0.5 <= parity["bf16_state_token_match"] <= 1.0  # reported, not gating: near-ties may flip
    assert parity["json_schema"]["ok"] and json.loads(parity["json_schema"]["text"])["c"] in ("a", "b")
    speed = result["speed"]
    assert speed["roofline"]["copy_bytes_per_s"] > 0 and speed["roofline"]["matmul_flop_per_s"] > 0
    assert [r["batch"] for r in speed["decode"]] == [1, 4] and all(
        r["tok_per_s"] > 0 for r in speed["decode"]
    )
    assert [r["tokens"] for r in speed["prefill"]] == [64] and speed["prefill"][0]["tok_per_s"] > 0
    assert speed["ttft"]["cold_s"] > 0 and speed["ttft"]["warm_s"] > 0
    # the table is the last thing printed
    assert proc.stdout.splitlines()[0].startswith("gpu_check (dry run)")
    assert "decode b=4" in proc.stdout


def test_spent_budget_skips_phases_with_a_note(tmp_path: Path) -> None:
    proc = run(tmp_path, "--budget-s", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("tests", "parity", "speed"):
        assert result[name]["skipped"].startswith("budget: "), result[name]
    assert "tests    skipped: budget" in proc.stdout


def test_install_reports_missing_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "imports_work", lambda: ["msgspec"])
    got = gpu_check.install(tmp_path / "none", tmp_path / "site", dry_run=False)
    assert got["ok"] is False and got["missing"] == ["msgspec"]
    assert got["error"].startswith(f"no wheels in {tmp_path / 'none'}")
    monkeypatch.setattr(gpu_check, "imports_work", lambda: [])
    assert gpu_check.install(tmp_path / "none", tmp_path / "site", dry_run=False) == {
        "skipped": "imports already work"
    }
