"""README.md runs as written and says what the code has.

Its code blocks are marked with the HTML comment on the line before them:

* ``<!-- test: engine -->``: a Python script using the library, run from the repository root
  (``, output below``: its stdout must equal the ```` ```text ```` block that follows);
* ``<!-- test: server -->``: curl commands or an OpenAI-client script, run against a live
  server on the built-in model (127.0.0.1, a free port in place of the README's 8000);
* ``<!-- test: config -->``: TOML, loaded with ``EngineConfig.load``;
* ``<!-- not run: REASON -->``: shown only (a download, a long job).

Every ``python`` and ``toml`` block, and every block with a ``curl`` command, carries one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import pytest_asyncio

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.tools.workloads.registry import WORKLOADS
from tests.server.conftest import serving

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL = "builtin:tiny-qwen3.5"
README_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 300  # generous: a loaded machine; each block runs in seconds


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    marker: str  # the comment's text ("test: engine", "not run: ..."), "" when unmarked
    code: str
    output: str | None  # the ```text block right after it, if any


def blocks(text: str) -> list[Block]:
    out: list[Block] = []
    pattern = re.compile(
        r"(?:<!--\s*(.*?)\s*-->\n)?^```(\w*)\n(.*?)^```\n(?:\n```text\n(.*?)^```\n)?", re.S | re.M
    )
    for m in pattern.finditer(text):
        line = text.count("\n", 0, m.start(2)) + 1
        out.append(Block(line, m.group(2), m.group(1) or "", m.group(3), m.group(4)))
    return out


def marked(kind: str) -> list[Block]:
    found = [b for b in blocks(README.read_text(encoding="utf-8")) if b.marker.startswith(f"test: {kind}")]
    assert found, f"README.md has no block marked <!-- test: {kind} -->"
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the tiny model's ops gain nothing from more threads
    return env


async def _python(code: str, tmp_path: Path, name: str) -> tuple[int, str, str]:
    script = tmp_path / f"{name}.py"
    script.write_text(code, encoding="utf-8")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), cwd=ROOT, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------- what it says
def test_every_code_block_is_marked() -> None:
    unmarked = [
        b.line
        for b in blocks(README.read_text(encoding="utf-8"))
        if not b.marker and (b.lang in ("python", "toml") or "curl " in b.code)
    ]
    assert not unmarked, (
        f"README.md: blocks without <!-- test: ... --> or <!-- not run: ... -->: lines {unmarked}"
    )


def test_readme_lists_every_config_section() -> None:
    text = README.read_text(encoding="utf-8")
    section_list = text.split("Typed sections", 1)[1].split("Every key", 1)[0]
    listed = re.findall(r"`\[(\w+)\]`", section_list)
    assert listed == [f.name for f in msgspec.structs.fields(EngineConfig)]


def test_readme_lists_every_workload() -> None:
    tools = README.read_text(encoding="utf-8").split("## Tools", 1)[1]
    loadgen = tools.split("* `tools/simulate_cache.py`", 1)[0]
    missing = [name for name in WORKLOADS if f"`{name}`" not in loadgen]
    assert not missing, f"README.md's loadgen entry lacks the workloads {missing}"


def test_readme_says_how_to_serve_a_real_model_and_scale_out() -> None:
    text = README.read_text(encoding="utf-8")
    assert "random weights" in text and "gibberish" in text
    assert "huggingface-cli download Qwen/Qwen3.5-0.8B --local-dir" in text
    assert re.search(r"deltaserve serve ~/models/Qwen3.5-0\.8B", text)
    assert "--replicas N" in text and "(docs/cluster.md)" in text
    assert 'checkpoint_granularity = "block"' in text and "(the default)" in text
    assert "in_process" not in text.split("## Serve it over HTTP", 1)[0]  # no stale placement


# ---------------------------------------------------------------------------- engine blocks
@pytest.mark.asyncio
async def test_engine_blocks_run_and_print_what_the_readme_shows(tmp_path: Path) -> None:
    for i, block in enumerate(marked("engine")):
        rc, out, err = await _python(block.code, tmp_path, f"engine_{i}")
        assert rc == 0, f"README.md line {block.line}:\n{err[-4000:]}"
        assert "engine.ready" not in out  # the library writes nothing to stdout
        if "output below" in block.marker:
            assert block.output is not None, f"README.md line {block.line}: no ```text block after it"
            assert out == block.output, f"README.md line {block.line} printed:\n{out}"
        elif "hit_rate" in block.code:  # the first snippet: its last line is the engine's hit rate
            assert 0.0 <= float(out.rstrip("\n").split("\n")[-1]) <= 1.0


# ---------------------------------------------------------------------------- config blocks
def test_config_blocks_load(tmp_path: Path) -> None:
    for i, block in enumerate(marked("config")):
        assert block.lang == "toml", block.line
        path = tmp_path / f"readme_{i}.toml"
        path.write_text(block.code, encoding="utf-8")
        config = EngineConfig.load(path)
        assert config.model.path == MODEL


# ---------------------------------------------------------------------------- server blocks
@pytest_asyncio.fixture
async def server_url(tiny_model: LoadedModel) -> AsyncIterator[str]:
    config = EngineConfig.load(None, {"cache.memory_bytes": 128 * 1024**2, "logging.stats_interval_s": 60.0})
    engine = AsyncEngine(core=EngineCore(config, loaded=tiny_model))
    async with serving(engine) as srv:
        yield srv.url


def commands(code: str) -> list[str]:
    """Shell commands of a block, continuation lines joined."""
    return [c.strip() for c in code.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


async def _curl(command: str) -> str:
    """Run a README curl command: with curl when installed, else the same request through httpx."""
    if shutil.which("curl"):
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        assert proc.returncode == 0, err.decode()
        return out.decode()
    args = shlex.split(command)
    assert args[0] == "curl", command
    headers: dict[str, str] = {}
    data: str | None = None
    url = ""
    it = iter(args[1:])
    for arg in it:
        if arg == "-H":
            key, _, value = next(it).partition(":")
            headers[key.strip()] = value.strip()
        elif arg == "-d":
            data = next(it)
        elif not arg.startswith("-"):
            url = arg
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        r = await http.request("POST" if data is not None else "GET", url, headers=headers, content=data)
    return r.text


@pytest.mark.asyncio
async def test_server_blocks_run_against_a_live_server(server_url: str, tmp_path: Path) -> None:
    ran = 0
    for i, block in enumerate(marked("server")):
        code = block.code.replace(README_URL, server_url)
        assert server_url in code, f"README.md line {block.line} does not use {README_URL}"
        if block.lang == "python":
            rc, out, err = await _python(code, tmp_path, f"client_{i}")
            assert rc == 0, f"README.md line {block.line}:\n{err[-4000:]}"
            lines = out.splitlines()
            assert lines[0].startswith("turn 0: ") and lines[1].startswith("turn 1: "), out
            cached = [int(m) for m in re.findall(r", (\d+) from the cache", out)]
            assert cached[0] == 0 and cached[1] > 0, out  # turn 1 resumes from turn 0
            ran += 1
            continue
        for command in commands(code):
            out = await _curl(command)
            if "/metrics" in command:
                assert "deltaserve:prefix_cache_hits_total" in out
            else:
                body = json.loads(out)
                assert body["choices"] and body["usage"]["completion_tokens"] > 0, body
            ran += 1
    assert ran >= 4
