"""loadgen prints what its table's rows mean, under the table; README.md says the same."""

from __future__ import annotations

from pathlib import Path

from deltaserve.tools.metrics import TABLE_LEGEND, TABLE_ROWS, format_legend, format_table

README = Path(__file__).resolve().parents[2] / "README.md"


def _explained(label: str) -> bool:
    return any(part in label for key, _ in TABLE_LEGEND for part in key.split(" / "))


def test_every_row_has_a_note() -> None:
    missing = [label for label, _, _ in TABLE_ROWS if not _explained(label)]
    assert not missing, f"tools/metrics.py TABLE_LEGEND explains no {missing}"
    assert _explained("same prompts as first") and _explained("same outputs as first")


def test_legend_follows_the_rows_the_table_shows() -> None:
    one = [("engine", {"hit_rate_per_turn": {"0": 0.0}})]
    legend = format_legend(one)
    assert legend.startswith("rows:\n")
    assert "prefix hit rate (requests)" in legend and "prefix hit rate (engine)" in legend
    assert "hit rate turn N" not in legend and "/first column" not in legend  # no such rows
    two = [("engine", {"hit_rate_per_turn": {"0": 0.0, "1": 0.5}}), ("openai", {})]
    assert "hit rate turn 1" in format_table(two)
    legend = format_legend(two)
    assert "hit rate turn N" in legend and "/first column" in legend
    assert all(len(line) <= 110 for line in legend.splitlines())


def test_readme_explains_the_rows() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Tools", 1)[1]
    for key, _ in TABLE_LEGEND:
        assert f"`{key}`" in section, f"README.md's loadgen notes lack {key!r}"
