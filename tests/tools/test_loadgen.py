"""loadgen end to end on the built-in tiny model: a few requests, every JSON field present."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.tools import loadgen
from deltaserve.tools.metrics import TABLE_ROWS, RequestRecord, lookup
from deltaserve.tools.workloads import HFCodec, TokenizersCodec

QUIET = ["--no-progress", "--log-level", "warning", "--set", "logging.stats_interval_s=60"]


def test_end_to_end_json_has_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "run.json", tmp_path / "run.png"
    argv = [
        "--workload", "chat", "--sessions", "2", "--turns", "2", "--prefix-len", "80", "--prompt-len", "16",
        "--output-len", "8", "--think-time", "0.01", "--seed", "3", "--baseline", "hf",
        "--set", "scheduler.max_num_batched_tokens=256", "--json", str(js), "--plot", str(png), *QUIET,
    ]  # fmt: skip
    runs = loadgen.main(argv)
    out = capsys.readouterr().out
    assert "workload chat" in out and out.count("TTFT p99") == 1
    header = next(line for line in out.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "engine", "hf", "/engine"]
    assert [r.label for r in runs] == ["engine", "hf"]

    doc = json.loads(js.read_text())
    assert set(doc) >= {"tool", "created", "argv", "workload", "arrivals", "runs", "comparison"}
    assert doc["argv"] == argv
    params = doc["workload"]["params"]
    assert doc["workload"]["name"] == "chat"
    assert params["sessions"] == 2 and params["turns"] == 2 and params["prefix_len"] == 80
    assert params["output_len"] == 8 and params["seed"] == 3 and params["expected_requests"] == 4
    assert doc["arrivals"]["mode"] == "closed"

    engine, hf = doc["runs"]
    assert engine["label"] == "engine" and engine["backend"] == "engine"
    assert set(engine["config"]) == set(EngineConfig.__struct_fields__)  # every section, as run
    assert engine["config"]["scheduler"]["max_num_batched_tokens"] == 256
    assert hf["backend"] == "hf" and hf["model"] == engine["model"]
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    for run in (engine, hf):
        s = run["summary"]
        for _, path, _ in TABLE_ROWS:
            assert lookup(s, path.split(".")[0]) is not None or path.split(".")[0] in s, path
        assert s["completed"] == 4 and s["failed"] == 0 and s["output_tokens"] == 32
        assert set(s["ttft_s"]) >= {"mean", "p50", "p90", "p99"} and s["ttft_s"]["p50"] > 0
        assert s["tpot_s"]["mean"] > 0 and s["itl_s"]["count"] == 4 * 7 and s["e2e_s"]["p99"] > 0
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0 and s["total_throughput"] > 0
        assert set(s["hit_rate_per_turn"]) == {"0", "1"}
        assert len(run["records"]) == 4
        for r in run["records"]:
            assert set(r) == fields
            assert r["num_output_tokens"] == 8 == len(r["token_times"]) == len(r["output_token_ids"])
            assert r["submit_s"] <= r["first_token_s"] <= r["finish_s"] and r["finish_reason"] == "length"
            assert r["error"] is None and r["prompt_hash"]
    es = engine["engine_stats"]
    for key in ("prefix_cache.hit_rate", "prefix_cache.query_tokens", "checkpoints.stored", "checkpoints.evicted",
                "checkpoints.skipped_budget", "checkpoints.skipped_pool", "scheduler.preemptions", "kv.usage"):  # fmt: skip
        assert key in es, key
    s = engine["summary"]
    assert s["engine_hit_rate"] == pytest.approx(s["prefix_hit_rate"])  # the warm-up is subtracted
    assert s["checkpoints"]["stored"] >= 2 and s["preemptions"] == 0
    assert s["hit_rate_per_turn"]["0"] == 0.0 < s["hit_rate_per_turn"]["1"]
    assert hf["summary"]["prefix_hit_rate"] == 0.0 and hf["engine_stats"] == {}
    # the same requests, and greedy transformers agrees with the engine token for token
    assert doc["comparison"]["agreement"]["same prompts as first"] == ["ref", "4/4"]
    assert doc["comparison"]["agreement"]["same outputs as first"] == ["ref", "4/4"]
    assert doc["comparison"]["reference"] == "engine" and "hf" in doc["comparison"]["ratios"]
    assert png.stat().st_size > 10_000


def test_compare_configs_on_identical_requests(capsys: pytest.CaptureFixture[str]) -> None:
    runs = loadgen.main([
        "--workload", "shared-prefix", "--num-requests", "3", "--prefix-len", "140", "--prompt-len", "10",
        "--output-len", "2", "--concurrency", "1", "--warmup", "0",
        "--compare", "base", "cache.enable_prefix_caching=false", "base", *QUIET,
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert [r.label for r in runs] == ["base", "cache.enable_prefix_caching=false", "base#3"]
    on, off, again = (r.summary for r in runs)
    # the first prompt's tail (144) is past the shared 140; the second leaves a branch checkpoint
    # at the shared 128, which the third hits
    assert 0.25 < on["prefix_hit_rate"] < 0.35 and off["prefix_hit_rate"] == 0.0
    assert again["prefix_hit_rate"] == on["prefix_hit_rate"]
    assert [r.prompt_hash for r in runs[0].records] == [r.prompt_hash for r in runs[1].records]
    assert [r.output_token_ids for r in runs[0].records] == [r.output_token_ids for r in runs[1].records]
    assert "same outputs as first" in out and "3/3" in out


def test_hf_tokenizer_and_torch_free_codec_agree(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf, tf = HFCodec(AutoTokenizer.from_pretrained(tiny_dir)), TokenizersCodec(tiny_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    assert hf.render_chat(msgs) == tf.render_chat(msgs)
    for text in (hf.render_chat(msgs), " The fisherman counted 42 boats.\n\nDone!", "<|im_end|>x"):
        assert hf.encode(text) == tf.encode(text)
        assert hf.decode(hf.encode(text)) == tf.decode(tf.encode(text)) == text


def test_openai_backend_against_our_server_matches_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """The same workload in-process and over HTTP (a deltaserve server on 127.0.0.1, free port):
    same prompts, same greedy outputs, cached tokens from usage, engine counters from /metrics."""
    import asyncio
    import threading

    from deltaserve.engine import AsyncEngine, EngineConfig
    from deltaserve.server.app import create_app
    from deltaserve.server.serving import BackgroundServer

    overrides = {"scheduler.max_num_batched_tokens": 256, "logging.stats_interval_s": 60.0}
    started, stop = threading.Event(), threading.Event()
    box: dict[str, str] = {}

    async def serve() -> None:
        engine = AsyncEngine(EngineConfig.load(None, overrides))
        async with engine, BackgroundServer(create_app(engine)) as srv:
            box["url"] = srv.url
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    try:
        assert started.wait(120), "server did not start"
        runs = loadgen.main([
            "--workload", "chat", "--sessions", "2", "--turns", "2", "--prefix-len", "80", "--prompt-len", "16",
            "--output-len", "6", "--think-time", "0.01", "--seed", "5", "--warmup", "1",
            "--backend", "engine", "openai", "--base-url", box["url"],
            "--set", "scheduler.max_num_batched_tokens=256", *QUIET,
        ])  # fmt: skip
    finally:
        stop.set()
        thread.join(60)
    out = capsys.readouterr().out
    assert [r.label for r in runs] == ["engine", "openai"]
    engine, http = (r.summary for r in runs)
    assert http["completed"] == 4 and http["failed"] == 0 and http["output_tokens"] == 24
    assert http["ttft_s"]["p50"] > 0 and http["itl_s"]["count"] == 4 * 5
    assert [r.output_token_ids for r in runs[1].records] == [r.output_token_ids for r in runs[0].records]
    # hits depend on arrival timing (a session's first turn may or may not find the other's prefix
    # already cached), but every second turn hits its own first turn
    assert engine["hit_rate_per_turn"]["1"] > 0 and http["hit_rate_per_turn"]["1"] > 0
    assert runs[1].engine_stats["prefix_cache.query_tokens"] > 0  # read from /metrics, warm-up removed
    # the misses by cause, in-process from the engine's stats and over HTTP from /metrics: the query
    # causes make up the rest of the engine hit rate, and the first turns' prefixes were cold
    for s in (engine, http):
        assert s["missed"]["cold"] > 0
        query = sum(v or 0.0 for k, v in s["missed"].items() if k != "preemption")
        assert query == pytest.approx(1 - s["engine_hit_rate"])
    cold = next(line for line in out.splitlines() if line.startswith("missed: cold"))
    assert cold.split()[2:] == [
        f"{100 * engine['missed']['cold']:.1f}%",
        f"{100 * http['missed']['cold']:.1f}%",
    ]
    assert runs[1].backend["kind"] == "openai" and runs[1].backend["model"] == "builtin:tiny-qwen3.5"
    assert "same outputs as first" in out and "4/4" in out
