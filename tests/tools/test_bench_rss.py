"""tools/bench/bench_rss.py: RSS after start-up and after each run, against the capacity line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.tools.bench import bench_rss

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux only")


def test_rows_after_start_and_each_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rss.json"
    argv = ["--runs", "2", "--sessions", "2", "--turns", "2", "--prefix-len", "64", "--prompt-len", "16"]
    rows = bench_rss.main([*argv, "--output-len", "4", "--json", str(out), "--log-level", "warning"])
    assert [r["when"] for r in rows] == ["start", "run1", "run2"]
    doc = json.loads(out.read_text())
    assert doc["tool"] == "bench_rss" and doc["args"]["runs"] == 2 and set(doc["box"]) == {"before", "after"}
    saved = doc["results"]
    expected = saved["capacity"]["expected_rss_mib"]
    assert saved["capacity"]["budget_mib"] == bench_rss.DEFAULT_BUDGET / 2**20
    for r in rows:
        assert r["expected_rss_mib"] == expected
        assert r["ratio"] == pytest.approx(r["rss_mib"] / expected, abs=0.002)  # MiB rounding aside
        assert r["rss_anon_mib"] + r["rss_file_mib"] <= r["rss_mib"] + 1
    assert all(r["run_s"] > 0 for r in rows[1:])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["when", "rss_mib", "rss_anon_mib"]
    assert [line.split()[0] for line in table[1:4]] == ["start", "run1", "run2"]
    assert table[4].startswith("box: ") and table[5] == f"wrote {out}"


def test_config_file_keeps_its_budget_and_model_sets_the_path(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cache]\nmemory_bytes = 134217728\n")
    args = bench_rss.build_parser().parse_args(["--config", str(cfg), "--model", "builtin:tiny-qwen3.5"])
    config = bench_rss.make_config(args)
    assert config.cache.memory_bytes == 128 * 2**20
    assert config.model.path == "builtin:tiny-qwen3.5"
    plain = bench_rss.make_config(bench_rss.build_parser().parse_args([]))
    assert plain.cache.memory_bytes == bench_rss.DEFAULT_BUDGET
