"""The simulator's disk tier (``tools/sim/disk.py``): the in-memory store evicts by value per
byte, leaves first; reads take their bytes over the bandwidth in simulated time; a run whose
reuse outgrows device and host memory hits on disk, and never without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.cache.types import DiskItemKind
from deltaserve.engine.config import EngineConfig
from deltaserve.tools.sim.cli import build_parser, main, sim_config_from_args, simulate
from deltaserve.tools.sim.disk import SimReader, SimStore
from deltaserve.tools.sim.simulation import GiB, MiB, SimConfig
from deltaserve.tools.workloads import ArrivalParams, Codec, WorkloadParams, make_workload

KV, CKPT = DiskItemKind.KV, DiskItemKind.CHECKPOINT


def _store(capacity: int = 100) -> SimStore:
    return SimStore(capacity, kv_block_bytes=10, checkpoint_bytes=20)


def _put(s: SimStore, kind: DiskItemKind, key: int, parent: int, cost: float = 0.0) -> bool:
    ok = s.put(kind, key, parent, b"x", cost)  # the payload is not what is accounted
    s.check_integrity()
    return ok


def _held(s: SimStore) -> set[tuple[str, int]]:
    return {(k.name, key) for k, key in s.items}


def test_eviction_is_by_value_per_byte_and_leaves_first() -> None:
    s = _store(100)
    # A: KV 1 -> 2 with a checkpoint on 2 worth 400 tokens over 40 bytes (its own path): 10/byte
    assert _put(s, KV, 1, 0) and _put(s, KV, 2, 1) and _put(s, CKPT, 2, 2, 400.0)
    # B: KV 11 with a checkpoint worth 60 over 30 bytes: 2/byte
    assert _put(s, KV, 11, 0) and _put(s, CKPT, 11, 11, 60.0)
    # C: a KV block with no checkpoint on or below it: worth nothing, though the newest
    assert _put(s, KV, 21, 0)
    assert s.used == 80 and _put(s, KV, 31, 0) and s.used == 90
    # D's checkpoint (1000 / 30 bytes) needs 20 bytes: the KV leaf goes, not the oldest item
    assert _put(s, CKPT, 31, 31, 1000.0)
    assert _held(s) == {("KV", 1), ("KV", 2), ("CHECKPOINT", 2), ("KV", 11), ("CHECKPOINT", 11),
                        ("KV", 31), ("CHECKPOINT", 31)}  # fmt: skip
    assert s.inflation == 0.0 and s.counters["evicted_items"] == 1
    # the lowest value per byte goes next (B's checkpoint), and L rises to it
    assert _put(s, KV, 41, 0)
    assert not s.has(CKPT, 11) and s.has(KV, 11) and s.inflation == pytest.approx(2.0)
    # B's KV block is a leaf now, worth L: it goes before any checkpoint
    assert _put(s, CKPT, 41, 41, 10.0)
    assert not s.has(KV, 11) and s.has(CKPT, 2) and s.inflation == pytest.approx(2.0)
    # a later checkpoint starts from the inflated L: 41's (2 + 10/30) is the cheapest now, and
    # its bare KV block follows it
    assert _put(s, KV, 51, 0) and not s.has(CKPT, 41) and s.has(KV, 41)
    assert _put(s, CKPT, 51, 51, 3000.0) and not s.has(KV, 41)
    # then A's checkpoint (10 per byte), not D's (33) nor E's (2.3 + 100)
    assert _put(s, KV, 61, 0)
    assert not s.has(CKPT, 2) and s.has(CKPT, 31) and s.has(CKPT, 51) and s.inflation == pytest.approx(10.0)
    # A's KV blocks go from the leaf up, each once nothing depends on it
    assert s.has(KV, 1) and s.has(KV, 2)
    assert _put(s, KV, 62, 61) and _put(s, KV, 63, 62)
    assert not s.has(KV, 2) and s.has(KV, 1)
    assert _put(s, KV, 64, 63) and not s.has(KV, 1) and s.counters["evicted_items"] == 8


def test_a_read_raises_an_items_rank_and_returns_its_size() -> None:
    s = _store(70)
    for key in (1, 2):
        assert _put(s, KV, key, 0) and _put(s, CKPT, key, key, 30.0)  # equal worth per byte
    data = s.read(CKPT, 1)
    assert data is not None and len(data) == 20  # the model's size, not what was put
    assert s.counters["bytes_read"] == 20 and s.read(CKPT, 99) is None
    assert _put(s, KV, 3, 0) and _put(s, CKPT, 3, 3, 1000.0)  # needs 20 bytes: one checkpoint goes
    assert s.has(CKPT, 1) and not s.has(CKPT, 2) and s.has(KV, 2)  # the unread one
    assert _put(s, KV, 4, 0) and not s.has(KV, 2) and s.has(CKPT, 1)  # then its bare KV block


def test_refusals_are_counted_and_leave_the_store_intact() -> None:
    s = _store(50)
    assert not _put(s, KV, 5, 4)  # its parent is not stored: it could never be reached
    assert s.counters["orphans_refused"] == 1
    assert not SimStore(15, kv_block_bytes=10, checkpoint_bytes=20).put(CKPT, 1, 0, b"", 1.0)
    assert _put(s, KV, 1, 0) and not _put(s, KV, 1, 0)  # already there
    # a chain longer than the store: its own parent is never the victim, so the tail is dropped
    for key in range(2, 7):
        _put(s, KV, key, key - 1)
    assert [k for _, k in s.items] == [1, 2, 3, 4, 5] and s.counters["queue_drops"] == 1
    assert s.stats()["disk.bytes"] == 50 and s.stats()["disk.items"] == 5
    with pytest.raises(ValueError, match="must be > 0"):
        SimStore(0, kv_block_bytes=10, checkpoint_bytes=20)


def test_reads_finish_on_the_simulated_clock_one_at_a_time() -> None:
    s = _store(1000)
    _put(s, KV, 1, 0)
    _put(s, CKPT, 1, 1, 5.0)
    now = [10.0]
    reader = SimReader(s, read_bytes_per_s=10.0, clock=lambda: now[0])
    a = reader.submit(lambda: (s.read(KV, 1), s.read(CKPT, 1)))  # 30 bytes: 3 s
    b = reader.submit(s.read, KV, 1)  # 10 bytes, after a: done at 14 s
    assert not a.done() and reader.next_due == pytest.approx(13.0)
    reader.advance(12.9)
    assert not a.done()
    reader.advance(13.0)
    assert a.done() and not b.done() and reader.next_due == pytest.approx(14.0)
    reader.advance(20.0)
    assert b.done() and b.result() is not None and reader.next_due is None
    assert reader.busy_s == pytest.approx(4.0)


CHAT = ["--workload", "chat", "--sessions", "12", "--turns", "4", "--prefix-len", "200",
        "--kv-mb", "4", "--checkpoint-slots", "2", "--checkpoint-bytes", str(2 * MiB),
        "--kv-bytes-per-token", "2048", "--host-memory-mb", "8", "--check"]  # fmt: skip


def test_reuse_beyond_device_and_host_hits_on_disk(capsys: pytest.CaptureFixture[str]) -> None:
    """12 conversations take turns; a turn hits through its checkpoint (2 MiB) and its KV
    (about 1.5 MiB), some 40 MiB in all over 16 MiB of device and host: the disk holds them."""
    off = main([*CHAT, "--policies", "default"])
    on = main([*CHAT, "--policies", "default,oracle", "--disk-gb", "0.0625"])
    out = capsys.readouterr().out
    (without,) = off["workloads"]["chat"]["results"]
    default, oracle = on["workloads"]["chat"]["results"]
    assert without["hit_tokens_disk"] == 0 and without["disk_bytes_written"] == 0
    assert default["hit_tokens_disk"] > 0 and default["disk_fetches"] > 0
    assert default["hit_rate"] > without["hit_rate"] + 0.1
    assert default["prompt_tokens"] == without["prompt_tokens"]
    # reads cover what was hit (KV 32 KiB per 16-token block, 2 MiB per checkpoint)
    assert default["disk_bytes_read"] >= default["hit_tokens_disk"] // 16 * 32 * 1024
    assert 0 < default["disk_bytes_written"] <= 64 * MiB + default["disk_evicted_items"] * 2 * MiB
    assert oracle["hit_tokens_disk"] == 0  # the oracle has no tiers
    bounds = on["workloads"]["chat"]["bounds"]
    assert bounds["kv_lru_host"] <= bounds["kv_lru_disk"]
    assert on["summary"][0]["default_from_disk"] == pytest.approx(
        default["hit_tokens_disk"] / default["prompt_tokens"]
    )
    assert "disk tier 0.0625 GiB, read 2 GB/s, writes 1000 MB/s" in out and "from disk" in out
    assert "KV LRU +disk" in out


def test_a_slow_disk_makes_requests_wait_for_their_reads(tiny_codec: Codec) -> None:
    w = make_workload(
        WorkloadParams(name="chat", sessions=6, turns=3, prefix_len=200, prompt_len=30, output_len=16),
        tiny_codec,
    )
    base = SimConfig(
        kv_blocks=48, checkpoint_slots=1, checkpoint_bytes=2 * MiB, kv_bytes_per_token=2048,
        engine=EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 256}),
        disk_bytes=GiB // 16, check_integrity=True,
    )  # fmt: skip
    fast = simulate(w, "default", base, ArrivalParams(concurrency=3))
    again = simulate(w, "default", base, ArrivalParams(concurrency=3))
    slow = simulate(
        w, "default", SimConfig(**{**base.__dict__, "disk_read_gbps": 0.001}), ArrivalParams(concurrency=3)
    )
    assert fast.hit_tokens_disk > 0 and slow.hit_tokens_disk > 0
    assert {**fast.to_dict(), "wall_s": 0} == {**again.to_dict(), "wall_s": 0}  # deterministic
    # 1 MB/s: each read takes seconds of simulated time, and the requests wait for them
    assert fast.disk_read_wait_s < 0.1 * fast.disk_fetches
    assert slow.disk_read_wait_s > 1.0 * slow.disk_fetches and slow.sim_time_s > fast.sim_time_s


def test_disk_flags(tmp_path: Path) -> None:
    cfg = sim_config_from_args(
        build_parser().parse_args(["--disk-gb", "1.5", "--disk-read-gbps", "3", "--disk-write-mbps", "200"])
    )
    assert (cfg.disk_bytes, cfg.disk_read_gbps, cfg.disk_write_mbps) == (3 * GiB // 2, 3.0, 200.0)
    block = cfg.block_size * cfg.kv_bytes_per_token
    assert cfg.all_tiers_kv_blocks == cfg.combined_kv_blocks + 3 * GiB // 2 // block
    assert sim_config_from_args(build_parser().parse_args([])).disk_bytes == 0
    with pytest.raises(SystemExit):
        main(["--disk-gb", "-1"])
    with pytest.raises(SystemExit):
        main(["--disk-read-gbps", "0"])
    js = tmp_path / "s.json"
    main(["--workload", "chat", "--sessions", "2", "--turns", "2", "--policies", "default", "--disk-gb", "1",
          "--json", str(js)])  # fmt: skip
    assert json.loads(js.read_text())["sim_config"]["disk_bytes"] == GiB
