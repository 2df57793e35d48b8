"""The cache-policy simulator: torch-free, deterministic, and its oracle bounds every policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.tools.sim.cli import (
    SimConfig,
    build_parser,
    compare_policies,
    main,
    parse_budget,
    sim_config_from_args,
    simulate,
)
from deltaserve.tools.workloads import ArrivalParams, Codec, WorkloadParams, make_workload, workload_names

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ["interval", "step-end", "sequence-end", "v1", "default", "every-unit", "none", "oracle"]
TINY = {
    "chat": {"sessions": 3, "turns": 3, "prefix_len": 70, "prompt_len": 30, "output_len": 24},
    "shared-prefix": {"num_requests": 8, "prefix_len": 200, "prompt_len": 30, "output_len": 8},
    "prefix-repetition": {"num_prefixes": 3, "suffixes_per_prefix": 3, "prefix_len": 150, "prompt_len": 30, "output_len": 8},
    "shifted-prefix": {"num_requests": 6, "prefix_len": 150, "prompt_len": 80, "output_len": 8},
    "agent": {"sessions": 2, "turns": 4, "prefix_len": 80, "prompt_len": 30, "output_len": 24, "tool_len": 40},
    "random": {"num_requests": 6, "prompt_len": 100, "output_len": 8},
    "multi-turn": {"sessions": 4, "turns": 3, "prefix_len": 70, "session_prefix_len": 60, "prompt_len": 30, "output_len": 16},
    "swe-agent": {"sessions": 2, "turns": 4, "min_turns": 3, "prefix_len": 90, "prompt_len": 30, "output_len": 24, "tool_len": 40},
    "tree": {"sessions": 2, "prefix_len": 40, "prompt_len": 60, "output_len": 24, "branches": 3, "depth": 2},
    "tenants": {"sessions": 8, "tenants": 2, "volatile_every": 2, "prefix_len": 100, "prompt_len": 20, "output_len": 8},
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
    assert [r["policy"] for r in res] == ["interval", "step-end", "sequence-end", "v1", "default", "oracle"]
    assert res[-1]["oracle_ratio"] == 1.0
    assert "summary (" in out and "def/KV-LRU" in out and "smallest checkpoint pool reaching 90%" in out
    assert [r["workload"] for r in saved["summary"]] == ["shared-prefix", "trace"]
    assert set(saved["workloads"]["shared-prefix"]["recommended_slots"]) == {
        "interval", "step-end", "sequence-end", "v1", "default",
    }  # fmt: skip
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


def test_bounds_bracket_the_policies(tiny_codec: Codec) -> None:
    """KV-only LRU <= KV-only Belady; the oracle bounds the simulated policies; more KV never
    lowers the KV bounds."""
    from deltaserve.tools.sim.cli import offline_bounds

    w = make_workload(WorkloadParams(name="chat", **TINY["chat"]), tiny_codec)  # type: ignore[arg-type]
    engine = EngineConfig.load(None, {"scheduler.max_num_batched_tokens": 256})
    prev = None
    for kv_blocks in (40, 80, 4096):
        cfg = SimConfig(checkpoint_slots=2, kv_blocks=kv_blocks, engine=engine)
        results = compare_policies(w, ["v1", "default", "oracle"], cfg, ArrivalParams())
        b = offline_bounds(results[-1], cfg)
        assert 0 <= b.kv_lru <= b.kv_belady + 1e-12 <= 1
        assert 0 <= b.checkpoint_belady <= results[-1].hit_rate + 1e-12
        assert all(r.hit_rate <= results[-1].hit_rate + 1e-12 for r in results)
        if prev is not None:
            assert b.kv_lru >= prev.kv_lru - 1e-12 and b.kv_belady >= prev.kv_belady - 1e-12
        prev = b
    assert prev is not None and prev.kv_belady == pytest.approx(prev.kv_lru)  # ample: both are exact


def test_model_path_supplies_sizes_and_seeds_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltaserve.tools.sim.model_sizes import model_sizes, sizes_from_config

    tiny = model_sizes("builtin:tiny-qwen3.5")
    # 2 attention layers x K,V x 2 KV heads x 64 x bf16; 6 GDN layers x (conv 512 x 3 bf16 + 4x64x64 fp32)
    assert tiny.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert tiny.checkpoint_bytes == 6 * (512 * 3 * 2 + 4 * 64 * 64 * 4)
    qwen35_4b = {
        "text_config": {
            "num_hidden_layers": 32, "full_attention_interval": 4, "hidden_size": 2560, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "intermediate_size": 9216, "vocab_size": 248320,
        }
    }  # fmt: skip
    big = sizes_from_config(qwen35_4b)
    assert big.kv_bytes_per_token == 32 * 1024  # the simulator's default sizes are this model's
    assert 48 * 2**20 < big.checkpoint_bytes < 52 * 2**20
    # a bfloat16 recurrent state (configured, or the config's own mamba_ssm_dtype under auto)
    # halves the state: 48 MiB of the 4B's checkpoint
    half = sizes_from_config(qwen35_4b, ssm_state_dtype="bfloat16")
    assert big.checkpoint_bytes - half.checkpoint_bytes == 24 * 2**20
    named = {"text_config": {**qwen35_4b["text_config"], "mamba_ssm_dtype": "bfloat16"}}
    assert sizes_from_config(named) == half
    assert sizes_from_config(named, ssm_state_dtype="float32") == big
    js = tmp_path / "s.json"
    main([
        "--workload", "chat", "--sessions", "2", "--turns", "2", "--seeds", "3,4", "--policies", "v1,default,oracle",
        "--set", "model.path=builtin:tiny-qwen3.5", "--kv-mb", "1", "--checkpoint-mb", "2", "--json", str(js),
    ])  # fmt: skip
    saved = json.loads(js.read_text())
    sim = saved["sim_config"]
    assert (
        sim["kv_bytes_per_token"] == tiny.kv_bytes_per_token
        and sim["checkpoint_bytes"] == tiny.checkpoint_bytes
    )
    assert sim["checkpoint_slots"] == 2 * 2**20 // tiny.checkpoint_bytes
    assert sim["kv_blocks"] == 2**20 // (tiny.kv_bytes_per_token * 16)
    assert sim["prefill_cost"] == [tiny.prefill_flops_per_token, tiny.prefill_flops_per_token_pair]
    assert set(saved["workloads"]) == {"chat:3", "chat:4"}
    assert [(r["workload"], r["seed"]) for r in saved["summary"]] == [("chat", 3), ("chat", 4)]
    assert "builtin:tiny-qwen3.5: 2 attention + 6 GDN layers" in capsys.readouterr().out


def test_mooncake_trace_through_the_simulator(tmp_path: Path) -> None:
    trace = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1200 + 40 * i, "output_length": 4, "hash_ids": [0, 1, 2 + i % 2]}
            for i in range(6)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    doc = main(["--workload", "trace", "--trace", str(trace), "--policies", "v1,default,oracle", "--check"])
    res = {r["policy"]: r for r in doc["workloads"]["trace"]["results"]}
    assert res["oracle"]["requests"] == 6 and res["oracle"]["hit_rate"] > 0.5
    assert doc["workloads"]["trace"]["bounds"]["kv_lru"] > 0.5


def test_the_bound_over_both_tiers_counts_one_device_budget_once() -> None:
    mib = 1024**2
    cfg = sim_config_from_args(
        build_parser().parse_args(["--memory-mb", "2560", "--host-memory-mb", "10240"])
    )
    block = cfg.block_size * cfg.kv_bytes_per_token
    # the device's 2560 MiB as KV or as checkpoints, not both, and the host's 10240 MiB
    assert cfg.combined_kv_blocks * block == (2560 + 10200) * mib  # (the host in whole 50 MiB pages)
    fixed = sim_config_from_args(build_parser().parse_args(["--kv-mb", "2048", "--checkpoint-mb", "500"]))
    assert fixed.combined_kv_blocks * block == (2048 + 500) * mib


@pytest.mark.slow
def test_pressure_targets(tmp_path: Path) -> None:
    """The pressure table of docs/cache.md at KV 2 GiB / checkpoints 512 MiB (4B sizes), three seeds: over
    the seeds of each pressure shape the value model loses no more than 2 points to v1 and beats
    it; no single seed loses more than 3 (tenants, seed 0, with 10 checkpoint slots at block
    granularity: 39.6 vs 41.9 %, docs/cache.md); it reaches 0.9 x the KV-only LRU bound where
    checkpoints are not the binding limit (swe-agent), and 0.9 x the oracle when memory is ample."""
    doc = main(["--workload", "pressure", "--policies", "v1,default,oracle", "--kv-mb", "2048",
                "--checkpoint-mb", "512", "--seeds", "0,1,2", "--json", str(tmp_path / "p.json")])  # fmt: skip
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for row in doc["summary"]:
        by_shape.setdefault(row["workload"], []).append(row)
        assert row["default-v1"] > -0.03, row
        if row["workload"] == "swe-agent":
            assert row["default/kv_lru"] >= 0.9, row
    for shape, rows in by_shape.items():
        mean = sum(r["default-v1"] for r in rows) / len(rows)
        assert mean > 0, (shape, rows)
    doc = main(["--workload", "pressure", "--policies", "v1,default,oracle", "--kv-mb", "8192",
                "--checkpoint-mb", "2048", "--seeds", "0"])  # fmt: skip
    for row in doc["summary"]:
        if row["workload"] != "tenants":
            assert row["default/oracle"] >= 0.9, row


def test_host_tier_flags_raise_hits_and_cost_time(capsys: pytest.CaptureFixture[str]) -> None:
    """``--host-kv-mb`` / ``--host-checkpoint-mb`` add a host tier: at the same device pools the
    default policy hits more (some of it from the host), the copies cost virtual time at
    ``--h2d-gbps``, and the oracle is unaffected. Integrity is checked after every step."""
    common = ["--workload", "chat", "--num-requests", "24", "--policies", "default,oracle", "--check",
              "--kv-mb", "48", "--checkpoint-slots", "2", "--checkpoint-bytes", str(2 * 1024**2)]  # fmt: skip
    device = main(common)["workloads"]["chat"]["results"]
    host = main([*common, "--host-kv-mb", "512", "--host-checkpoint-mb", "64"])["workloads"]["chat"][
        "results"
    ]
    slow = main([*common, "--host-kv-mb", "512", "--host-checkpoint-mb", "64", "--h2d-gbps", "0.01"])
    assert "host tier KV 512 MiB" in capsys.readouterr().out
    assert host[0]["hit_tokens_host"] > 0 and host[0]["host_bytes_moved"] > 0
    assert host[0]["hit_rate"] > device[0]["hit_rate"]
    assert device[0]["hit_tokens_host"] == 0
    assert host[1]["hit_rate"] == device[1]["hit_rate"]  # the oracle has no host tier
    assert slow["workloads"]["chat"]["results"][0]["sim_time_s"] > host[0]["sim_time_s"]


def test_a_bfloat16_state_halves_the_default_checkpoint(tmp_path: Path) -> None:
    js = tmp_path / "s.json"
    main([
        "--workload", "chat", "--sessions", "2", "--turns", "2", "--policies", "default",
        "--set", "model.ssm_state_dtype=bfloat16", "--kv-mb", "64", "--checkpoint-mb", "260", "--json", str(js),
    ])  # fmt: skip
    sim = json.loads(js.read_text())["sim_config"]
    assert sim["checkpoint_bytes"] == 26 * 2**20 and sim["checkpoint_slots"] == 10
    assert "bfloat16 recurrent state" in sim["model"]
