"""Capacity planning (engine/core/sizing.py): one budget for live slots, checkpoints and KV."""

from __future__ import annotations

import pytest

from deltaserve.cache.manager import GDN_CHUNK_SIZE
from deltaserve.engine import ConfigError, EngineConfig
from deltaserve.engine.core.sizing import ModelShape, build_scheduler, plan_capacity
from deltaserve.kernels.gdn import GDN_CHUNK_SIZE as KERNEL_CHUNK_SIZE

MiB = 1024**2
# Qwen3.5-0.8B in fp32: 6 attention layers x 2 x 2 KV heads x 256 x 4 B per token; 18 GDN
# layers x (conv 6144 x 3 + recurrent 16 x 128 x 128 fp32) per state.
QWEN35_08B = ModelShape(
    kv_bytes_per_token=6 * 2 * 2 * 256 * 4,
    state_bytes=18 * (6144 * 3 * 4 + 16 * 128 * 128 * 4),
    max_position_embeddings=262144,
)


def cfg(**dotted: object) -> EngineConfig:
    return EngineConfig.load(None, dict(dotted))


def test_chunk_size_is_one_number() -> None:
    assert GDN_CHUNK_SIZE == KERNEL_CHUNK_SIZE


def test_fixed_split_covers_every_pool_and_warns_when_live_slots_are_cut() -> None:
    cap = plan_capacity(cfg(**{"cache.checkpoint_fraction": 0.2}), QWEN35_08B)
    assert cap.budget_bytes == 1024 * MiB
    # live slots: at most half the budget -> 26 of 64
    assert cap.num_live_slots == 26 == (512 * MiB) // QWEN35_08B.state_bytes
    assert cap.max_num_seqs == 26
    rest = cap.budget_bytes - cap.live_bytes
    assert cap.num_checkpoint_slots == int(rest * 0.2) // QWEN35_08B.state_bytes
    assert cap.kv_bytes <= rest - cap.checkpoint_bytes < cap.kv_bytes + cap.kv_block_bytes
    assert cap.live_bytes + cap.checkpoint_bytes + cap.kv_bytes <= cap.budget_bytes
    assert cap.max_model_len == cap.kv_tokens < 262144
    assert any("at most 26 requests run at once" in w for w in cap.warnings)
    assert any(f"max_model_len = {cap.kv_tokens}: the model allows 262144" in w for w in cap.warnings)
    assert cap.describe()["max_concurrent_at_max_len"] == 1


def test_explicit_pool_sizes_replace_their_share() -> None:
    cap = plan_capacity(cfg(**{"cache.num_kv_blocks": 100, "cache.checkpoint_pool_bytes": 0}), QWEN35_08B)
    assert cap.num_kv_blocks == 100 and cap.num_checkpoint_slots == 0
    cap = plan_capacity(
        cfg(**{"cache.kv_cache_bytes": 64 * MiB, "cache.memory_bytes": 4096 * MiB}), QWEN35_08B
    )
    assert cap.kv_bytes <= 64 * MiB < cap.kv_bytes + cap.kv_block_bytes
    assert cap.num_live_slots == 64 and not any("requests run at once" in w for w in cap.warnings)


def test_explicit_sizes_beyond_the_budget_warn() -> None:
    cap = plan_capacity(
        cfg(**{"cache.memory_bytes": 64 * MiB, "cache.kv_cache_bytes": 1024 * MiB}), QWEN35_08B
    )
    assert any("more than the cache budget of 64 MiB" in w for w in cap.warnings)


def test_max_model_len_explicit_must_fit_the_pool() -> None:
    with pytest.raises(ConfigError, match=r"model.max_model_len = 100000: the KV pool holds only \d+ tokens"):
        plan_capacity(cfg(**{"model.max_model_len": 100000}), QWEN35_08B)
    cap = plan_capacity(cfg(**{"model.max_model_len": 4096}), QWEN35_08B)
    assert cap.max_model_len == 4096 and cap.max_concurrent_at_max_len >= 4


def test_models_without_gdn_or_without_attention() -> None:
    dense = ModelShape(kv_bytes_per_token=4096, state_bytes=0, max_position_embeddings=32768)
    cap = plan_capacity(cfg(), dense)
    assert cap.num_live_slots == 0 and cap.num_checkpoint_slots == 0
    assert cap.kv_bytes > 1000 * MiB and cap.max_num_seqs == 64
    pure_gdn = ModelShape(kv_bytes_per_token=0, state_bytes=MiB, max_position_embeddings=1 << 20)
    cap = plan_capacity(cfg(), pure_gdn)
    assert cap.max_model_len == 1 << 20 and cap.num_live_slots == 64
    assert cap.num_checkpoint_slots == int((1024 - 64) * MiB * 0.2) // MiB


def test_no_room_for_a_single_kv_block_is_a_config_error() -> None:
    tiny_budget = cfg(**{"cache.memory_bytes": 1024, "scheduler.max_num_seqs": 1})
    with pytest.raises(
        ConfigError,
        match=r"cache.memory_bytes = 1024 is below the minimum 64KiB \(65536 bytes\) needed for one KV block",
    ):
        plan_capacity(
            tiny_budget, ModelShape(kv_bytes_per_token=4096, state_bytes=0, max_position_embeddings=64)
        )


def test_build_scheduler_checks_the_unit_against_the_token_budget() -> None:
    config = cfg(**{
        "cache.block_size": 48, "cache.checkpoint_granularity": "chunk", "scheduler.max_num_batched_tokens": 128,
    })  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=r"must be >= the checkpoint unit \(192 tokens: cache.block_size, or lcm\(cache.block_size, 64\) "
        r"with cache.checkpoint_granularity = chunk\)",
    ):
        build_scheduler(config, plan_capacity(config, QWEN35_08B))
    sched = build_scheduler(cfg(), plan_capacity(cfg(), QWEN35_08B))
    assert sched.cache.unit == 16 and sched.max_num_seqs == 26
    chunked = cfg(**{"cache.checkpoint_granularity": "chunk"})
    assert build_scheduler(chunked, plan_capacity(chunked, QWEN35_08B)).cache.unit == 64


def test_the_engine_gives_the_cache_its_models_prefill_cost(core_factory: object) -> None:
    core = core_factory()  # type: ignore[operator]
    weights = sum(
        p.numel()
        for name, p in core.loaded.model.named_parameters()
        if "embed_tokens" not in name and not name.startswith("lm_head")
    )
    cfg = core.loaded.hf_config
    assert core.cache.config.prefill_cost_per_token == 2.0 * weights
    assert core.cache.config.prefill_cost_per_token_pair == 4.0 * cfg.num_attention_heads * cfg.head_dim * 2
