"""CacheSpec sizes and allocation follow docs/contracts.md."""

from __future__ import annotations

import torch

from deltaserve.models import CacheSpec, ModelCaches


def spec(dtype: torch.dtype = torch.bfloat16) -> CacheSpec:
    return CacheSpec(
        num_attn_layers=2,
        num_kv_heads=2,
        head_dim=64,
        num_gdn_layers=6,
        conv_dim=2 * 2 * 64 + 4 * 64,
        conv_kernel=4,
        num_v_heads=4,
        key_head_dim=64,
        value_head_dim=64,
        dtype=dtype,
    )


def test_byte_counts() -> None:
    s = spec(torch.bfloat16)
    assert s.kv_block_bytes(16) == 2 * 2 * 16 * 2 * 64 * 2  # layers * (K+V) * bs * Hkv * D * 2 bytes
    conv = 512 * 3 * 2
    ssm = 4 * 64 * 64 * 4  # always fp32
    assert s.state_slot_bytes() == 6 * (conv + ssm)
    assert spec(torch.float32).state_slot_bytes() == 6 * (512 * 3 * 4 + ssm)


def test_allocate_shapes_and_dtypes() -> None:
    caches = spec().allocate(num_blocks=5, block_size=16, num_state_slots=3, device="cpu")
    assert isinstance(caches, ModelCaches)
    assert len(caches.k_cache) == len(caches.v_cache) == 2
    assert len(caches.conv_state) == len(caches.ssm_state) == 6
    assert caches.k_cache[0].shape == (5, 16, 2, 64) and caches.k_cache[0].dtype == torch.bfloat16
    assert caches.conv_state[0].shape == (3, 512, 3) and caches.conv_state[0].dtype == torch.bfloat16
    assert caches.ssm_state[0].shape == (3, 4, 64, 64) and caches.ssm_state[0].dtype == torch.float32
    assert caches.state_tensors() == [*caches.conv_state, *caches.ssm_state]
    # byte counts agree with what was allocated
    kv = sum(t.numel() * t.element_size() for t in caches.k_cache + caches.v_cache)
    st = sum(t.numel() * t.element_size() for t in caches.state_tensors())
    assert kv == 5 * spec().kv_block_bytes(16)
    assert st == 3 * spec().state_slot_bytes()


def test_cache_spec_of_models(envs) -> None:  # noqa: ANN001 - fixture
    hybrid = envs.get("qwen3_5-gqa2-ratio2").loaded.model.cache_spec()
    assert (hybrid.num_attn_layers, hybrid.num_gdn_layers) == (1, 3)
    assert hybrid.conv_dim == 2 * 2 * 16 + 4 * 16 and hybrid.conv_kernel == 4
    assert (hybrid.num_v_heads, hybrid.key_head_dim, hybrid.value_head_dim) == (4, 16, 16)
    assert (hybrid.num_kv_heads, hybrid.head_dim, hybrid.dtype) == (2, 32, torch.float32)
    dense = envs.get("qwen3-dense").loaded.model.cache_spec()
    assert (dense.num_attn_layers, dense.num_gdn_layers, dense.state_slot_bytes()) == (3, 0, 0)
