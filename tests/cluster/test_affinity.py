"""The prefix-affinity logic without Ray: keys, per-replica views, decisions, corrections."""

from __future__ import annotations

import random

import pytest

from deltaserve.cache import CheckpointGranularity, checkpoint_unit
from deltaserve.cache.hashing import block_hashes, make_salt
from deltaserve.cluster.affinity import (
    AffinityIndex,
    AffinityPolicy,
    RouteHint,
    pack_keys,
    route_keys,
    short_key,
    unpack_keys,
)
from deltaserve.cluster.config import ClusterConfig
from deltaserve.engine.errors import ConfigError

BS, UNIT = 16, 64
SALT = make_salt("model", "float32", "default", None)


def hint(ids: list[int], salt: bytes = SALT) -> RouteHint:
    return RouteHint(tuple(route_keys(ids, block_size=BS, unit=UNIT, salt=salt)), UNIT, len(ids))


def conv(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def index(**policy: object) -> tuple[AffinityIndex, Clock]:
    clock = Clock()
    ix = AffinityIndex(AffinityPolicy(**policy), clock=clock, rng=random.Random(0))  # type: ignore[arg-type]
    ix.set_replicas(["a", "b"])
    return ix, clock


# ---------------------------------------------------------------------------- keys
def test_unit_and_keys_are_the_engine_block_hashes_at_unit_boundaries() -> None:
    chunk = CheckpointGranularity.CHUNK
    assert checkpoint_unit(16) == 16 and checkpoint_unit(48) == 48  # the default: any block boundary
    assert checkpoint_unit(16, granularity=chunk) == 64 and checkpoint_unit(48, granularity=chunk) == 192
    assert checkpoint_unit(16, has_gdn=False, granularity=chunk) == 16
    ids = conv(1, 200)
    keys = route_keys(ids, block_size=BS, unit=UNIT, salt=SALT)
    full = block_hashes(ids, BS, SALT)
    assert keys == [short_key(full[3]), short_key(full[7]), short_key(full[11])]  # 64, 128, 192 <= 199
    # a hit must leave one token: 128 tokens give one boundary (64), 129 give two
    assert len(route_keys(ids[:128], block_size=BS, unit=UNIT, salt=SALT)) == 1
    assert len(route_keys(ids[:129], block_size=BS, unit=UNIT, salt=SALT)) == 2
    assert (
        route_keys(ids[:64], block_size=BS, unit=UNIT, salt=SALT)
        == []
        == route_keys([], block_size=BS, unit=UNIT, salt=SALT)
    )
    # chained: a shared prefix shares keys, the first differing unit and all after differ
    other = ids[:100] + conv(2, 100)
    k2 = route_keys(other, block_size=BS, unit=UNIT, salt=SALT)
    assert k2[0] == keys[0] and k2[1] != keys[1] and k2[2] != keys[2]
    with pytest.raises(ValueError):
        route_keys(ids, block_size=48, unit=64, salt=SALT)


def test_tenants_never_share_keys() -> None:
    ids = conv(1, 300)
    a = set(route_keys(ids, block_size=BS, unit=UNIT, salt=make_salt("m", "f", "d", "tenant-a")))
    b = set(route_keys(ids, block_size=BS, unit=UNIT, salt=make_salt("m", "f", "d", "tenant-b")))
    assert a and b and not a & b


def test_pack_roundtrip() -> None:
    keys = [0, 1, (1 << 64) - 1, 123456789]
    assert unpack_keys(pack_keys(keys)) == set(keys)
    assert unpack_keys(None) == set() and unpack_keys(b"") == set() and unpack_keys([3, 4]) == {3, 4}


# ---------------------------------------------------------------------------- decisions
def test_next_turn_follows_the_conversation() -> None:
    ix, _ = index()
    t0 = conv(1, 300)
    assert ix.choose(hint(t0), {"a": 0, "b": 0}).reason == "miss"  # nothing known: pow2
    ix.on_routed("b", "r0", hint(t0))
    t1 = t0 + conv(11, 40) + conv(12, 60)  # + the reply + the next user turn
    d = ix.choose(hint(t1), {"a": 0, "b": 0})
    assert d.reason == "joint" and d.ranks is not None and d.ranks[0] == ["b"]
    assert d.expected_hit_tokens == 256  # the tail checkpoint of turn 0: deepest unit <= 299
    assert [r for rank in d.ranks for r in rank] == ["b", "a"]  # every replica ranked (fallthrough)
    assert ix.match("b", hint(t1)) == (256, 256) and ix.match("a", hint(t1)) == (0, 0)


def test_new_conversations_spread_and_other_tenants_do_not_stick() -> None:
    ix, _ = index()
    t0 = conv(1, 300)
    ix.on_routed("a", "r0", hint(t0))
    assert ix.choose(hint(conv(2, 300)), {"a": 0, "b": 0}).ranks is None  # a stranger: pow2
    tenant = make_salt("model", "float32", "default", "t2")
    assert ix.choose(hint(t0, tenant), {"a": 0, "b": 0}).reason == "miss"
    # pow2 samples two of the candidates, all when there are two
    assert sorted(ix.pow2(["a", "b"])[0]) == ["a", "b"]
    assert len(ix.pow2(["a", "b", "c", "d"])[0]) == 2


def test_load_outweighs_a_short_match_but_not_a_long_one() -> None:
    ix, _ = index(load_cost_tokens=100)
    shared = conv(7, 140)  # a system prompt: 2 units
    ix.on_routed("a", "r0", hint(shared + conv(1, 10)))  # tail checkpoint at 128 on a
    new = shared + conv(2, 60)  # 200 tokens, 128 of them held by a
    d = ix.choose(hint(new), {"a": 0, "b": 0})
    assert d.reason == "joint" and d.ranks[0] == ["a"]  # type: ignore[index]
    # a busy: 72 + 3 x 100 uncached-token equivalents on a > 200 + 0 on b
    d = ix.choose(hint(new), {"a": 3, "b": 0})
    assert d.reason == "joint" and d.ranks[0] == ["b"]  # type: ignore[index]
    # a long conversation is worth more than the queue
    long = conv(9, 2000)
    ix.on_routed("a", "r1", hint(long))
    d = ix.choose(hint(long + conv(3, 50)), {"a": 3, "b": 0})
    assert d.ranks[0] == ["a"]  # type: ignore[index]


def test_imbalance_and_threshold_fall_back_to_pow2() -> None:
    ix, _ = index(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5)
    t0 = conv(1, 300)
    ix.on_routed("a", "r0", hint(t0))
    t1 = t0 + conv(2, 20)
    assert ix.choose(hint(t1), {"a": 10, "b": 1}).reason == "imbalanced"
    assert ix.choose(hint(t1), {"a": 10, "b": 8}).reason == "joint"  # 10 < 1.5 x 8: balanced enough
    assert ix.choose(hint(t0 + conv(3, 400)), {"a": 0, "b": 0}).reason == "miss"  # 256 of 700 < 50 %
    assert ix.choose(None, {"a": 0, "b": 0}).reason == "no-keys"
    assert ix.choose(hint(conv(1, 50)), {"a": 0, "b": 0}).reason == "no-keys"  # shorter than a unit
    assert ix.counters["decisions.imbalanced"] == 1 and ix.counters["decisions.joint"] == 1


def test_kv_affinity_collects_a_shared_prefix_on_one_replica() -> None:
    ix, _ = index(cache_threshold=0.5)
    system = conv(7, 192)
    ix.on_routed("a", "r0", hint(system + conv(1, 100)))  # kv on a covers the system prompt
    d = ix.choose(hint(system + conv(2, 50)), {"a": 0, "b": 0})  # no checkpoint at 192 yet: KV only
    assert d.reason == "kv" and d.ranks is not None and d.ranks[0] == ["a"] and d.expected_hit_tokens == 0
    # routed there it predicts the branch checkpoint at the divergence (192): the next one hits it
    ix.on_routed("a", "r1", hint(system + conv(2, 50)))
    d = ix.choose(hint(system + conv(3, 60)), {"a": 0, "b": 0})
    assert d.reason == "joint" and d.expected_hit_tokens == 192
    ix2, _ = index(kv_affinity=False)
    ix2.on_routed("a", "r0", hint(system + conv(1, 100)))
    assert ix2.choose(hint(system + conv(2, 50)), {"a": 0, "b": 0}).reason == "miss"


# ---------------------------------------------------------------------------- corrections
def report(seq: int, t: float, ckpt: list[int], kv: list[int] = (), load: int = 0) -> dict:  # type: ignore[assignment]
    return {
        "epoch": "e", "seq": seq, "time": t, "running": load, "waiting": 0,
        "ckpt_keys": pack_keys(ckpt), "kv_keys": pack_keys(list(kv)), "stats": {"tokens.prompt": 7},
    }  # fmt: skip


def test_reports_confirm_correct_and_age_predictions() -> None:
    ix, clock = index()
    t0 = conv(1, 300)
    h0 = hint(t0)
    ix.on_routed("a", "r0", h0)
    # a report from before the request finished does not contradict the prediction
    assert ix.on_report("a", report(1, clock.t, []))
    assert not ix.on_report("a", report(1, clock.t, []))  # the same report twice: ignored
    assert ix.match("a", hint(t0 + [1] * 30))[0] == 256
    ix.on_completed("a", "r0")
    clock.t += 5
    # taken after it finished and without the tail key: the engine skipped or evicted it
    ix.on_report("a", report(2, clock.t, []))
    assert ix.match("a", hint(t0 + [1] * 30)) == (0, 0)
    assert ix.counters["predictions.dropped_by_report"] >= 1
    # the report is the truth: a key it has is held, until a later report drops it (eviction)
    ix.on_report("a", report(3, clock.t, [h0.keys[-1]], list(h0.keys[:-1])))
    assert ix.match("a", hint(t0 + [1] * 30)) == (256, 256)
    assert ix.views["a"].reported_load == 0 and ix.replica_stats()["a"] == {"tokens.prompt": 7}
    ix.on_report("a", report(4, clock.t, [], list(h0.keys[:-1]), load=3))
    assert ix.match("a", hint(t0 + [1] * 30)) == (0, 192) and ix.views["a"].reported_load == 3
    # a report without keys (the replica could not read its cache) keeps what was known
    ix.on_report("a", {"epoch": "e", "seq": 5, "time": clock.t, "running": 1, "waiting": 1})
    assert ix.match("a", hint(t0 + [1] * 30)) == (0, 192)
    # a restarted replica (new epoch) starting its seq at 1 again is a new report
    assert ix.on_report("a", {**report(1, clock.t, []), "epoch": "f"})


def test_predictions_expire_and_are_bounded() -> None:
    clock = Clock()
    ix = AffinityIndex(AffinityPolicy(), clock=clock, prediction_ttl_s=10, max_predicted_keys=4)
    ix.set_replicas(["a"])
    h = hint(conv(1, 700))  # 10 keys > 4
    ix.on_routed("a", "r0", h)
    assert len(ix.views["a"].kv_predicted) == 4
    ix.on_completed("a", "r0")
    clock.t += 11
    ix.on_report("a", {"epoch": "e", "seq": 1, "time": clock.t - 100, "running": 0, "waiting": 0})
    assert not ix.views["a"].ckpt_predicted and not ix.views["a"].kv_predicted
    assert ix.counters["predictions.expired"] >= 1


def test_dead_replicas_are_forgotten() -> None:
    ix, _ = index()
    t0 = conv(1, 300)
    ix.on_routed("a", "r0", hint(t0))
    ix.on_routed("a", "r1", hint(conv(2, 300)))
    ix.forget("a")
    assert "a" not in ix.views and ix.match("a", hint(t0)) == (0, 0) and ix.summary()["inflight"] == 0
    assert ix.choose(hint(t0 + [5] * 20), {"b": 0, "c": 0}).reason == "miss"
    ix.set_replicas(["b", "c"])
    assert set(ix.views) == {"b", "c"} and ix.counters["replicas.forgotten"] == 1
    ix.on_completed("a", "r0")  # a late completion of a forgotten replica: ignored
    s = ix.summary()
    assert set(s["replicas"]) == {"b", "c"} and s["counters"]["replicas.forgotten"] == 1


def test_policy_and_cluster_config_validation() -> None:
    with pytest.raises(ValueError):
        AffinityPolicy(cache_threshold=1.5)
    with pytest.raises(ValueError):
        AffinityPolicy(balance_rel_threshold=0.5)
    c = ClusterConfig(replicas=3, router="pow2", router_options={"cache_threshold": 0.3})
    assert c.router_kwargs() == {"affinity": False, "cache_threshold": 0.3}
    for bad in (
        {"replicas": 0},
        {"router": "random"},
        {"router_options": {"nope": 1}},
        {"router_options": {"cache_threshold": 2}},
        {"replicas": 3, "max_replicas": 2},
        {"route_prefix": "x"},
    ):
        with pytest.raises(ConfigError):
            ClusterConfig(**bad)  # type: ignore[arg-type]
