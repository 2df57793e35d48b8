"""``--host-memory-mb``: one host budget for KV and checkpoints in the simulator, and the
KV-only LRU bound over every byte of both tiers."""

from __future__ import annotations

import pytest

from deltaserve.tools.sim.cli import build_parser, main, sim_config_from_args
from deltaserve.tools.sim.simulation import MiB

COMMON = ["--workload", "chat", "--sessions", "12", "--turns", "4", "--prefix-len", "200",
          "--kv-mb", "4", "--checkpoint-slots", "2", "--checkpoint-bytes", str(2 * MiB),
          "--kv-bytes-per-token", "2048", "--policies", "default,oracle", "--check"]  # fmt: skip


def test_host_memory_is_pages_of_one_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = sim_config_from_args(build_parser().parse_args([*COMMON, "--host-memory-mb", "41"]))
    assert cfg.host_pages == 20 and cfg.host_bytes == 40 * MiB  # whole pages of 2 MiB
    assert cfg.host_kv_blocks == 0 and cfg.host_checkpoint_slots == 0
    block = cfg.block_size * cfg.kv_bytes_per_token
    assert cfg.combined_kv_blocks == (4 * MiB + 4 * MiB + 40 * MiB) // block
    doc = main([*COMMON, "--host-memory-mb", "64"])
    out = capsys.readouterr().out
    assert "host tier 32 pages x 2 MiB (KV or checkpoints)" in out and "KV LRU all tiers" in out
    default, oracle = doc["workloads"]["chat"]["results"]
    assert default["hit_tokens_host"] > 0 and default["host_bytes_moved"] > 0
    bounds = doc["workloads"]["chat"]["bounds"]
    assert bounds["kv_lru"] <= bounds["kv_lru_host"]  # more bytes, the same LRU
    assert oracle["hit_tokens_host"] == 0
    row = doc["summary"][0]
    assert row["default/kv_lru_host"] == pytest.approx(default["hit_rate"] / bounds["kv_lru_host"])


def test_no_host_tier_no_host_bound() -> None:
    doc = main(COMMON)
    assert doc["workloads"]["chat"]["bounds"]["kv_lru_host"] is None
    assert doc["summary"][0]["default/kv_lru_host"] is None


def test_host_memory_is_not_given_with_the_fixed_pair() -> None:
    with pytest.raises(SystemExit):
        main([*COMMON, "--host-memory-mb", "64", "--host-kv-mb", "32"])
