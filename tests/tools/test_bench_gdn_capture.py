"""``tools/bench/bench_gdn_capture.py``: one row per capture case, each against no capture."""

from __future__ import annotations

import re

import pytest
import torch

from deltaserve.tools.bench.bench_gdn_capture import main


def test_prints_each_case_against_no_capture(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["--tokens", "80", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = capsys.readouterr().out.strip().splitlines()
    assert [re.search(r"capture\s+(.+?):", r).group(1) for r in rows] == ["none", "on-grid 64", "off-grid 48"]  # type: ignore[union-attr]
    assert rows[0].endswith("(1.000x)")
