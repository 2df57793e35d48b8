"""The host tier never changes an output, and a failed copy ends only its request.

Device pools far smaller than the working set force demotion of KV blocks and checkpoints
to the host tier and their promotion on later turns; cache-on outputs must equal
cache-off outputs at every turn, with ``check_integrity()`` after every step
(``run_to_completion``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.cache.types import TransferKind
from tests.engine.conftest import greedy, run_to_completion
from tests.engine.test_prefix_cache import rand_tokens, serve


def _pressured(core_factory: Any, **extra: Any) -> Any:
    slot = core_factory().cache.config.checkpoint_bytes
    block = core_factory().capacity.kv_block_bytes
    dotted = {
        "cache.checkpoint_pool_bytes": 2 * slot,
        "cache.num_kv_blocks": 48,  # two or three of the six conversations' KV
        "cache.checkpoint_interval": 0,
        "cache.host_kv_cache_bytes": 2000 * block,
        "cache.host_checkpoint_pool_bytes": 40 * slot,
    }
    dotted.update(extra)
    return core_factory(**dotted)


def _turns(core: Any, plain: Any, rng: random.Random, n_turns: int = 4) -> None:
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(6)]
    for turn in range(n_turns):
        warm = serve(core, convs, 6, waves=True)  # one after another: each evicts the others
        assert warm == serve(plain, convs, 6, waves=False), f"turn {turn}: the host tier changed an output"
        convs = [c + w + rand_tokens(rng, 24) for c, w in zip(convs, warm, strict=True)]


@pytest.mark.parametrize("policy", ["default", pytest.param("v1", marks=pytest.mark.slow)])
def test_demoted_and_promoted_state_changes_nothing(core_factory: Any, policy: str) -> None:
    core = _pressured(core_factory, **{"cache.checkpoint_policy": policy})
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    _turns(core, plain, random.Random(31), n_turns=3)
    s = core.stats()
    assert s["host.kv_demoted_blocks"] > 0 and s["host.kv_promoted_blocks"] > 0
    assert s["host.checkpoints_demoted"] > 0 and s["host.checkpoints_restored"] > 0
    assert s["prefix_cache.hit_tokens_host"] > 0
    assert (
        s["prefix_cache.hit_tokens"]
        == s["prefix_cache.hit_tokens_host"] + s["prefix_cache.hit_tokens_device"]
    )
    assert s["host.bytes_loaded"] > 0 and s["host.bytes_saved"] > 0
    assert s["host.loads_completed"] > 0


def test_host_tier_hits_more_than_the_device_alone(core_factory: Any) -> None:
    rng = random.Random(5)
    with_host = _pressured(core_factory)
    device_only = _pressured(
        core_factory, **{"cache.host_kv_cache_bytes": 0, "cache.host_checkpoint_pool_bytes": 0}
    )
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(6)]
    for _ in range(3):
        a = serve(with_host, convs, 6)
        assert serve(device_only, convs, 6) == a
        convs = [c + w + rand_tokens(rng, 24) for c, w in zip(convs, a, strict=True)]
    assert with_host.stats()["prefix_cache.hit_tokens"] > device_only.stats()["prefix_cache.hit_tokens"]


def test_one_copy_per_step_budget_changes_nothing(core_factory: Any) -> None:
    core = _pressured(core_factory, **{"cache.host_load_bytes_per_step": 1})
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    _turns(core, plain, random.Random(8), n_turns=3)
    assert core.stats()["host.kv_promoted_blocks"] > 0


def test_failed_load_ends_only_the_request_that_needed_it(core_factory: Any, monkeypatch: Any) -> None:
    rng = random.Random(12)
    core = _pressured(core_factory)
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(6)]
    first = serve(core, convs, 6)
    convs = [c + w + rand_tokens(rng, 24) for c, w in zip(convs, first, strict=True)]
    host = core.runner.host
    assert host is not None
    real_copy = host._copy
    broken: list[str] = []

    def flaky(transfers: Any, device: Any) -> None:
        t = transfers[0]
        if t.kind.is_load and not broken:
            broken.append(t.seq.request_id)
            raise RuntimeError("injected copy failure")
        real_copy(transfers, device)

    monkeypatch.setattr(host, "_copy", flaky)
    reqs = [core.make_request(c, greedy(6)) for c in convs]
    for r in reqs:
        core.add_request(r)
    outs = run_to_completion(core)  # integrity after every step
    expected = serve(plain, convs, 6, waves=False)
    assert len(broken) == 1
    for r, want in zip(reqs, expected, strict=True):
        last = outs[r.request_id][-1]
        if r.request_id == broken[0]:
            assert last.finish_reason == "error" and "host tier load failed" in (last.error or "")
            assert "injected copy failure" in (last.error or "")
        else:
            assert last.finish_reason == "length"
            assert [t for o in outs[r.request_id] for t in o.token_ids] == want
    assert core.stats()["host.failed_loads"] >= 1
    # the host copies are intact: the same prompt is served from them, correctly
    again = core.make_request(convs[[r.request_id for r in reqs].index(broken[0])], greedy(6))
    core.add_request(again)
    out = run_to_completion(core)[again.request_id]
    assert [t for o in out for t in o.token_ids] == expected[[r.request_id for r in reqs].index(broken[0])]


def test_failed_save_drops_items_and_fails_no_request(core_factory: Any, monkeypatch: Any) -> None:
    core = _pressured(core_factory)
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    host = core.runner.host
    assert host is not None
    real_copy = host._copy

    def no_saves(transfers: Any, device: Any) -> None:
        if transfers[0].kind in (TransferKind.KV_SAVE, TransferKind.CKPT_SAVE):
            raise RuntimeError("injected save failure")
        real_copy(transfers, device)

    monkeypatch.setattr(host, "_copy", no_saves)
    _turns(core, plain, random.Random(3), n_turns=2)
    s = core.stats()
    assert s["host.failed_saves"] > 0 and s["requests.failed"] == 0
    assert s["host.kv_promoted_blocks"] == 0  # nothing was ever usable on the host


@pytest.mark.parametrize("overlap", [False, True])
def test_one_budget_on_both_tiers_changes_nothing(core_factory: Any, overlap: bool) -> None:
    """Device and host each one budget of pages (the engine's arenas): demoted and promoted
    KV and checkpoints, pages changing use on both tiers, outputs equal to cache-off."""
    page = core_factory().capacity.kv_block_bytes * 14  # the tiny model's page: 14 blocks
    core = core_factory(
        **{
            "cache.num_kv_blocks": None,
            "cache.memory_bytes": (8 + 8) * page,  # 8 live slots, 8 shared pages
            "cache.checkpoint_interval": 0,
            "cache.host_memory_bytes": 40 * page,
            "engine.async_scheduling": overlap,
        }
    )
    assert core.capacity.num_pages == 8 and core.capacity.num_host_pages == 40
    assert core.runner.host is not None and core.runner.host.caches.arena is not None
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    _turns(core, plain, random.Random(33), n_turns=3)
    s = core.stats()
    assert s["host.kv_demoted_blocks"] > 0 and s["host.kv_promoted_blocks"] > 0
    assert s["host.checkpoints_demoted"] > 0 and s["host.checkpoints_restored"] > 0
    assert s["prefix_cache.hit_tokens_host"] > 0
    assert s["cache.pages_to_kv"] > 0 and s["cache.pages_to_checkpoints"] > 0


def test_a_full_host_vacates_kv_pages_and_changes_nothing(core_factory: Any) -> None:
    """A host of one budget too small for the conversations: checkpoints coming down find no
    free page and KV pages are vacated into the others' free blocks (host-to-host copies run
    before the saves that overwrite the page); outputs equal to cache-off."""
    page = core_factory().capacity.kv_block_bytes * 14
    core = core_factory(
        **{
            "cache.num_kv_blocks": None,
            "cache.memory_bytes": (8 + 8) * page,
            "cache.checkpoint_interval": 0,
            "cache.host_memory_bytes": 10 * page,
        }
    )
    plain = core_factory(**{"cache.enable_prefix_caching": False})
    _turns(core, plain, random.Random(34), n_turns=4)
    s = core.stats()
    assert s["host.kv_moved_blocks"] > 0 and s["host.checkpoints_evicted"] > 0
    assert s["prefix_cache.hit_tokens_host"] > 0
