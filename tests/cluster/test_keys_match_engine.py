"""The router's keys are the engine's radix keys: what a replica reports is what the ingress hashes."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cluster.affinity import route_keys
from deltaserve.cluster.replica import cache_keys
from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model


@pytest.fixture(scope="module")
def core() -> EngineCore:
    loaded = load_model(
        ensure_builtin_model("tiny-qwen3.5"), dtype=torch.float32, device="cpu", ops=get_ops("reference")
    )
    cfg = EngineConfig.load(
        None,
        {
            "cache.memory_bytes": 64 * 1024**2,
            "scheduler.max_num_batched_tokens": 256,
            "logging.stats_interval_s": 60.0,
        },
    )
    return EngineCore(cfg, loaded=loaded)


def run(core: EngineCore, ids: list[int], salt: str | None = None) -> list[int]:
    req = core.make_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), cache_salt=salt)
    core.add_request(req)
    out: list[int] = []
    for _ in range(200):
        for o in core.step():
            out += o.token_ids
        if not core.has_work():
            break
    core.check_integrity()
    return out


def test_reported_checkpoint_keys_are_the_routed_prompt_keys(core: EngineCore) -> None:
    unit, bs = core.cache.unit, core.cache.block_size
    ids = [(7 * i + 3) % 900 + 10 for i in range(300)]
    run(core, ids)
    run(core, ids, salt="tenant")
    ckpt, kv = cache_keys(core, 10_000)  # type: ignore[misc]
    for tenant in (None, "tenant"):
        req = core.make_request(ids, SamplingParams(max_tokens=1), cache_salt=tenant)
        keys = route_keys(ids, block_size=bs, unit=unit, salt=req.cache_salt)
        assert len(keys) == (len(ids) - 1) // unit
        assert keys[-1] in ckpt  # the tail checkpoint the next turn resumes from
        assert set(keys[:-1]) <= set(kv) | set(ckpt)  # the KV path to it
    assert len(set(ckpt)) == len(ckpt) and not set(ckpt) & set(kv)
    assert cache_keys(core, 1)[0] == ckpt[:1]  # capped, most recent first
