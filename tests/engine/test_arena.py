"""The shared device arena: capacity in pages, the runner's arena, block moves, and a model
forward on arena views equal to one on separate tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltaserve.cache.types import StepPlan, Transfer, TransferKind
from deltaserve.engine import ConfigError
from deltaserve.engine.core.builder import model_shape
from deltaserve.engine.core.sizing import ModelShape, build_cache_manager, plan_capacity
from deltaserve.engine.runner.model_runner import ModelRunner, RunnerSizes
from deltaserve.kernels import REFERENCE_OPS
from deltaserve.models import BatchMetadata, LoadedModel
from tests.engine.test_sizing import QWEN35_08B, MiB, cfg


def test_default_is_one_pool_of_pages() -> None:
    cap = plan_capacity(cfg(**{"scheduler.max_num_seqs": 8}), QWEN35_08B)
    block = QWEN35_08B.kv_bytes_per_token * 16
    assert cap.shared and cap.page_blocks == -(-QWEN35_08B.state_bytes // block) == 52
    assert cap.page_bytes == 52 * block and cap.page_bytes - QWEN35_08B.state_bytes < block
    assert cap.num_live_slots == 8 and cap.live_bytes == 8 * cap.page_bytes
    assert cap.num_pages == (cap.budget_bytes - cap.live_bytes) // cap.page_bytes
    assert cap.arena_bytes <= cap.budget_bytes < cap.arena_bytes + cap.page_bytes
    # the maxima: every page a checkpoint, or every page KV
    assert cap.num_checkpoint_slots == cap.num_pages
    assert cap.num_kv_blocks == cap.num_pages * 52
    assert cap.max_model_len == cap.num_pages * 52 * 16
    d = cap.describe()
    assert d["mode"] == "shared" and d["pages"] == cap.num_pages and d["page_blocks"] == 52
    assert d["arena_mib"] == round(cap.arena_bytes / MiB, 1) and "kv_mib" not in d


@pytest.mark.parametrize(
    "dotted",
    [
        {"cache.checkpoint_fraction": 0.3},
        {"cache.checkpoint_fraction": 0.0},
        {"cache.num_kv_blocks": 100},
        {"cache.kv_cache_bytes": 64 * MiB},
        {"cache.checkpoint_pool_bytes": 64 * MiB},
        {"cache.enable_prefix_caching": False},
    ],
)
def test_a_fixed_split_when_asked_or_when_nothing_is_cached(dotted: dict[str, Any]) -> None:
    cap = plan_capacity(cfg(**dotted), QWEN35_08B)
    assert not cap.shared and cap.num_pages == cap.page_blocks == 0
    assert cap.describe()["mode"] == "fixed"
    if "cache.checkpoint_fraction" in dotted:
        rest = cap.budget_bytes - cap.live_bytes
        assert cap.num_checkpoint_slots == int(rest * dotted["cache.checkpoint_fraction"]) // cap.state_bytes


def test_models_without_both_layer_kinds_are_fixed() -> None:
    dense = ModelShape(kv_bytes_per_token=4096, state_bytes=0, max_position_embeddings=32768)
    pure_gdn = ModelShape(kv_bytes_per_token=0, state_bytes=MiB, max_position_embeddings=1 << 20)
    assert not plan_capacity(cfg(), dense).shared
    assert not plan_capacity(cfg(), pure_gdn).shared


def test_padded_state_sizes_the_page() -> None:
    exact = ModelShape(kv_bytes_per_token=1024, state_bytes=4 * 1024 * 16, max_position_embeddings=4096)
    padded = ModelShape(
        kv_bytes_per_token=1024,
        state_bytes=4 * 1024 * 16,
        max_position_embeddings=4096,
        padded_state_bytes=65552,
    )
    assert plan_capacity(cfg(), exact).page_blocks == 4
    assert plan_capacity(cfg(), padded).page_blocks == 5


def test_explicit_max_model_len_is_bounded_by_every_page_as_kv() -> None:
    cap = plan_capacity(cfg(), QWEN35_08B)
    limit = cap.num_pages * cap.page_blocks * 16
    assert plan_capacity(cfg(**{"model.max_model_len": limit}), QWEN35_08B).max_model_len == limit
    with pytest.raises(
        ConfigError, match=rf"model.max_model_len = {limit + 1}: the KV pool holds only {limit}"
    ):
        plan_capacity(cfg(**{"model.max_model_len": limit + 1}), QWEN35_08B)


def test_no_room_for_a_page_is_a_config_error() -> None:
    budget = 30 * MiB  # a page is 19.5 MiB: the live slot takes the only one
    with pytest.raises(ConfigError, match=r"cache.memory_bytes = 31457280 is below the minimum 39MiB"):
        plan_capacity(cfg(**{"cache.memory_bytes": budget, "scheduler.max_num_seqs": 1}), QWEN35_08B)


def test_checkpoint_fraction_is_validated() -> None:
    for bad in (1.0, -0.1, "half"):
        with pytest.raises(ConfigError, match=r"cache.checkpoint_fraction"):
            cfg(**{"cache.checkpoint_fraction": bad})
    assert cfg().cache.checkpoint_fraction is None and not cfg().cache.fixed_split


def test_the_cache_manager_gets_the_pages() -> None:
    config = cfg(**{"scheduler.max_num_seqs": 4})
    cap = plan_capacity(config, QWEN35_08B)
    cm = build_cache_manager(config, cap)
    assert cm.config.shared_pages == cap.num_pages and cm.config.page_blocks == cap.page_blocks
    assert cm.config.num_kv_blocks == cap.num_pages * cap.page_blocks
    assert cm.config.num_checkpoint_slots == cap.num_pages
    fixed = cfg(**{"scheduler.max_num_seqs": 4, "cache.checkpoint_fraction": 0.2})
    cm = build_cache_manager(fixed, plan_capacity(fixed, QWEN35_08B))
    assert cm.config.shared_pages == cm.config.page_blocks == 0


# ---------------------------------------------------------------------- the runner's arena
NUM_LIVE, NUM_PAGES, BS = 2, 5, 16


def arena_runner(loaded: LoadedModel, host_blocks: int = 0) -> ModelRunner:
    sizes = RunnerSizes(0, BS, NUM_LIVE, NUM_PAGES, num_host_kv_blocks=host_blocks, num_pages=NUM_PAGES)
    return ModelRunner(loaded, REFERENCE_OPS, sizes, torch.device("cpu"))


def test_the_runner_allocates_one_arena(tiny_loaded: LoadedModel) -> None:
    runner = arena_runner(tiny_loaded)
    spec, caches = runner.spec, runner.caches
    lay = spec.page_layout(BS)
    assert caches.arena is not None and caches.layout == lay
    assert caches.nbytes == caches.arena.numel() == (NUM_LIVE + NUM_PAGES) * lay.page_bytes
    assert model_shape(tiny_loaded, spec).padded_state_bytes == lay.state_bytes
    base = caches.arena.data_ptr()
    for t in caches.k_cache + caches.v_cache:
        assert t.shape[0] == (NUM_LIVE + NUM_PAGES) * lay.page_blocks
        assert base <= t.data_ptr() < base + lay.block_bytes
    for t in caches.state_tensors():
        assert t.shape[0] == NUM_LIVE + NUM_PAGES
        assert base <= t.data_ptr() < base + lay.state_bytes


def test_moves_copy_whole_block_rows(tiny_loaded: LoadedModel) -> None:
    runner = arena_runner(tiny_loaded)
    caches, lay = runner.caches, runner.caches.layout
    assert caches.arena is not None and lay is not None
    first = NUM_LIVE * lay.page_blocks  # blocks of the pool's pages
    gen = torch.Generator().manual_seed(0)
    for t in caches.k_cache + caches.v_cache:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    before = [t.clone() for t in caches.k_cache + caches.v_cache]
    moves = [(first, first + 1), (first + 1, first + 2), (first + 7, first + 3)]  # a chain: simultaneous
    runner.transfer(_plan_out(moves))
    for t, b in zip(caches.k_cache + caches.v_cache, before):
        want = b.clone()
        want[[first + 1, first + 2, first + 3]] = b[[first, first + 1, first + 7]]
        assert torch.equal(t, want)
    with pytest.raises(ValueError, match="duplicate destination"):
        runner.move_blocks([(first, first + 4), (first + 1, first + 4)])


def test_moves_run_after_the_saves_and_before_the_loads(tiny_loaded: LoadedModel) -> None:
    """A save reads a block before a move overwrites it; a load lands after the move that
    vacated its block."""
    runner = arena_runner(tiny_loaded, host_blocks=4)
    assert runner.host is not None
    caches, host = runner.caches, runner.host.caches
    lay = caches.layout
    assert lay is not None
    a, b = NUM_LIVE * lay.page_blocks, NUM_LIVE * lay.page_blocks + 1
    for i, t in enumerate(caches.k_cache):
        t[a], t[b] = 1.0 + i, 2.0 + i
    for i, t in enumerate(host.k_cache):
        t[3] = 9.0 + i
    out = _plan_out(
        [(a, b)],
        saves=[Transfer(TransferKind.KV_SAVE, None, b, 0)],  # type: ignore[arg-type]
        loads=[Transfer(TransferKind.KV_LOAD, None, 3, a, seq=object())],  # type: ignore[arg-type]
    )
    assert runner.transfer(out) == []
    for i, (dev, hst) in enumerate(zip(caches.k_cache, host.k_cache)):
        assert bool((hst[0] == 2.0 + i).all())  # saved before the move overwrote b
        assert bool((dev[b] == 1.0 + i).all())  # moved a -> b
        assert bool((dev[a] == 9.0 + i).all())  # loaded into a after the move read it


class _Out:
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _plan_out(moves: list[tuple[int, int]], **lists: Any) -> Any:
    return _Out(StepPlan(items=[], moves=moves, **lists))


def test_a_forward_on_the_arena_equals_one_on_separate_tensors(tiny_loaded: LoadedModel) -> None:
    """The tiny hybrid model, a prefill with a capture then a decode, on arena views (blocks in
    pool pages, state in a live page, capture into a checkpoint page) and on plain tensors with
    the same ids: identical logits and identical cache contents."""
    spec = tiny_loaded.model.cache_spec()
    arena = spec.allocate_arena(NUM_LIVE, NUM_PAGES, BS, "cpu")
    lay = arena.layout
    assert lay is not None
    total_rows = (NUM_LIVE + NUM_PAGES) * lay.page_blocks
    plain = spec.allocate(total_rows, BS, NUM_LIVE + NUM_PAGES, "cpu")
    # pages 2 and 4 hold blocks, page 3 a checkpoint; state slot 1 is live
    assert lay.page_blocks >= 3
    blocks = [4 * lay.page_blocks + 1, 2 * lay.page_blocks, 4 * lay.page_blocks, 2 * lay.page_blocks + 2]
    blocks.append(2 * lay.page_blocks + 1)  # 71 tokens: 5 blocks of 16
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, int(tiny_loaded.hf_config.vocab_size), (70,), generator=gen).tolist()
    logits = []
    for caches in (arena, plain):
        pre = _batch(prompt, 0, blocks, slot=1, capture=(64, 3))
        out1 = tiny_loaded.model.forward(pre, caches)
        dec = _batch([prompt[-1]], len(prompt), blocks, slot=1, decode=True)
        out2 = tiny_loaded.model.forward(dec, caches)
        logits.append((out1, out2))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])
    idx = torch.tensor(blocks[:5])
    for x, y in zip(arena.k_cache + arena.v_cache, plain.k_cache + plain.v_cache):
        assert torch.equal(x[idx], y[idx])
    for x, y in zip(arena.state_tensors(), plain.state_tensors()):
        assert torch.equal(x[[1, 3]], y[[1, 3]])
        assert bool(x[3].abs().sum() > 0)  # the capture landed


def _batch(
    tokens: list[int],
    start: int,
    blocks: list[int],
    *,
    slot: int,
    capture: tuple[int, int] | None = None,
    decode: bool = False,
) -> BatchMetadata:
    def t(data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype)

    n = len(tokens)
    positions = torch.arange(start, start + n)
    table = t(blocks)
    return BatchMetadata(
        input_ids=t(tokens),
        positions=positions,
        cu_seqlens=t([0, n]),
        seq_lens=t([start + n]),
        block_tables=table.view(1, -1),
        slot_mapping=table[positions // BS] * BS + positions % BS,
        num_decodes=1 if decode else 0,
        state_slots=t([slot]),
        has_initial_state=t([start > 0], torch.bool),
        capture_seq=t([0] if capture else []),
        capture_pos=t([capture[0]] if capture else []),
        capture_slots=t([capture[1]] if capture else []),
        logits_indices=t([n - 1]),
    )
