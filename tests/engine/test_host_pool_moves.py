"""The host pool runs a vacated page's block moves before the saves: with one host budget a
checkpoint saved into a page overwrites the rows its KV blocks held (CPU tensors, the same
code path as pinned ones on CUDA)."""

from __future__ import annotations

import torch

from deltaserve.cache.types import StepPlan, Transfer, TransferKind
from deltaserve.engine.runner.host_pool import HostPool
from deltaserve.models import CacheSpec

SPEC = CacheSpec(
    num_attn_layers=2, num_kv_heads=2, head_dim=16, num_gdn_layers=2, conv_dim=25, conv_kernel=4,
    num_v_heads=2, key_head_dim=16, value_head_dim=16, dtype=torch.float32,
)  # fmt: skip


def test_block_moves_land_before_a_checkpoint_save_overwrites_their_page() -> None:
    pool = HostPool(SPEC, 0, 4, 0, torch.device("cpu"), num_pages=3)
    host = pool.caches
    assert host.layout is not None
    n = host.layout.page_blocks
    gen = torch.Generator().manual_seed(0)
    for t in host.k_cache + host.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    device = SPEC.allocate(8, 4, 2, "cpu")
    for t in device.state_tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    # page 1's first two blocks go to page 0's last two; the checkpoint then takes page 1
    src, dst = [n, n + 1], [n - 2, n - 1]
    before = [t[src].clone() for t in host.k_cache + host.v_cache]
    save = Transfer(TransferKind.CKPT_SAVE, None, 1, 1)  # device slot 1 -> host page 1
    moves = [Transfer(TransferKind.KV_MOVE, None, s, d) for s, d in zip(src, dst, strict=True)]
    failed = pool.transfer(StepPlan(items=[], saves=[save, *moves]), device)  # (the save listed first)
    assert failed == []
    for t, rows in zip(host.k_cache + host.v_cache, before, strict=True):
        assert torch.equal(t[dst], rows)
    for h, d in zip(host.state_tensors(), device.state_tensors(), strict=True):
        assert torch.equal(h[1], d[1])
