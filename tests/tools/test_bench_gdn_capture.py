"""``tools/bench/bench_gdn_capture.py``: one row per capture case, each against no capture."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from deltaserve.tools.bench.bench_gdn_capture import main


def test_prints_each_case_against_no_capture(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["--tokens", "80", "--reps", "2", "--json", str(tmp_path / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [r for r in capsys.readouterr().out.strip().splitlines() if r.startswith("T=")]
    assert [re.search(r"capture\s+(.+?):", r).group(1) for r in rows] == ["none", "on-grid 64", "off-grid 48"]  # type: ignore[union-attr]
    assert "(1.000x;" in rows[0]
    # the harness's one JSON shape: each case timed in both interleaved rounds
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["tool"] == "bench_gdn_capture" and doc["args"]["reps"] == 2
    assert set(doc["box"]) == {"before", "after"} and doc["box"]["after"]["torch_threads"] >= 1
    assert [(r["case"], r["seconds"]["n"]) for r in doc["results"]] == [
        ("none", 2),
        ("on-grid 64", 2),
        ("off-grid 48", 2),
    ]
