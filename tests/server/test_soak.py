"""Ten minutes of mixed traffic against ``deltaserve serve`` (``tools/soak_server.py``): streams,
disconnects, ``n = 2`` with stop strings, bad and oversized bodies. No 5xx, running requests back
to 0, RSS and open file descriptors flat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.tools.soak_server import main


@pytest.mark.slow
def test_ten_minutes_of_mixed_traffic_leave_the_server_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = main(["--duration", "600", "--workers", "8", "--every", "10", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["problems"] == [], result["problems"]
    assert len(result["samples"]) >= 55 and sum(result["counts"].values()) > 1000


@pytest.mark.slow
def test_two_minutes_with_the_engine_core_in_its_own_process(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = main(
        ["--duration", "120", "--workers", "4", "--every", "10", "--json", str(out), "--", "--engine-process"]
    )
    result = json.loads(out.read_text())
    assert code == 0 and result["problems"] == [], result["problems"]
    # the server and its engine core process, watched as one
    assert {s["processes"] for s in result["samples"]} == {2} and sum(result["counts"].values()) > 100
