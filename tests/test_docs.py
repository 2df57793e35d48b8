"""docs/config.md is generated from engine/config.py and must not go stale."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.tools import gen_config_docs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def test_config_md_is_up_to_date() -> None:
    current = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    assert current == gen_config_docs.render(), (
        "docs/config.md is stale (engine/config.py changed): run `python tools/gen_config_docs.py` "
        "and commit docs/config.md"
    )


def test_every_key_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for section in msgspec.structs.fields(EngineConfig):
        assert f"\n## [{section.name}]\n" in text
        for field in msgspec.structs.fields(section.type):
            assert f"| `{field.name}` |" in text, f"{section.name}.{field.name} missing from docs/config.md"


def test_type_rendering() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert '| `dtype` | `"float32" \\| "bfloat16" \\| "float16" \\| "auto"` | `"auto"` |' in text
    assert "| `gpu_memory_utilization` | `float in (0, 1]` | `0.9` |" in text
    assert "| `memory_bytes` | `bytes ≥ 1 \\| None` | *unset* |" in text
    assert '| `disk_bytes` | `bytes ≥ 1` | `"16GiB"` |' in text  # a size default as a file writes it
    assert "| `block_size` | `int in [1, 1024]` | `16` |" in text
    assert "Split rule" in text  # the [cache] docstring: how the memory budget is split


def test_check_mode_and_no_torch(tmp_path: Path) -> None:
    """`--check` exits 1 on a stale file, 0 on a fresh one; the tool never imports torch."""
    stale = tmp_path / "config.md"
    stale.write_text("old\n", encoding="utf-8")
    script = ROOT / "tools" / "gen_config_docs.py"
    r = subprocess.run(
        [sys.executable, str(script), "--check", "--output", str(stale)], capture_output=True, text=True
    )
    assert r.returncode == 1 and "python tools/gen_config_docs.py" in r.stderr
    assert stale.read_text() == "old\n"  # --check writes nothing
    probe = (
        "import runpy, sys\n"
        "script, out = sys.argv[1:]\n"
        "sys.argv = [script, '--output', out]\n"
        "try:\n"
        "    runpy.run_path(script, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'gen_config_docs imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", probe, str(script), str(stale)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert stale.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")


def test_request_output_docstring_lists_every_field() -> None:
    from deltaserve import RequestOutput

    doc = RequestOutput.__doc__ or ""
    for field in msgspec.structs.fields(RequestOutput):
        assert re.search(rf"^    {field.name} \(", doc, re.M), f"RequestOutput docstring lacks {field.name}"


def test_error_types_are_documented() -> None:
    import deltaserve
    from deltaserve import DeltaServeError

    for name in (
        "ConfigError",
        "InvalidRequestError",
        "PromptTooLongError",
        "EngineOverloadedError",
        "EngineDeadError",
    ):
        cls = getattr(deltaserve, name)
        assert issubclass(cls, DeltaServeError)
        assert cls.__doc__ and len(cls.__doc__) > 80, f"{name} needs a docstring saying when it is raised"
