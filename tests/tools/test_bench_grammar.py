"""tools/bench/bench_grammar.py runs on the built-in tokenizer: a row per schema, each mask step on a
valid path (the tool asserts every token is accepted), with positive timings."""

from __future__ import annotations

import pytest

from deltaserve.tools.bench import bench_grammar


def test_bench_grammar_prints_a_row_per_schema(capsys: pytest.CaptureFixture[str]) -> None:
    bench_grammar.main(["--big-vocab", "0", "--batch", "4", "--threads", "1", "--engines", "xgrammar"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("xgrammar")]
    assert [r[2] for r in rows] == list(bench_grammar.SCHEMAS)
    for r in rows:
        assert r[1] == "1024" and all(float(x) > 0 for x in r[3:])


def test_every_instance_matches_its_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the generated documents")
    for name, schema in bench_grammar.SCHEMAS.items():
        jsonschema.validate(bench_grammar.INSTANCES[name], schema)
