"""tools/bench/bench_grammar.py runs on the built-in tokenizer: a row per schema, each mask step on a
valid path (the tool asserts every token is accepted), with positive timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.tools.bench import bench_grammar


def test_bench_grammar_prints_a_row_per_schema(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "grammar.json"
    bench_grammar.main(
        ["--big-vocab", "0", "--batch", "4", "--threads", "1", "--engines", "xgrammar", "--json", str(out)]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("xgrammar")]
    assert [r[2] for r in rows] == list(bench_grammar.SCHEMAS)
    for r in rows:
        assert r[1] == "1024" and all(float(x) > 0 for x in r[3:6])
    doc = json.loads(out.read_text())
    assert doc["tool"] == "bench_grammar" and [r["schema"] for r in doc["results"]] == list(
        bench_grammar.SCHEMAS
    )
    for r in doc["results"]:  # the mask time per step: a median within its spread over the steps
        mask = r["mask_ms"]
        assert 0 < mask["min"] <= mask["median"] <= mask["max"] and mask["n"] >= 2


def test_every_instance_matches_its_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the generated documents")
    for name, schema in bench_grammar.SCHEMAS.items():
        jsonschema.validate(bench_grammar.INSTANCES[name], schema)
