"""The remote tier on a real Mooncake Store master (``cache/remote_tier.py``).

A master runs in a subprocess on a free 127.0.0.1 port (``tests/cache/remote_helpers.py``)
and is stopped in each test; engines are the built-in tiny model, in this process. What is
checked: a conversation started on engine A and continued on engine B is served from the
store with greedy outputs equal to cache-off, and an engine started after both warms from
what they published; a torn write (objects without their path manifest) is never read; a
master killed or stalled costs hits, never a request or an output, and the counters say so.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from deltaserve.cache.disk_format import StoreIdentity
from deltaserve.cache.remote_client import MooncakeClient
from deltaserve.cache.remote_store import RemoteStore, decode_manifest, encode_manifest
from deltaserve.cache.remote_tier import RemoteTier
from deltaserve.cache.types import DiskItemKind
from deltaserve.engine import EngineConfig, EngineCore
from deltaserve.engine.config_sections import CacheConfig
from deltaserve.engine.errors import ConfigError
from tests.cache.remote_helpers import Master, master  # noqa: F401 (a fixture)
from tests.engine.conftest import core_factory, tiny_loaded, tiny_path  # noqa: F401 (fixtures)
from tests.engine.test_prefix_cache import rand_tokens, serve


def _remote(m: Master, **extra: Any) -> dict[str, Any]:
    dotted: dict[str, Any] = {
        "cache.remote": m.url,
        "cache.remote_write_bytes_per_s": None,
        "cache.remote_segment_bytes": "64MiB",
        "cache.remote_buffer_bytes": "16MiB",
        "cache.remote_timeout_s": 10.0,  # (a loaded box: only the outage tests shorten it)
    }
    dotted.update(extra)
    return dotted


def _store(core: EngineCore) -> RemoteStore:
    assert isinstance(core.disk, RemoteTier)
    return core.disk.remote


def _ready(core: EngineCore) -> EngineCore:
    assert _store(core).client.wait_ready(60), "the engine's client did not join the master"
    return core


def _published(core: EngineCore) -> None:
    """Wait for the engine's writes to reach the store (write-through is asynchronous)."""
    assert _store(core).flush(60)


def _conversations(rng: random.Random) -> list[list[int]]:
    return [rand_tokens(rng, 150 + 30 * i) for i in range(3)]


def _next_turn(convs: list[list[int]], outs: list[list[int]], rng: random.Random) -> list[list[int]]:
    return [c + o + rand_tokens(rng, 20) for c, o in zip(convs, outs, strict=True)]


def _remote_hits(core: EngineCore) -> int:
    s = core.stats()
    assert (
        s["prefix_cache.hit_tokens_disk"]
        == s["prefix_cache.hit_tokens"] - s["prefix_cache.hit_tokens_device"]
    )
    return int(s["prefix_cache.hit_tokens_disk"])


def test_a_conversation_moved_to_another_engine_is_served_from_the_store(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(3)
    convs = _conversations(rng)
    a = _ready(core_factory(**_remote(master)))
    outs = serve(a, convs, 6)
    assert outs == serve(plain, convs, 6)
    _published(a)
    assert _store(a).stats()["remote.published"] > 0
    convs = _next_turn(convs, outs, rng)
    b = _ready(core_factory(**_remote(master)))  # an empty tree: every hit is the store's
    outs = serve(b, convs, 6)
    assert outs == serve(plain, convs, 6), "a hit from the store changed an output"
    assert _remote_hits(b) > 0
    s = b.stats()
    assert s["remote.read_damaged"] == 0
    _published(b)
    # an engine started after both warms from what they published (turn 2 is B's)
    convs = _next_turn(convs, outs, rng)
    c = _ready(core_factory(**_remote(master)))
    outs = serve(c, convs, 6)
    assert outs == serve(plain, convs, 6)
    assert _remote_hits(c) >= _remote_hits(b)  # deeper prefixes: at least as many tokens
    for core in (a, b, c):
        core.check_integrity()
        core.close()


def test_objects_without_their_path_manifest_are_never_read(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(4)
    convs = _conversations(rng)
    a = _ready(core_factory(**_remote(master)))
    client = _store(a).client
    real_call = client.call
    dropped: list[str] = []

    def no_manifest(name: str, *args: Any, **kw: Any) -> Any:  # a writer gone before its manifest
        if name == "upsert":
            dropped.append(args[0])
            return 0  # the manifest never reaches the store
        return real_call(name, *args, **kw)

    client.call = no_manifest  # type: ignore[method-assign]
    outs = serve(a, convs, 6)
    _published(a)
    assert dropped, "no path was published"
    assert _store(a).stats()["remote.puts"] > len(dropped)  # its payload objects are in the store
    b = _ready(core_factory(**_remote(master)))
    convs = _next_turn(convs, outs, rng)
    assert serve(b, convs, 6) == serve(plain, convs, 6)
    s = b.stats()
    assert _remote_hits(b) == 0
    assert s["remote.fetches"] > 0 and s["remote.reads"] == 0  # looked up: nothing to read
    for core in (a, b):
        core.check_integrity()
        core.close()


def test_a_master_killed_costs_hits_never_a_request(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(5)
    convs = _conversations(rng)
    a = _ready(core_factory(**_remote(master, **{"cache.remote_timeout_s": 1.0})))
    outs = serve(a, convs, 6)
    _published(a)
    b = _ready(core_factory(**_remote(master, **{"cache.remote_timeout_s": 1.0})))
    master.kill()  # kill -9: the store and all it indexed are gone, A's writes meet a dead master
    convs = _next_turn(convs, outs, rng)
    outs = serve(b, convs, 6)
    assert outs == serve(plain, convs, 6)
    assert _remote_hits(b) == 0
    s = b.stats()
    assert s["remote.failures"] + s["remote.timeouts"] + s["remote.refused"] > 0
    # B never wrote or read a path: it cannot know the store held one, so what the outage
    # cost it is counted cold, not remote_wait (docs/cache.md, "The remote tier")
    assert s["prefix_cache.miss_tokens.remote_wait"] == 0
    assert (
        s["prefix_cache.miss_tokens.cold"]
        >= s["prefix_cache.query_tokens"]
        - s["prefix_cache.hit_tokens"]
        - (s["prefix_cache.miss_tokens.granularity"])
    )
    convs = _next_turn(convs, outs, rng)
    assert serve(a, convs, 6) == serve(plain, convs, 6)  # A's writes fail: outputs unchanged
    assert _store(a).flush(60)
    sa = a.stats()
    assert sa["remote.put_failed"] + sa["remote.put_dropped"] > 0
    for core in (a, b):
        core.check_integrity()
        core.close()


def test_a_replica_killed_mid_write_loses_no_correctness(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
) -> None:
    """The client process of A (its store client and the memory it lends) is killed with -9
    while A serves and writes: A goes on (a new client process joins), B reads what survives
    (objects in the dead client's memory are misses), and no output changes."""
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(7)
    convs = _conversations(rng)
    a = _ready(core_factory(**_remote(master, **{"cache.remote_timeout_s": 2.0})))
    outs = serve(a, convs[:1], 6)
    proc = _store(a).client._proc
    assert proc is not None
    proc.kill()  # kill -9 of the replica's store client, its writes in flight with it
    outs += serve(a, convs[1:], 6)
    assert outs == serve(plain, convs, 6)
    _published(a)
    convs = _next_turn(convs, outs, rng)
    b = _ready(core_factory(**_remote(master, **{"cache.remote_timeout_s": 2.0})))
    assert serve(b, convs, 6) == serve(plain, convs, 6)
    sa = a.stats()
    assert sa["remote.failures"] + sa["remote.timeouts"] + sa["remote.put_dropped"] > 0
    for core in (a, b):
        core.check_integrity()
        core.close()


def test_a_stalled_master_costs_hits_never_a_request(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(6)
    convs = _conversations(rng)
    a = _ready(core_factory(**_remote(master)))
    outs = serve(a, convs, 6)
    _published(a)
    b = _ready(core_factory(**_remote(master, **{"cache.remote_timeout_s": 0.5})))
    master.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        convs = _next_turn(convs, outs, rng)
        assert serve(b, convs, 6) == serve(plain, convs, 6)
        s = b.stats()
        assert _remote_hits(b) == 0
        assert s["remote.timeouts"] + s["remote.read_timeouts"] > 0
        assert s["prefix_cache.miss_tokens.remote_wait"] > 0 or s["remote.refused"] > 0
    finally:
        master.resume()
    for core in (a, b):
        core.check_integrity()
        core.close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:50051", "not a mooncake://HOST:PORT address (the scheme must be mooncake)"),
        ("mooncake://127.0.0.1", "not a mooncake://HOST:PORT address (a host and a port are required)"),
        ("mooncake://h:1/x", "not a mooncake://HOST:PORT address (nothing may follow the port)"),
        ("mooncake://h:99999", "not a mooncake://HOST:PORT address (Port out of range 0-65535)"),
    ],
)
def test_a_bad_remote_url_is_one_config_error(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        CacheConfig(remote=url)
    assert str(e.value) == f"cache.remote = {url!r}: {why}"


def test_the_remote_tier_without_prefix_caching_or_a_timeout_is_refused() -> None:
    url = "mooncake://127.0.0.1:50051"
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(None, {"cache.remote": url, "cache.enable_prefix_caching": False})
    assert str(e.value) == f"cache.remote = {url!r}: the remote tier needs enable_prefix_caching"
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(None, {"cache.remote_timeout_s": 0})
    assert str(e.value).startswith("cache.remote_timeout_s = 0")


def test_a_disk_layer_above_the_store_serves_what_it_holds_and_the_store_the_rest(
    core_factory: Any,  # noqa: F811
    master: Master,  # noqa: F811
    tmp_path: Path,
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(8)
    convs = _conversations(rng)

    def layered(name: str) -> dict[str, Any]:
        return _remote(
            master, **{"cache.disk_path": str(tmp_path / name), "cache.disk_write_bytes_per_s": None}
        )

    a = _ready(core_factory(**layered("a")))
    outs = serve(a, convs, 6)
    _published(a)
    assert a.stats()["disk.items"] > 0  # written to its own disk as well
    convs = _next_turn(convs, outs, rng)
    b = _ready(core_factory(**layered("b")))  # an empty disk: its hits are the store's
    outs = serve(b, convs, 6)
    assert outs == serve(plain, convs, 6)
    assert _remote_hits(b) > 0 and b.stats()["remote.reads"] > 0
    b.check_integrity()
    b.close()  # what it holds goes to its disk
    master.kill()
    convs = _next_turn(convs, outs, rng)
    b2 = core_factory(**layered("b"))  # the store is gone: its disk serves
    assert serve(b2, convs, 6) == serve(plain, convs, 6)
    assert _remote_hits(b2) > 0 and b2.stats()["remote.reads"] == 0
    for core in (a, b2):
        core.check_integrity()
        core.close()


def _client(m: Master) -> MooncakeClient:
    c = MooncakeClient(m.url, segment_bytes=32 << 20, buffer_bytes=16 << 20, timeout_s=10.0)
    assert c.wait_ready(60)
    return c


KV, CHECKPOINT = DiskItemKind.KV, DiskItemKind.CHECKPOINT
IDENT = StoreIdentity("model", "weights", "float32", 4, 4, "salt", 8, 16)


def _publish(store: RemoteStore, keys: list[int]) -> None:
    parent = 0
    for k in keys:
        store.put(KV, k, parent, bytes([k % 251]) * 8, 0.0)
        parent = k
    store.put(CHECKPOINT, keys[-1], keys[-1], b"c" * 16, 8.0)
    assert store.flush(30)


def test_reads_verify_every_object_against_the_manifest_and_the_identity(master: Master) -> None:  # noqa: F811
    a, b = RemoteStore(_client(master), IDENT), RemoteStore(_client(master), IDENT)
    keys = [11, 12, 13]
    _publish(a, keys)
    assert b.read_path(keys, 1, 3, 8, 16) == ([bytes([12]) * 8, bytes([13]) * 8], b"c" * 16)
    # another identity (here: another dtype) lives in another namespace: it finds nothing
    other = RemoteStore(_client(master), msgspec.structs.replace(IDENT, dtype="bfloat16"))
    assert other.lookup(keys, [3]) == []
    # a manifest that names another path (the prompt's keys differ) is not this prompt's hit
    assert b.read_path([11, 99, 13], 1, 3, 8, 16) is None
    damaged, missing = b.stats()["remote.read_damaged"], b.stats()["remote.read_missing"]
    # a damaged manifest, and one whose object sums do not match what is stored, are misses
    raw = b.client.call("get", b._manifest(13))
    flipped = bytearray(raw)
    flipped[len(flipped) // 2] ^= 0xFF
    b.client.call("upsert", b._manifest(13), bytes(flipped))
    assert b.read_path(keys, 1, 3, 8, 16) is None and b.stats()["remote.read_damaged"] == damaged + 1
    m = decode_manifest(raw)
    assert m is not None
    wrong = msgspec.structs.replace(m, kv=[*m.kv[:-1], (m.kv[-1][0], m.kv[-1][1] ^ 1)])
    b.client.call("upsert", b._manifest(13), encode_manifest(wrong))
    assert b.read_path(keys, 1, 3, 8, 16) is None and b.stats()["remote.read_missing"] == missing + 1
    # a checkpoint whose KV this store cannot name is not published
    c = RemoteStore(_client(master), IDENT)
    c.put(CHECKPOINT, 77, 77, b"c" * 16, 4.0)
    assert c.flush(30) and c.stats()["remote.publish_incomplete"] == 1
    assert c.lookup([77], [1]) == []
    for s in (a, b, c, other):
        s.close()


def test_serve_remote_cache_sets_cache_remote_and_a_bad_url_is_one_line() -> None:
    from deltaserve.engine.cli import config_from_args
    from deltaserve.server.cli import build_parser, engine_overrides

    url = "mooncake://10.0.0.5:50051"
    args = build_parser().parse_args(["serve", "--remote-cache", url])
    assert engine_overrides(args) == {"cache.remote": url}
    assert config_from_args(args, engine_overrides(args)).cache.remote == url
    bad = build_parser().parse_args(["serve", "--remote-cache", "10.0.0.5:50051"])
    with pytest.raises(ConfigError) as e:
        config_from_args(bad, engine_overrides(bad))
    assert str(e.value) == (
        "cache.remote = '10.0.0.5:50051': not a mooncake://HOST:PORT address (the scheme must be mooncake)"
    )
