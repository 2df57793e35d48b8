"""Where the simulator's prompt tokens went: the KV-LRU bound's own split (hit, compulsory,
capacity, granularity), the cache's miss causes in the JSON, and the printed table that sets
them side by side (the gap to the bound by cause)."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from deltaserve.cache.loss import MISS_CAUSES, QUERY_CAUSES
from deltaserve.engine.config import EngineConfig
from deltaserve.tools.sim.bounds import KvLruSplit, kv_only_lru, kv_only_lru_split
from deltaserve.tools.sim.cli import SimConfig, compare_policies, main
from deltaserve.tools.sim.report import Bounds, format_attribution, offline_bounds
from deltaserve.tools.sim.simulation import SimResult
from deltaserve.tools.workloads import ArrivalParams, Codec, WorkloadParams, make_workload

# three requests, blocks of 4 tokens, a KV pool of 4 blocks:
#   A: prompt 1..9, reply 10..13: computes 12 tokens, writes blocks A0 A1 A2 (A2 ends in its reply);
#      blocks past no hit up to its last usable one (8 = (9 - 1) // 4 * 4 tokens) are first
#      references: 8 compulsory; its 9th token: 1 granularity
#   B: prompt 1..8 20..27: hits A0 A1 (8); block 20..23 is new (4 compulsory); tail 24..27 (4
#      granularity); its 4 blocks need 2 free ones: LRU evicts the leaf A2
#   C: prompt 1..13 30 31 32 (A's conversation going on): hits A0 A1 (8); A2 was written and
#      evicted: 4 capacity; tail 4 granularity
A = (list(range(1, 10)), list(range(10, 14)))
B = (list(range(1, 9)) + list(range(20, 28)), [])
C = (list(range(1, 14)) + [30, 31, 32], [])


def test_kv_lru_split_of_a_hand_computed_case() -> None:
    split = kv_only_lru_split([A, B, C], kv_blocks=4, block_size=4)
    assert split == KvLruSplit(prompt=41, hit=16, compulsory=12, capacity=4, granularity=9)
    assert kv_only_lru([A, B, C], 4, 4) == pytest.approx(16 / 41)
    # with room for every block nothing is evicted: the capacity miss becomes a hit, the
    # compulsory misses and the granularity stay
    assert kv_only_lru_split([A, B, C], 8, 4) == KvLruSplit(41, 20, 12, 0, 9)
    # a request larger than the whole KV is computed without the cache: what was written
    # before counts as capacity, the rest as compulsory
    big = (list(range(1, 9)) + list(range(60, 76)), [])  # 24 tokens, 6 blocks > 4
    assert kv_only_lru_split([A, big], 4, 4) == KvLruSplit(9 + 24, 0, 8 + 12, 8, 1 + 4)


def test_kv_lru_split_must_sum_to_the_prompt() -> None:
    with pytest.raises(AssertionError, match="KV-LRU split sums to 40, prompt tokens are 41"):
        KvLruSplit(prompt=41, hit=16, compulsory=12, capacity=3, granularity=9)


def test_kv_lru_split_on_a_workload_sums_and_keeps_its_compulsory_misses(tiny_codec: Codec) -> None:
    """On a real workload at any KV size the parts sum to the prompt tokens (asserted on
    construction), the hit rate is ``kv_only_lru``'s, the first references do not depend on the
    KV size, and with ample KV there is no capacity miss."""
    w = make_workload(
        WorkloadParams(name="chat", sessions=3, turns=3, prefix_len=70, prompt_len=30, output_len=24),
        tiny_codec,
    )
    engine = EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 256})
    cfg = SimConfig(checkpoint_slots=2, kv_blocks=4096, engine=engine)
    served = compare_policies(w, ["oracle"], cfg, ArrivalParams())[0].served
    splits = [kv_only_lru_split(served, kv, 16) for kv in (20, 40, 4096)]
    prompt = sum(len(p) for p, _ in served)
    for kv, s in zip((20, 40, 4096), splits, strict=True):
        assert s.prompt == prompt and s.hit_rate == kv_only_lru(served, kv, 16)
        assert s.compulsory == splits[-1].compulsory and s.granularity == splits[-1].granularity
    assert splits[0].capacity > 0 and splits[-1].capacity == 0


def _result(policy: str, query: int, hit: int, **miss: int) -> SimResult:
    """A SimResult with only the counts the attribution table reads."""
    required = {f.name: 0 for f in fields(SimResult) if f.default is MISSING and f.default_factory is MISSING}
    required.update(workload="w", policy=policy, admission=policy, hit_rate_per_turn={})
    return SimResult(
        **required,  # type: ignore[arg-type]
        query_tokens=query,
        query_hit_tokens=hit,
        miss_tokens={c: miss.get(c, 0) for c in MISS_CAUSES},
    )


def _columns(text: str) -> list[dict[str, str]]:
    """The table of ``format_attribution`` as rows of {header: cell}, cut at the rule's dashes."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    header = lines[rule - 1]
    names = [header[spans[0][0] : spans[0][1]].strip()] + [header[a:b].strip() for a, b in spans[1:]]
    rows = []
    for line in lines[rule + 1 :]:
        if not line.startswith((" ", "KV-LRU", "default", "oracle", "v1")):
            break
        line = line.ljust(spans[-1][1])
        rows.append({n: line[a:b].strip() for n, (a, b) in zip(names, spans, strict=True)})
    return rows


def test_attribution_table_sets_the_runs_beside_the_bound() -> None:
    bounds = Bounds(kv_lru=0.5, kv_belady=0.6, checkpoint_belady=0.3, kv_lru_host=0.7)
    bounds.kv_lru_split = KvLruSplit(prompt=1000, hit=700, compulsory=150, capacity=100, granularity=50)
    bounds.kv_lru_split_over = "the memory tiers' bytes"
    default = _result(
        "default", 1000, 400, cold=150, kv_evicted_device=100, kv_evicted_host=250, checkpoint_evicted=40,
        granularity=60, preemption=30,
    )  # fmt: skip
    text = format_attribution([default], bounds)
    lines = text.splitlines()
    assert lines[0] == (
        "prompt tokens by outcome (% of each run's prompt tokens looked up; KV-LRU bound: KV alone, LRU, "
        "over the memory tiers' bytes):"
    )
    rows = _columns(text)
    # columns without tokens in any row (ckpt never / skipped, in flight, given up, logprobs, disk) are left out
    assert list(rows[0]) == ["run", "hit", "cold", "KV evicted", "dev", "host", "ckpt evicted", "granularity",
                             "preempt*"]  # fmt: skip
    assert rows == [
        {"run": "KV-LRU bound", "hit": "70.0", "cold": "15.0", "KV evicted": "10.0", "dev": "-", "host": "-",
         "ckpt evicted": "0", "granularity": "5.0", "preempt*": "-"},
        {"run": "default", "hit": "40.0", "cold": "15.0", "KV evicted": "35.0", "dev": "10.0", "host": "25.0",
         "ckpt evicted": "4.0", "granularity": "6.0", "preempt*": "3.0"},
        # ours minus the bound per column: the hit's 30 points lost are the rest of the row
        {"run": "- bound", "hit": "-30.0", "cold": "0", "KV evicted": "+25.0", "dev": "", "host": "",
         "ckpt evicted": "+4.0", "granularity": "+1.0", "preempt*": ""},
    ]  # fmt: skip
    assert len(lines) == 2 + 3 + 2 + 1  # title, header + rule, rows, two legend lines
    assert lines[-2].startswith("cold: never cached (bound: compulsory)")
    assert "preempt*: recomputed after a preemption, not in the sum" in lines[-1]
    # without a bound: the runs alone; a device-only run shows no tier columns
    alone = _columns(
        format_attribution([_result("v1", 100, 90, cold=6, kv_evicted_device=2, granularity=2)], None)
    )
    assert alone == [{"run": "v1", "hit": "90.0", "cold": "6.0", "KV evicted": "2.0", "granularity": "2.0"}]
    assert format_attribution([_result("v1", 0, 0)], None) == ""  # nothing looked up: no table


def test_json_carries_the_causes_and_the_table_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "sim.json"
    main([
        "--workload", "chat", "--num-requests", "24", "--policies", "default,oracle", "--check", "--kv-mb", "48",
        "--checkpoint-slots", "2", "--checkpoint-bytes", str(2 * 1024**2), "--host-kv-mb", "512",
        "--host-checkpoint-mb", "64", "--json", str(js),
    ])  # fmt: skip
    out = capsys.readouterr().out
    doc = json.loads(js.read_text())["workloads"]["chat"]
    for r in doc["results"]:
        assert list(r["miss_tokens"]) == list(MISS_CAUSES)
        assert sum(r["miss_tokens"][c] for c in QUERY_CAUSES) == r["query_tokens"] - r["query_hit_tokens"]
        # every request is looked up once, whole, at its first admission
        assert r["query_tokens"] == r["prompt_tokens"] and r["query_hit_tokens"] == r["hit_tokens"]
    default, oracle = doc["results"]
    assert default["query_tokens"] > default["query_hit_tokens"] > 0
    assert sum(default["miss_tokens"][c] for c in ("kv_evicted_device", "kv_evicted_host")) > 0
    assert oracle["miss_tokens"]["kv_evicted_device"] == oracle["miss_tokens"]["checkpoint_evicted"] == 0
    split = doc["bounds"]["kv_lru_split"]  # the widest KV-LRU bound: both memory tiers' bytes
    assert split["prompt"] == oracle["prompt_tokens"]
    assert split["hit"] + split["compulsory"] + split["capacity"] + split["granularity"] == split["prompt"]
    assert split["hit"] / split["prompt"] == pytest.approx(doc["bounds"]["kv_lru_host"])
    assert doc["bounds"]["kv_lru_split_over"] == "the memory tiers' bytes"
    table = out[out.index("prompt tokens by outcome") :]
    rows = {r["run"]: r for r in _columns(table) if r["run"] != "- bound"}
    assert set(rows) == {"KV-LRU bound", "default", "oracle"}
    assert table.count("\n  - bound ") == 2
    shown = [h for h in rows["default"] if h not in ("run", "dev", "host", "disk", "preempt*")]
    for run, row in rows.items():
        assert sum(float(row[h]) for h in shown) == pytest.approx(100, abs=0.3), run
    assert float(rows["KV-LRU bound"]["hit"]) == pytest.approx(100 * doc["bounds"]["kv_lru_host"], abs=0.05)
    assert float(rows["KV-LRU bound"]["cold"]) == pytest.approx(
        100 * split["compulsory"] / split["prompt"], abs=0.05
    )
    # the lines before the table are those the simulator printed without it
    assert out.index("bounds: KV alone LRU") < out.index("prompt tokens by outcome") < out.index("summary (")


def test_offline_bounds_split_the_widest_kv_bound(tiny_codec: Codec) -> None:
    w = make_workload(
        WorkloadParams(name="chat", sessions=3, turns=3, prefix_len=70, prompt_len=30, output_len=24),
        tiny_codec,
    )
    engine = EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 256})
    device = SimConfig(checkpoint_slots=2, kv_blocks=20, engine=engine)
    oracle = compare_policies(w, ["oracle"], device, ArrivalParams())[0]
    b = offline_bounds(oracle, device)
    assert b.kv_lru_split_over == "the device KV" and b.kv_lru_split.hit_rate == b.kv_lru
    host = SimConfig(checkpoint_slots=2, kv_blocks=20, engine=engine, host_kv_blocks=200)
    b = offline_bounds(oracle, host)
    assert b.kv_lru_split_over == "the memory tiers' bytes" and b.kv_lru_split.hit_rate == b.kv_lru_host
    assert b.kv_lru_host is not None and b.kv_lru_host > b.kv_lru
    assert "kv_lru_split" not in b.rates() and set(b.rates()) == set(Bounds.RATES)
