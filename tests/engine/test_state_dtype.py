"""``model.ssm_state_dtype``: the recurrent state in bfloat16, live and in every checkpoint.

A bfloat16 state rounds where a state is stored: between prefill chunks, after each decode step
and at a checkpoint. A hit restores exactly what a cold run with a chunk boundary at the hit
stores there, so warm and cold outputs agree as closely as float32 ones do; against a float32
state they differ by the rounding.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deltaserve.engine.config import ConfigError, StateDType
from deltaserve.engine.core.builder import resolve_state_dtype, salt_parts
from tests.engine.conftest import make_config
from tests.engine.test_prefix_cache import sampled_logits, serve
from tests.tolerances import BF16_STATE, assert_logits_close

BF16 = {"model.ssm_state_dtype": "bfloat16"}


def test_bfloat16_state_is_allocated_and_halves_the_state_bytes(core_factory: Any) -> None:
    f32, b16 = core_factory(), core_factory(**BF16)
    assert f32.config.model.ssm_state_dtype is StateDType.FLOAT32  # auto, pinned: the tiny config names none
    assert all(t.dtype == torch.bfloat16 for t in b16.runner.caches.ssm_state)
    assert all(t.dtype == torch.float32 for t in f32.runner.caches.ssm_state)
    spec = f32.spec
    ssm = spec.num_gdn_layers * spec.num_v_heads * spec.key_head_dim * spec.value_head_dim
    assert f32.spec.state_slot_bytes() - b16.spec.state_slot_bytes() == ssm * 2
    # the checkpoint pools hold the state's bytes: the same budget holds more checkpoints
    assert b16.cache.slots.num_checkpoint > f32.cache.slots.num_checkpoint


def test_a_hit_on_a_bfloat16_state_changes_nothing(core_factory: Any, monkeypatch: Any) -> None:
    """Warm (a restored bfloat16 checkpoint + cached KV) vs cold, both chunked at 256 tokens
    (``scheduler.max_num_batched_tokens``): the hit restores the state the cold run rounds there."""
    rng = random.Random(22)
    first = [rng.randrange(3, 1000) for _ in range(260)]
    second = first + [rng.randrange(3, 1000) for _ in range(90)]
    warm = core_factory(**BF16)
    cold = core_factory(**BF16, **{"cache.enable_prefix_caching": False})
    sampled_logits(warm, first, monkeypatch)
    warm_logits, hit = sampled_logits(warm, second, monkeypatch)
    cold_logits, _ = sampled_logits(cold, second, monkeypatch)
    assert hit == 256
    assert_logits_close(warm_logits, cold_logits, "bfloat16 state: warm vs cold", BF16_STATE)
    # the rounding is there: a float32 state's logits are near, not equal
    f32_logits, _ = sampled_logits(
        core_factory(**{"cache.enable_prefix_caching": False}), second, monkeypatch
    )
    assert_logits_close(cold_logits, f32_logits, "bfloat16 vs float32 state", BF16_STATE)
    assert not torch.equal(cold_logits, f32_logits)


def test_auto_follows_the_model_configs_mamba_ssm_dtype(tiny_loaded: Any, monkeypatch: Any) -> None:
    for named, expected in (
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("float16", torch.float32),
    ):
        monkeypatch.setattr(tiny_loaded.hf_config, "mamba_ssm_dtype", named, raising=False)
        config = make_config()
        assert resolve_state_dtype(config, tiny_loaded) is expected
        assert config.model.ssm_state_dtype is StateDType(str(expected).removeprefix("torch."))
    config = make_config(**{"model.ssm_state_dtype": "float32"})  # configured beats the model's
    monkeypatch.setattr(tiny_loaded.hf_config, "mamba_ssm_dtype", "bfloat16", raising=False)
    assert resolve_state_dtype(config, tiny_loaded) is torch.float32


def test_the_salt_names_a_bfloat16_state_only(tiny_loaded: Any) -> None:
    """float32 keeps the salt every store was written with; bfloat16 states never answer
    float32 requests (or the reverse), in any tier."""
    f32, b16 = make_config(**{"model.ssm_state_dtype": "float32"}), make_config(**BF16)
    assert salt_parts(f32, tiny_loaded) == (str(tiny_loaded.path), f32.model.dtype.value, f32.cache.namespace)
    assert salt_parts(b16, tiny_loaded) == (*salt_parts(f32, tiny_loaded), "ssm_state=bfloat16")


def test_an_unknown_state_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.ssm_state_dtype"):
        make_config(**{"model.ssm_state_dtype": "float16"})


def test_bfloat16_checkpoints_move_between_the_tiers(core_factory: Any) -> None:
    """One budget on both tiers, pressured (as tests/engine/test_host_tier.py): bfloat16 states
    are demoted to the host arena, restored from it, and every page and slot comes back
    (``check_integrity()`` after every step, in ``serve``)."""
    page = core_factory(**BF16).capacity.kv_block_bytes * 8  # the bf16 tiny page: 8 blocks
    core = core_factory(
        **BF16,
        **{
            "cache.num_kv_blocks": None,
            "cache.memory_bytes": (8 + 8) * page,
            "cache.checkpoint_interval": 0,
            "cache.host_memory_bytes": 40 * page,
        },
    )
    assert core.capacity.num_pages == 8 and core.capacity.num_host_pages == 40
    host = core.runner.host
    assert host is not None and all(t.dtype == torch.bfloat16 for t in host.caches.ssm_state)
    rng = random.Random(33)
    convs = [[rng.randrange(3, 1000) for _ in range(140 + 25 * i)] for i in range(6)]
    for _turn in range(3):
        replies = serve(core, convs, 6, waves=True)
        assert all(len(r) == 6 for r in replies)
        convs = [
            c + r + [rng.randrange(3, 1000) for _ in range(24)] for c, r in zip(convs, replies, strict=True)
        ]
    s = core.stats()
    assert s["host.checkpoints_demoted"] > 0 and s["host.checkpoints_restored"] > 0
    assert s["prefix_cache.hit_tokens_host"] > 0


def test_a_float32_store_is_set_aside_by_a_bfloat16_engine(core_factory: Any, tmp_path: Any) -> None:
    """The disk tier across a restart that changes the state's dtype: the store of the other
    dtype is set aside (its checkpoints are another size and its keys another salt); one of
    the same dtype serves the next turn."""
    disk = {"cache.disk_path": str(tmp_path / "store"), "cache.disk_write_bytes_per_s": None}
    rng = random.Random(3)
    convs = [[rng.randrange(3, 1000) for _ in range(150 + 30 * i)] for i in range(3)]
    f32 = core_factory(**disk)
    outs = serve(f32, convs, 6)
    f32.close()
    convs = [c + o + [rng.randrange(3, 1000) for _ in range(20)] for c, o in zip(convs, outs, strict=True)]
    b16 = core_factory(**BF16, **disk)
    outs = serve(b16, convs, 6)
    assert b16.stats()["prefix_cache.hit_tokens_disk"] == 0
    assert b16.disk is not None and b16.disk.store.describe()["set_aside"]
    b16.close()
    convs = [c + o + [rng.randrange(3, 1000) for _ in range(20)] for c, o in zip(convs, outs, strict=True)]
    again = core_factory(**BF16, **disk)
    serve(again, convs, 6)
    s = again.stats()
    assert s["prefix_cache.hit_tokens_disk"] > 0 and s["disk.checkpoints_loaded"] > 0
    again.close()
