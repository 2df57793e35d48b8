"""tools/bench/bench_restart.py: a restarted engine's turn 2 is served from disk, outputs unchanged."""

from __future__ import annotations

from deltaserve.tools.bench import bench_restart


def test_restart_bench_serves_turn_two_from_disk() -> None:
    args = bench_restart.build_parser().parse_args(
        ["--conversations", "2", "--prefix-len", "200", "--output-len", "4", "--memory-mb", "256"]
    )
    result = bench_restart.run(args)  # (asserts the disk-warm outputs equal the cold ones)
    assert result["hit_tokens_disk"] >= 2 * 192  # both conversations, whole checkpoint units
    assert result["store_opened"]["items"] > 0
    assert len(result["cold_ttft_ms"]) == len(result["disk_warm_ttft_ms"]) == 2
    # the two engines ran as interleaved pairs: one measure per conversation on each
    assert result["cold_ttft_spread_ms"]["n"] == result["disk_warm_ttft_spread_ms"]["n"] == 2
