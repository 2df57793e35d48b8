"""docs/server.md's metrics table and a live server's ``/metrics`` list the same series.

A server on the built-in model (127.0.0.1, a free port) with a host, a disk and a remote tier
(a real Mooncake master on a free port, stopped in the fixture), so every conditional family
exists, serves a request, the same request again (a prefix hit) and a
rejected one; its scrape and the table under "## Metrics" must agree both ways: every family
exported is a row, every row is exported, and every label name and enumerated value a row
lists is the one the series carries. Where mooncake cannot run here the remote tier is left
out and only its rows (``remote_*``) are not required to be exported."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer
from tests.cache.remote_helpers import run_master

pytestmark = pytest.mark.asyncio(loop_scope="module")

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
MODEL = "builtin:tiny-qwen3.5"
#: labels whose values are data, not an enumeration the docs can list
OPEN_LABELS = {"model_name", "status", "le"}


def doc_rows() -> dict[str, dict[str, set[str]]]:
    """The metrics table: series name (without ``deltaserve:``, counters with ``_total``) ->
    label name -> the values the row enumerates (empty: any value)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict[str, set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]  # a value list escapes its "|"
        m = re.fullmatch(r"`deltaserve:(\w+)`", cells[1]) if len(cells) > 4 else None
        if not m:
            continue
        labels: dict[str, set[str]] = {}
        for spec in re.findall(r"`([^`]+)`", cells[3]):
            name, _, values = spec.partition("=")
            labels[name] = set(values.split("\\|")) if values else set()
        rows[m.group(1)] = labels
    return rows


#: whether the scraped server had a remote tier (set by the fixture)
REMOTE: list[bool] = []


@contextmanager
def remote_tier() -> Iterator[dict[str, object]]:
    """The remote tier's config on a master started here, or nothing where mooncake cannot run."""
    masters = run_master()
    try:
        m = next(masters)
    except pytest.skip.Exception:
        yield {}
        return
    try:
        yield {
            "cache.remote": m.url,
            "cache.remote_segment_bytes": "64MiB",
            "cache.remote_buffer_bytes": "16MiB",
            "cache.remote_timeout_s": 10.0,
        }
    finally:
        masters.close()  # (stops the master)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scrape(tiny_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    store = tmp_path_factory.mktemp("disk") / "store"
    with remote_tier() as remote:
        REMOTE.append(bool(remote))
        config = EngineConfig.load(
            None,
            {
                "scheduler.max_num_batched_tokens": 512,
                "cache.memory_bytes": 128 * 1024**2,
                "cache.host_memory_bytes": 32 * 1024**2,
                "cache.disk_path": str(store),
                "logging.stats_interval_s": 60.0,
                **remote,
            },
        )
        async for text in _serve(config, tiny_model):
            yield text


async def _serve(config: EngineConfig, tiny_model: LoadedModel) -> AsyncIterator[str]:
    engine = AsyncEngine(core=EngineCore(config, loaded=tiny_model))
    await engine.start()
    try:
        async with (
            BackgroundServer(create_app(engine, ServerConfig(served_model_names=[MODEL]))) as srv,
            httpx.AsyncClient(base_url=srv.url, timeout=60) as http,
        ):
            body = {"model": MODEL, "prompt": list(range(3, 150)), "max_tokens": 4, "ignore_eos": True}
            for _ in range(2):  # the second is a prefix hit
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            bad = await http.post("/v1/completions", json={**body, "max_tokens": 0})
            assert bad.status_code == 400, bad.text
            yield (await http.get("/metrics")).text
    finally:
        await engine.shutdown()


async def test_every_exported_series_is_documented(scrape: str) -> None:
    rows = doc_rows()
    assert len(rows) > 30, "docs/server.md: the metrics table was not found"
    missing: list[str] = []
    families = list(text_string_to_metric_families(scrape))
    names = {fam.name for fam in families}
    for fam in families:
        assert fam.name.startswith("deltaserve:"), fam.name
        if fam.name.endswith("_created") and fam.name.removesuffix("_created") in names:
            continue  # prometheus_client's creation timestamps (the parser makes them families)
        base = fam.name.removeprefix("deltaserve:")
        row = next((n for n in (base + "_total", base) if n in rows), None)
        if row is None:
            missing.append(base)
            continue
        for s in fam.samples:
            for label, value in s.labels.items():
                if label == "le":
                    continue
                assert label in rows[row], f"docs/server.md: {row} lacks the label {label}"
                if label not in OPEN_LABELS:
                    assert value in rows[row][label], f"docs/server.md: {row}{{{label}}} lacks {value!r}"
    assert not missing, f"docs/server.md's metrics table lacks {missing}"


async def test_every_documented_series_is_exported(scrape: str) -> None:
    exported: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(scrape):
        for s in fam.samples:
            name = s.name.removeprefix("deltaserve:")
            exported.setdefault(name, set()).update(s.labels)
            exported.setdefault(fam.name.removeprefix("deltaserve:"), set()).update(s.labels)
    for row, labels in doc_rows().items():
        if row.startswith("remote_") and not REMOTE[-1]:
            continue  # (no remote tier here: mooncake cannot run)
        assert row in exported, f"docs/server.md documents {row}, which /metrics does not export"
        assert set(labels) <= exported[row] | {"le"}, f"{row}: documented labels {set(labels)}"
