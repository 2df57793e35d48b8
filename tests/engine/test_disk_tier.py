"""The disk tier across restarts: turn N+1 of a conversation served from disk by a restarted
engine, with greedy outputs equal to cache-off; a damaged, truncated or deleted store, another
model's store, a second engine on the same path and a full disk never change an output.

Each engine is closed (``EngineCore.close``: what the disk lacks is written, the store is
flushed and unlocked) before the next opens the path, as a restarted server would.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from deltaserve.engine.errors import ConfigError
from tests.engine.conftest import greedy, run_to_completion
from tests.engine.test_prefix_cache import converse, rand_tokens, serve

TURNS = 3


def _disk(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    dotted: dict[str, Any] = {
        "cache.disk_path": str(tmp_path / "store"),
        "cache.disk_write_bytes_per_s": None,
    }
    dotted.update(extra)
    return dotted


def _conversations(rng: random.Random) -> list[list[int]]:
    return [rand_tokens(rng, 150 + 30 * i) for i in range(3)]


def _next_turn(convs: list[list[int]], outs: list[list[int]], rng: random.Random) -> list[list[int]]:
    return [c + o + rand_tokens(rng, 20) for c, o in zip(convs, outs, strict=True)]


def _store_files(tmp_path: Path) -> list[Path]:
    """The store's item files (``items/<byte>/<kind>-<key>``: not its manifest, lock or index)."""
    return [p for p in (tmp_path / "store" / "items").rglob("*") if p.is_file()]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_a_restarted_engine_serves_the_next_turn_from_disk(
    core_factory: Any, tmp_path: Path, overlap: bool
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(3)
    convs = _conversations(rng)
    for turn in range(TURNS):
        core = core_factory(**_disk(tmp_path, **{"engine.async_scheduling": overlap}))
        outs = serve(core, convs, 6)
        assert outs == serve(plain, convs, 6), f"turn {turn}: the disk tier changed an output"
        s = core.stats()
        if turn > 0:  # a fresh engine: every hit of this turn came from disk
            assert s["prefix_cache.hit_tokens_disk"] > 0
            assert (
                s["prefix_cache.hit_tokens_disk"]
                == s["prefix_cache.hit_tokens"] - s["prefix_cache.hit_tokens_device"]
            )
            assert s["disk.kv_loaded_blocks"] > 0 and s["disk.checkpoints_loaded"] > 0
        core.close()
        core.check_integrity()
        convs = _next_turn(convs, outs, rng)


def _warm_store(core_factory: Any, tmp_path: Path, convs: list[list[int]]) -> list[list[int]]:
    core = core_factory(**_disk(tmp_path))
    outs = serve(core, convs, 6)
    core.close()
    return outs


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_store_is_a_miss_never_a_wrong_output(
    core_factory: Any, tmp_path: Path, damage: str
) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(5)
    convs = _conversations(rng)
    convs = _next_turn(convs, _warm_store(core_factory, tmp_path, convs), rng)
    files = sorted(p for p in _store_files(tmp_path) if p.name.startswith("2-"))  # checkpoints
    assert len(files) >= 2
    for i, p in enumerate(files):
        if i % 2:  # half of them: the others still serve hits
            continue
        if damage == "flip":
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            data[-1] ^= 0x01
            p.write_bytes(bytes(data))
        elif damage == "truncate":
            with p.open("r+b") as f:
                f.truncate(p.stat().st_size // 2)
        else:
            p.unlink()
    core = core_factory(**_disk(tmp_path))
    assert serve(core, convs, 6) == serve(plain, convs, 6)
    core.check_integrity()
    s = core.stats()
    assert s["prefix_cache.hit_tokens_disk"] > 0  # the undamaged checkpoints still serve
    if damage != "delete":
        assert s["disk.damaged_items"] > 0  # read, failed to verify, counted and forgotten
    core.close()


def test_files_deleted_while_the_engine_reads_them_are_a_miss(core_factory: Any, tmp_path: Path) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(6)
    convs = _conversations(rng)
    convs = _next_turn(convs, _warm_store(core_factory, tmp_path, convs), rng)
    core = core_factory(**_disk(tmp_path))  # opened (indexed) first, then the files go
    for p in _store_files(tmp_path):
        p.unlink()
    assert serve(core, convs, 6) == serve(plain, convs, 6)
    assert core.stats()["prefix_cache.hit_tokens_disk"] == 0
    core.close()


def test_another_models_store_is_set_aside(core_factory: Any, tmp_path: Path) -> None:
    rng = random.Random(7)
    convs = _conversations(rng)
    convs = _next_turn(convs, _warm_store(core_factory, tmp_path, convs), rng)
    # another block size: another cache identity (its keys would name other prefixes)
    other = core_factory(**_disk(tmp_path, **{"cache.block_size": 32}))
    plain = core_factory(**{"cache.enable_prefix_caching": False, "cache.block_size": 32})
    assert serve(other, convs, 6) == serve(plain, convs, 6)
    assert other.stats()["prefix_cache.hit_tokens_disk"] == 0
    assert other.disk is not None and other.disk.store.describe()["set_aside"]
    other.close()


def test_two_engines_on_one_path_the_second_is_refused(core_factory: Any, tmp_path: Path) -> None:
    first = core_factory(**_disk(tmp_path))
    with pytest.raises(ConfigError, match="cache.disk_path"):
        core_factory(**_disk(tmp_path))
    first.close()
    core_factory(**_disk(tmp_path)).close()  # unlocked on close


def test_a_foreign_folder_is_a_config_error_and_untouched(core_factory: Any, tmp_path: Path) -> None:
    data = tmp_path / "store"
    (data / "photos").mkdir(parents=True)
    (data / "photos" / "a.jpg").write_bytes(b"\xff\xd8 a photo")
    (data / ".profile").write_text("umask 022\n")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    with pytest.raises(ConfigError) as err:
        core_factory(**_disk(tmp_path))
    assert str(err.value) == (
        f"cache.disk_path = {str(data)!r}: {data} is not a deltaserve disk store and is not empty "
        "(manifest.json: missing); choose an empty folder or a new path"
    )
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    assert (data / "photos" / "a.jpg").read_bytes() == b"\xff\xd8 a photo"


def test_a_full_disk_drops_and_changes_nothing(core_factory: Any, tmp_path: Path) -> None:
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(9)
    convs = _conversations(rng)
    size = core_factory().cache.config.checkpoint_bytes  # room for about one checkpoint
    for _ in range(2):
        core = core_factory(**_disk(tmp_path, **{"cache.disk_bytes": 2 * size}))
        outs = serve(core, convs, 6)
        assert outs == serve(plain, convs, 6)
        assert core.disk is not None
        assert core.disk.store.stats()["disk.bytes"] <= 2 * size
        core.close()
        convs = _next_turn(convs, outs, rng)


def test_with_a_host_tier_under_pressure_every_tier_serves_and_nothing_changes(
    core_factory: Any, tmp_path: Path
) -> None:
    """Device and host both far smaller than six conversations: what they drop is written
    back (or was written through) and comes back from disk; outputs equal cache-off."""
    slot = core_factory().cache.config.checkpoint_bytes
    block = core_factory().capacity.kv_block_bytes
    core = core_factory(
        **_disk(
            tmp_path,
            **{
                "cache.checkpoint_pool_bytes": 2 * slot,
                "cache.num_kv_blocks": 48,
                "cache.checkpoint_interval": 0,
                "cache.host_kv_cache_bytes": 40 * block,
                "cache.host_checkpoint_pool_bytes": 2 * slot,
            },
        )
    )
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    rng = random.Random(11)
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(6)]
    for turn in range(3):
        outs = serve(core, convs, 6)
        assert outs == serve(plain, convs, 6), f"turn {turn}: an output changed"
        convs = _next_turn(convs, outs, rng)
    s = core.stats()
    assert s["prefix_cache.hit_tokens_disk"] > 0 and s["host.kv_demoted_blocks"] > 0
    assert s["prefix_cache.hit_tokens"] == (
        s["prefix_cache.hit_tokens_device"]
        + s["prefix_cache.hit_tokens_host"]
        + s["prefix_cache.hit_tokens_disk"]
    )
    core.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_one_budget_under_pressure_with_a_disk_changes_nothing(
    core_factory: Any, tmp_path: Path, overlap: bool
) -> None:
    """One device budget too small for the conversations (served side by side: KV blocks move
    out of pages that captures take, so a disk load's block may move before its copy runs),
    with a disk below it: outputs equal cache-off at every turn."""
    page = 14 * 32 * 1024  # the tiny model's page: 14 KV blocks of 16 tokens, one checkpoint
    core = core_factory(
        **_disk(
            tmp_path,
            **{
                "cache.num_kv_blocks": None,
                "cache.memory_bytes": (8 + 16) * page,  # 8 live slots, 16 shared pages
                "cache.checkpoint_interval": 64,
                "engine.async_scheduling": overlap,
            },
        )
    )
    assert core.capacity.num_pages == 16 and core.cache.budget is not None
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    converse(core, plain, random.Random(32), 8)
    s = core.stats()
    assert s["prefix_cache.hit_tokens_disk"] > 0 and s["kv.moved_blocks"] > 0
    core.close()


def test_a_request_for_prompt_logprobs_takes_no_disk_hit(core_factory: Any, tmp_path: Path) -> None:
    rng = random.Random(15)
    convs = _conversations(rng)[:1]
    convs = _next_turn(convs, _warm_store(core_factory, tmp_path, convs), rng)
    core = core_factory(**_disk(tmp_path))
    req = core.make_request(convs[0], greedy(2, prompt_logprobs=1))
    core.add_request(req)
    outs = run_to_completion(core)[req.request_id]
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(convs[0])
    assert outs[-1].num_cached_tokens == 0
    assert core.stats()["prefix_cache.hit_tokens_disk"] == 0
    core.close()
