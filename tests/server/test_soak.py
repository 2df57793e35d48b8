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
