"""The cache-policy simulator: torch-free, deterministic, and its oracle bounds every policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.tools.simulate_cache import (
    SimConfig,
    compare_policies,
    main,
    parse_budget,
    simulate,
)
from deltaserve.tools.workloads import ArrivalParams, Codec, WorkloadParams, make_workload, workload_names

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ["interval", "step-end", "sequence-end", "default", "every-unit", "none", "oracle"]
TINY = {
    "chat": {"sessions": 3, "turns": 3, "prefix_len": 70, "prompt_len": 30, "output_len": 24},
    "shared-prefix": {"num_requests": 8, "prefix_len": 200, "prompt_len": 30, "output_len": 8},
    "prefix-repetition": {"num_prefixes": 3, "suffixes_per_prefix": 3, "prefix_len": 150, "prompt_len": 30, "output_len": 8},
    "shifted-prefix": {"num_requests": 6, "prefix_len": 150, "prompt_len": 80, "output_len": 8},
    "agent": {"sessions": 2, "turns": 4, "prefix_len": 80, "prompt_len": 30, "output_len": 24, "tool_len": 40},
    "random": {"num_requests": 6, "prompt_len": 100, "output_len": 8},
}  # fmt: skip


def test_simulator_never_imports_torch(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['simulate_cache.py', '--workload', 'chat,agent', '--sessions', '2', '--turns', '2',"
        f" '--checkpoint-slots', '2', '--sweep', '1,2', '--json', {str(out)!r}]\n"
        f"runpy.run_path({str(ROOT / 'tools' / 'simulate_cache.py')!r}, run_name='__main__')\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'transformers')\n"
        "assert not bad, bad\n"
        "print('NO_TORCH_OK')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "NO_TORCH_OK" in res.stdout
    doc = json.loads(out.read_text())
    assert set(doc["workloads"]) == {"chat", "agent"}
    assert set(doc["workloads"]["chat"]["sweep"]) == {"1", "2"}


@pytest.mark.parametrize("name", list(TINY))
def test_oracle_is_an_upper_bound(name: str, tiny_codec: Codec) -> None:
    w = make_workload(WorkloadParams(name=name, **TINY[name]), tiny_codec)  # type: ignore[arg-type]
    for slots, kv_blocks, arrival, check in [
        (0, 4096, ArrivalParams(), False),
        (1, 4096, ArrivalParams(concurrency=2), False),
        (3, 4096, ArrivalParams(rate=20.0), False),
        (2, 120, ArrivalParams(), True),  # KV pressure: evictions, maybe preemptions
        (16, 4096, ArrivalParams(concurrency=1), False),
    ]:
        engine = EngineConfig.load(
            None, {"scheduler.max_num_batched_tokens": 256, "cache.checkpoint_interval": 128}
        )
        cfg = SimConfig(checkpoint_slots=slots, kv_blocks=kv_blocks, engine=engine, check_integrity=check)
        results = compare_policies(w, POLICIES, cfg, arrival)
        oracle = results[-1]
        assert oracle.policy == "oracle" and oracle.checkpoints_evicted == 0 and oracle.kv_evicted_blocks == 0
        for r in results:
            assert r.requests == w.expected_requests() and r.rejected == 0
            assert r.hit_rate <= oracle.hit_rate + 1e-12, (name, slots, kv_blocks, arrival, r.policy)
        by = {r.policy: r for r in results}
        assert by["none"].hit_rate == 0.0
        if name != "random":
            assert oracle.hit_rate > 0.2
        else:
            assert oracle.hit_rate == 0.0


def test_policies_see_the_same_requests_and_are_deterministic(tiny_codec: Codec) -> None:
    w = make_workload(WorkloadParams(name="chat", **TINY["chat"]), tiny_codec)  # type: ignore[arg-type]
    cfg = SimConfig(
        checkpoint_slots=2, engine=EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 256})
    )
    a = [r.to_dict() for r in compare_policies(w, POLICIES, cfg, ArrivalParams())]
    b = [r.to_dict() for r in compare_policies(w, POLICIES, cfg, ArrivalParams())]
    for x in a + b:
        x.pop("wall_s")
    assert a == b
    assert len({x["prompt_tokens"] for x in a}) == 1
    # more checkpoint memory never hurts the project's default policy on a chat workload
    rates = [
        simulate(w, "default", SimConfig(checkpoint_slots=s), ArrivalParams()).hit_rate for s in (0, 2, 64)
    ]
    assert rates[0] == 0.0 and rates[0] <= rates[1] <= rates[2]


def test_unknown_policy(tiny_codec: Codec) -> None:
    w = make_workload(WorkloadParams(name="random", num_requests=2), tiny_codec)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(w, "bogus", SimConfig(), ArrivalParams())


def test_parse_budget() -> None:
    mib = 1024**2
    assert parse_budget("8", 50 * mib) == 8
    assert parse_budget("400MB", 50 * mib) == 8
    assert parse_budget("1GiB", 50 * mib) == 20
    assert parse_budget("0.5gb", 50 * mib) == 10
    with pytest.raises(ValueError):
        parse_budget("lots", 50 * mib)


def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "sim.json", tmp_path / "sim.png"
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": i * 0.1, "prompt": "The cat reads a story. " * 60,
                                           "max_tokens": 4}) for i in range(4)))  # fmt: skip
    doc = main([
        "--workload", "shared-prefix,trace", "--trace", str(trace), "--num-requests", "4", "--prefix-len", "150",
        "--prompt-len", "20", "--output-len", "4", "--concurrency", "1", "--checkpoint-mb", "100", "--kv-mb", "64",
        "--set", "cache.block_size=32", "--sweep", "1,100MB", "--json", str(js), "--plot", str(png),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "shared-prefix" in out and "vs oracle" in out and "sweep over checkpoint budgets" in out
    saved = json.loads(js.read_text())
    assert saved == json.loads(json.dumps(doc))
    assert saved["sim_config"]["engine"]["cache"]["block_size"] == 32
    assert saved["sim_config"]["checkpoint_slots"] == 2
    assert saved["sim_config"]["kv_blocks"] == 64 * 1024**2 // (32 * 1024 * 32)
    res = saved["workloads"]["shared-prefix"]["results"]
    assert [r["policy"] for r in res] == ["interval", "step-end", "sequence-end", "default", "oracle"]
    assert res[-1]["oracle_ratio"] == 1.0
    assert saved["workloads"]["trace"]["results"][-1]["hit_rate"] > 0.5  # repeated text
    assert png.stat().st_size > 10_000
    assert workload_names("all") == [
        "chat",
        "shared-prefix",
        "prefix-repetition",
        "shifted-prefix",
        "agent",
        "random",
    ]
