"""tools/bench/profile_cpu.py on the built-in tiny model: a roofline, the three step cases with
consistent times, the op tables; and its byte count takes a tied weight once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deltaserve.tools.bench import profile_cpu


def test_weight_bytes_counts_a_tied_weight_once() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(10, 4)
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.proj = nn.Linear(4, 4, bias=True)
    assert profile_cpu.weight_bytes(model) == 4 * (10 * 4 + 4 * 4 + 4)
    assert profile_cpu.projection_params(model) == 10 * 4 + 4 * 4  # every Linear: there is no lm_head


def test_profile_cpu_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "profile.json"
    try:
        profile_cpu.main(
            ["--threads", "1", "--decode-steps", "2", "--prefill-len", "64", "--prefill-reps", "1"]
            + ["--profile-steps", "1", "--top", "5", "--json", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["tool"] == "profile_cpu" and doc["box"]["after"]["torch_threads"] == 1
    data = doc["results"]
    assert (
        data["weight_bytes"] > 0 and data["bandwidth"]["1"]["copy_gbs"] > 0 and data["gemm_gflops"]["1"] > 0
    )
    assert [s["case"] for s in data["steps"]] == ["decode b=1", "decode b=4", "prefill 64"]
    for s in data["steps"]:
        assert 0 < s["forward_ms"] <= s["step_ms"] and s["bound_ms"] > 0
        assert s["ratio"] == pytest.approx(s["step_ms"] / s["bound_ms"])
        assert s["step_ms_spread"]["min"] <= s["step_ms"] <= s["step_ms_spread"]["max"]
    text = capsys.readouterr().out
    assert "decode bound" in text
    assert "top ops: decode b=4" in text and "top ops: prefill 64" in text
