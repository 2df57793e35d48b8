"""Cache events of the remote tier: ``REMOTE`` items, rebuilt exactly from the stream.

Two engines on one real Mooncake master (a subprocess on a free 127.0.0.1 port, stopped in
the test), each publishing its events to a subscriber of its own (``cluster/kv_index.py``).
A serves a few conversations and writes them through to the store; B (a disk layer above
the store, and a small memory of what the store holds, so it forgets items too) serves
their next turns from the store. After every step of each, the index rebuilt from the
events equals ``contents`` of that engine's cache, ``REMOTE`` included: what it wrote to the
store (A) or read from it and verified (B).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

from deltaserve.cache.remote_tier import RemoteTier
from deltaserve.cluster.kv_index import KVEventSubscriber
from deltaserve.engine.core.engine_core import EngineCore
from tests.cache.remote_helpers import Master, master  # noqa: F401 (a fixture)
from tests.cache.test_kv_events import _check, _events, _serve_checked, _settle
from tests.cache.test_remote_tier import _remote
from tests.engine.conftest import core_factory, tiny_loaded, tiny_path  # noqa: F401 (fixtures)
from tests.engine.test_prefix_cache import rand_tokens


def _followed(
    core_factory: Any,  # noqa: F811
    extra: dict[str, Any],
) -> tuple[EngineCore, KVEventSubscriber, Counter[tuple[str, str | None]]]:
    """An engine publishing its events, a subscriber following it, the events it applied."""
    events, pub, replay = _events()
    sub = KVEventSubscriber(pub, replay)
    seen: Counter[tuple[str, str | None]] = Counter()
    apply = sub.index.apply

    def counting(event: Any) -> None:
        seen[(type(event).__name__, getattr(event, "medium", None))] += 1
        apply(event)

    sub.index.apply = counting  # type: ignore[method-assign]
    core = core_factory(**extra, **events)
    assert isinstance(core.disk, RemoteTier)
    assert core.disk.remote.client.wait_ready(60), "the engine's client did not join the master"
    _settle(core, sub)
    _check(core, sub, "start")
    return core, sub, seen


def test_the_event_stream_rebuilds_the_remote_tier_written_read_and_forgotten(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    convs = [rand_tokens(rng, 150 + 30 * i) for i in range(3)]
    a, sub_a, seen_a = _followed(core_factory, _remote(master))
    b, sub_b, seen_b = _followed(
        core_factory, _remote(master, **{"cache.disk_path": str(tmp_path / "store")})
    )
    try:
        outs = _serve_checked(a, sub_a, convs, 0)
        written = set(sub_a.index.checkpoints["REMOTE"])
        assert written and sub_a.index.blocks["REMOTE"], "A published nothing on REMOTE"
        convs = [c + o + rand_tokens(rng, 20) for c, o in zip(convs, outs, strict=True)]
        b.disk.remote.known_items = 2  # (B forgets: BlockRemoved / CheckpointRemoved on REMOTE)
        _serve_checked(b, sub_b, convs, 1)
        s = b.stats()
        assert s["remote.hits"] > 0 and s["remote.read_damaged"] == 0
        for sub in (sub_a, sub_b):
            assert sub.counters["lost"] == 0 and not sub.stale
    finally:
        for core in (a, b):
            core.close()
        sub_a.close()
        sub_b.close()
    assert seen_a[("CheckpointStored", "REMOTE")] >= len(written)
    assert seen_a[("BlockRemoved", "REMOTE")] == 0  # A forgets nothing: its memory is large
    for kind in ("BlockStored", "BlockRemoved", "CheckpointStored", "CheckpointRemoved"):
        assert seen_b[(kind, "REMOTE")] > 0, f"B: no {kind} on REMOTE: {dict(seen_b)}"
    assert seen_b[("BlockStored", "DISK")] > 0  # the disk layer's own events go on
