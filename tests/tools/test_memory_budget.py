"""``--memory-mb``: one device budget for KV and checkpoints in the simulator, and ``--sweep``
running fixed splits of the same bytes beside it."""

from __future__ import annotations

import pytest

from deltaserve.tools.sim.cli import build_parser, main, sim_config_from_args
from deltaserve.tools.sim.simulation import MiB

COMMON = ["--workload", "chat", "--sessions", "12", "--turns", "4", "--prefix-len", "200",
          "--checkpoint-bytes", str(2 * MiB), "--kv-bytes-per-token", "2048", "--check"]  # fmt: skip


def test_memory_is_pages_and_the_bounds_see_all_of_it() -> None:
    cfg = sim_config_from_args(build_parser().parse_args([*COMMON, "--memory-mb", "17"]))
    block = cfg.block_size * cfg.kv_bytes_per_token  # 32 KiB: a 2 MiB checkpoint is 64 blocks
    assert cfg.page_blocks == 64 and cfg.num_pages == 8 and cfg.memory_bytes == 17 * MiB
    assert cfg.kv_blocks == 17 * MiB // block and cfg.checkpoint_slots == 8  # each kind could take it all


def test_sweep_runs_fixed_splits_of_the_same_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    doc = main([*COMMON, "--memory-mb", "16", "--policies", "default,oracle", "--sweep", "2MB,6MB,10MB"])
    out = capsys.readouterr().out
    entry = doc["workloads"]["chat"]
    default, oracle = entry["results"]
    assert default["checkpoint_share"] is not None and oracle["checkpoint_share"] is None
    for slots, rows in entry["splits"].items():
        fixed = next(r for r in rows if r["policy"] == "default")
        assert fixed["checkpoint_share"] is None and fixed["checkpoint_slots"] == int(slots)
        assert fixed["kv_mb"] + fixed["checkpoint_mb"] == pytest.approx(16, abs=0.1)
    top = max(
        (next(r for r in rows if r["policy"] == "default") for rows in entry["splits"].values()),
        key=lambda r: r["hit_rate"],
    )
    assert entry["one_budget_vs_best"] == {
        "default": {
            "one_budget": default["hit_rate"],
            "best_fixed": top["hit_rate"],
            "ratio": default["hit_rate"] / top["hit_rate"],
            # what each computed, recomputation after preemptions included
            "computed_ratio": default["tokens_computed"] / top["tokens_computed"],
        }
    }
    assert f"computing {default['tokens_computed']} tokens vs its {top['tokens_computed']}" in out
    assert "one budget of 16 MiB vs fixed splits of the same bytes" in out and "oracle: one budget" not in out
