"""``--bounds``: the offline bounds (the KV-LRU over both tiers among them) and each run's ratio
to them, without running the oracle, from the requests the first run submitted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.tools.sim.cli import main

# fork points mid-path, as in Mooncake's trace: requests share 1-3 leading hash ids, then diverge;
# the file is not in timestamp order (the workload replays it in arrival order)
ROWS = [
    {"timestamp": 300 * ((5 * i) % 8), "input_length": 1300 + 30 * i, "output_length": 3,
     "hash_ids": [0, 1 + i % 2, 10 + i % 3, 20 + i]}
    for i in range(8)
]  # fmt: skip
SMALL = ["--workload", "trace", "--kv-mb", "4", "--checkpoint-slots", "2", "--checkpoint-bytes",
         str(2 * 1024**2), "--kv-bytes-per-token", "2048", "--host-memory-mb", "6", "--check"]  # fmt: skip


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    return path


def test_bounds_without_the_oracle_equal_the_oracles(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    alone = main([*SMALL, "--trace", str(trace), "--policies", "default", "--bounds", "--hybrid-lru"])
    out = capsys.readouterr().out
    with_oracle = main([*SMALL, "--trace", str(trace), "--policies", "default,oracle"])
    entry, ref = alone["workloads"]["trace"], with_oracle["workloads"]["trace"]
    assert entry["bounds_from"] == "default" and ref["bounds_from"] == "oracle"
    # an open-loop trace is submitted in arrival order whatever the policy: the same requests, the same bounds
    assert entry["bounds"] == {**ref["bounds"], "hybrid_lru": entry["bounds"]["hybrid_lru"]}
    assert ref["bounds"]["hybrid_lru"] is None  # only asked for
    host = entry["bounds"]["kv_lru_host"]
    assert 0 < entry["bounds"]["kv_lru"] < host < 1  # the host's bytes widen the LRU
    assert entry["bounds"]["kv_lru_split"]["hit"] / entry["bounds"]["kv_lru_split"]["prompt"] == host
    default = entry["results"][0]
    assert alone["summary"][0]["default/kv_lru_host"] == pytest.approx(default["hit_rate"] / host)
    assert "(from default's 8 submitted requests, in submission order)\nvs KV-LRU over" in out
    line = next(x for x in out.splitlines() if x.startswith("vs KV-LRU over"))
    ratio = default["hit_rate"] / host
    assert line == (
        f"vs KV-LRU over the memory tiers' bytes ({100 * host:.1f}%): "
        f"default {100 * default['hit_rate']:.1f}% = {ratio:.3f}x"
    )
    # the hybrid LRU (KV and exact checkpoints) over the same bytes, on the next line
    hybrid = entry["bounds"]["hybrid_lru"]
    assert entry["bounds"]["hybrid_lru_over"] == "the memory tiers' bytes" and 0 < hybrid < 1
    following = out.splitlines()[out.splitlines().index(line) + 1]
    assert following == (
        f"vs hybrid LRU (KV + exact checkpoints) over the memory tiers' bytes ({100 * hybrid:.1f}%): "
        f"default {100 * default['hit_rate']:.1f}% = {default['hit_rate'] / hybrid:.3f}x"
    )
    assert alone["summary"][0]["default/hybrid_lru"] == pytest.approx(default["hit_rate"] / hybrid)


def test_no_bounds_without_the_flag_or_the_oracle(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = main([*SMALL, "--trace", str(trace), "--policies", "default"])
    assert "bounds" not in doc["workloads"]["trace"]
    assert "vs KV-LRU" not in capsys.readouterr().out
    doc = main([*SMALL, "--trace", str(trace), "--policies", "default", "--bounds"])
    out = capsys.readouterr().out  # the hybrid LRU only with --hybrid-lru
    assert "vs KV-LRU over" in out and "vs hybrid LRU" not in out and "def/hybrid" not in out
    assert doc["workloads"]["trace"]["bounds"]["hybrid_lru"] is None
    assert doc["summary"][0]["default/hybrid_lru"] is None
