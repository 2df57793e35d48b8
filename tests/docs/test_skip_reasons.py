"""Every skip in tests/ says why (the README's test command runs with ``-ra``, which lists each
skip with its reason), and the README's test command is the one .ci/run runs, verbatim."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: the README's and CI's test command: the default suite, every skip's reason in the summary
TEST_COMMAND = "tools/setup.sh && .venv/bin/python -m pytest -q -ra -n 2"


def _dotted(node: ast.AST) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _has_reason(call: ast.Call, positional_ok: bool) -> bool:
    reason = next((k.value for k in call.keywords if k.arg in ("reason", "msg")), None)
    if reason is None and positional_ok and call.args:
        reason = call.args[0]
    if isinstance(reason, ast.Constant):
        return isinstance(reason.value, str) and len(reason.value.strip()) >= 8
    return reason is not None  # an expression (an f-string, a name): a reason built at run time


#: skip helpers -> whether a first positional argument is the reason
SKIPS = {"pytest.skip": True, "mark.skip": True, "mark.skipif": False, "importorskip": False}


def _bad(node: ast.AST, calls: set[int]) -> bool:
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        kind = next((k for k in SKIPS if name.endswith(k)), None)
        return kind is not None and not _has_reason(node, positional_ok=SKIPS[kind])
    # @pytest.mark.skip used bare: no reason at all
    return isinstance(node, ast.Attribute) and id(node) not in calls and _dotted(node).endswith("mark.skip")


def skips_without_reason(root: Path) -> list[str]:
    """``file:line`` of each ``pytest.skip`` / ``mark.skip`` / ``mark.skipif`` /
    ``importorskip`` under ``root`` that gives no reason."""
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        bad += [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(tree) if _bad(n, calls)]  # type: ignore[attr-defined]
    return bad


def test_every_skip_gives_its_reason() -> None:
    bad = skips_without_reason(TESTS)
    assert not bad, f"skips without a reason (say why, e.g. reason='needs CUDA'): {bad}"


def test_the_check_finds_bare_skips(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(
        "import pytest\n"
        "ray = pytest.importorskip('ray')\n"
        "@pytest.mark.skip\n"
        "def test_a(): pass\n"
        "@pytest.mark.skipif(True)\n"
        "def test_b(): pytest.skip()\n"
        "@pytest.mark.skipif(True, reason='needs a GPU')\n"
        "def test_c(): pytest.skip('no network here')\n",
        encoding="utf-8",
    )
    assert skips_without_reason(tmp_path) == ["t.py:2", "t.py:3", "t.py:5", "t.py:6"]


def test_readme_and_ci_run_the_same_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert TEST_COMMAND + "\n" in readme
    # the README's first code block: setup + loadgen, then this command
    first = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first and first.group(1).splitlines()[:2] == [
        "tools/setup.sh && .venv/bin/python tools/loadgen.py",
        TEST_COMMAND,
    ]
    commands = [line for line in ci.splitlines() if "-m pytest" in line and "-m interpret" not in line]
    assert commands[0] == TEST_COMMAND, commands
