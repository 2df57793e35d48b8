"""Capacity planning and the torch-free construction of ``Scheduler`` + ``CacheManager``.

One memory budget covers the three pools a hybrid model needs:

* **live state slots** — one GDN state (conv + recurrent, every GDN layer) per running
  request, up to ``scheduler.max_num_seqs``;
* **checkpoint slots** — GDN states published in the prefix index;
* **KV blocks** — ``block_size`` tokens of K and V for every full-attention layer.

Split rule (documented in ``CacheConfig`` and docs/config.md): live slots first, at most
half the budget (beyond that fewer live slots are made and ``warnings`` says so); of the
rest ``checkpoint_fraction`` goes to checkpoints and what remains to KV. An explicit pool
size (``num_kv_blocks`` / ``kv_cache_bytes``, ``checkpoint_pool_bytes``) replaces that
pool's share (explicit sizes beyond the budget are used as given, with a warning).

``max_model_len`` defaults to min(model maximum, tokens the KV pool holds); an explicit
value the pool cannot hold is a ``ConfigError`` naming both numbers.

Both ``EngineCore`` and ``tools/simulate_cache.py`` build their scheduler with
``build_scheduler`` from a ``Capacity``, so the simulator replays exactly the engine's
configuration. Torch-free by design: ``ModelShape`` is plain numbers (the engine derives
it from the loaded model's ``CacheSpec``; the simulator from flags or a config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.cache.manager import GDN_CHUNK_SIZE, CacheManager, CacheManagerConfig
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.scheduler.policy import make_policy
from deltaserve.scheduler.scheduler import Scheduler

MiB = 1024**2
DEFAULT_CPU_MEMORY_BYTES = 1024**3
#: live slots may take at most this share of the budget
LIVE_SLOT_SHARE = 0.5
#: pure-GDN models keep KV blocks as bookkeeping only: this many (no memory behind them)
BOOKKEEPING_BLOCKS = 1 << 20


@dataclass(frozen=True)
class ModelShape:
    """What capacity planning needs to know about a model, as plain numbers."""

    kv_bytes_per_token: int  # K + V of one token across all full-attention layers (0: none)
    state_bytes: int  # one GDN state (live slot or checkpoint) across all GDN layers (0: none)
    max_position_embeddings: int
    gdn_chunk_size: int = GDN_CHUNK_SIZE
    # prefill cost of d tokens = a*d + b*d^2/2 (the cache's value model; any unit, FLOPs here)
    prefill_flops_per_token: float = 1.0
    prefill_flops_per_token_pair: float = 1.0 / 65536

    @property
    def has_gdn(self) -> bool:
        return self.state_bytes > 0

    @property
    def has_attention(self) -> bool:
        return self.kv_bytes_per_token > 0


@dataclass(frozen=True)
class Capacity:
    """The sizes the engine runs with, and how they were reached."""

    budget_bytes: int
    block_size: int
    num_kv_blocks: int
    kv_block_bytes: int
    num_live_slots: int
    num_checkpoint_slots: int
    state_bytes: int
    max_model_len: int
    model_max_len: int
    max_num_seqs: int
    gdn_chunk_size: int = GDN_CHUNK_SIZE
    prefill_flops_per_token: float = 1.0
    prefill_flops_per_token_pair: float = 1.0 / 65536
    num_host_kv_blocks: int = 0  # host tier (cache.host_kv_cache_bytes)
    num_host_checkpoint_slots: int = 0  # host tier (cache.host_checkpoint_pool_bytes)
    num_host_pages: int = 0  # host tier, one budget: pages of one checkpoint's size (0: the pair above)
    warnings: tuple[str, ...] = field(default=())

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes

    @property
    def live_bytes(self) -> int:
        return self.num_live_slots * self.state_bytes

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoint_slots * self.state_bytes

    @property
    def max_concurrent_at_max_len(self) -> int:
        """Requests of ``max_model_len`` tokens that fit at once (KV and live slots)."""
        by_kv = self.num_kv_blocks // -(-self.max_model_len // self.block_size)
        return min(by_kv, self.num_live_slots) if self.num_live_slots else by_kv

    def describe(self) -> dict[str, Any]:
        """The capacity line of ``engine.ready`` (and the CLI's start-up message)."""
        return {
            "budget_mib": round(self.budget_bytes / MiB, 1),
            "kv_tokens": self.kv_tokens,
            "kv_blocks": self.num_kv_blocks,
            "kv_mib": round(self.kv_bytes / MiB, 1),
            "live_slots": self.num_live_slots,
            "live_mib": round(self.live_bytes / MiB, 1),
            "checkpoint_slots": self.num_checkpoint_slots,
            "checkpoint_mib_each": round(self.state_bytes / MiB, 3),
            "checkpoint_mib": round(self.checkpoint_bytes / MiB, 1),
            "max_model_len": self.max_model_len,
            "max_concurrent_at_max_len": self.max_concurrent_at_max_len,
            **(
                {
                    "host_kv_blocks": self.num_host_kv_blocks,
                    "host_kv_mib": round(self.num_host_kv_blocks * self.kv_block_bytes / MiB, 1),
                    "host_checkpoint_slots": self.num_host_checkpoint_slots,
                    "host_checkpoint_mib": round(self.num_host_checkpoint_slots * self.state_bytes / MiB, 1),
                }
                if self.num_host_kv_blocks or self.num_host_checkpoint_slots
                else {}
            ),
        }


def plan_capacity(config: EngineConfig, shape: ModelShape, *, budget_bytes: int | None = None) -> Capacity:
    """Split the cache memory budget into live slots, checkpoint slots and KV blocks.

    ``budget_bytes`` is what the caller measured (CUDA: utilisation x device memory minus
    weights and activations); None means ``cache.memory_bytes`` (CPU, default 1 GiB).
    """
    cc, sc = config.cache, config.scheduler
    budget = budget_bytes if budget_bytes is not None else (cc.memory_bytes or DEFAULT_CPU_MEMORY_BYTES)
    warnings: list[str] = []
    bs = cc.block_size
    kv_block_bytes = shape.kv_bytes_per_token * bs
    # 1. live slots first; 2. checkpoints and KV share the rest
    num_live = _live_slots(sc.max_num_seqs, shape, budget, warnings)
    rest = max(budget - num_live * shape.state_bytes, 0)
    num_ckpt = _checkpoint_slots(config, shape, rest)
    num_blocks = _kv_blocks(config, shape, budget, rest, num_live, num_ckpt)
    used = num_live * shape.state_bytes + num_ckpt * shape.state_bytes
    used += num_blocks * kv_block_bytes if shape.has_attention else 0
    if used > budget * 1.001:
        warnings.append(
            f"explicit pool sizes take {used / MiB:.0f} MiB, more than the cache budget of {budget / MiB:.0f} MiB"
        )
    # 3. max_model_len: what the model allows and one request can hold
    max_len = _max_model_len(config, shape, num_blocks, warnings)
    # 4. the host tier: its own budgets (host memory), off by default
    caching = cc.enable_prefix_caching
    num_host_kv = cc.host_kv_cache_bytes // kv_block_bytes if shape.has_attention and caching else 0
    num_host_ckpt = cc.host_checkpoint_pool_bytes // shape.state_bytes if shape.has_gdn and caching else 0
    return Capacity(
        num_host_kv_blocks=num_host_kv,
        num_host_checkpoint_slots=num_host_ckpt,
        budget_bytes=budget,
        block_size=bs,
        num_kv_blocks=num_blocks,
        kv_block_bytes=kv_block_bytes,
        num_live_slots=num_live,
        num_checkpoint_slots=num_ckpt,
        state_bytes=shape.state_bytes,
        max_model_len=max_len,
        model_max_len=shape.max_position_embeddings,
        max_num_seqs=min(sc.max_num_seqs, num_live) if shape.has_gdn else sc.max_num_seqs,
        gdn_chunk_size=shape.gdn_chunk_size,
        prefill_flops_per_token=shape.prefill_flops_per_token,
        prefill_flops_per_token_pair=shape.prefill_flops_per_token_pair,
        warnings=tuple(warnings),
    )


def _live_slots(max_num_seqs: int, shape: ModelShape, budget: int, warnings: list[str]) -> int:
    """One live slot per running request, at most ``LIVE_SLOT_SHARE`` of the budget."""
    if not shape.has_gdn:
        return 0
    cap = int(budget * LIVE_SLOT_SHARE) // shape.state_bytes
    if max_num_seqs <= cap:
        return max_num_seqs
    num_live = max(cap, 1)
    warnings.append(
        f"scheduler.max_num_seqs = {max_num_seqs} live GDN states of "
        f"{shape.state_bytes / MiB:.1f} MiB would take more than half the cache budget "
        f"({budget / MiB:.0f} MiB): at most {num_live} requests run at once; raise the budget "
        f"or lower max_num_seqs"
    )
    return num_live


def _checkpoint_slots(config: EngineConfig, shape: ModelShape, rest: int) -> int:
    """Checkpoint slots: the explicit pool, or ``checkpoint_fraction`` of what the live slots left."""
    cc = config.cache
    if not (shape.has_gdn and cc.enable_prefix_caching):
        return 0
    if cc.checkpoint_pool_bytes is not None:
        return cc.checkpoint_pool_bytes // shape.state_bytes
    return int(rest * cc.checkpoint_fraction) // shape.state_bytes


def _kv_blocks(
    config: EngineConfig, shape: ModelShape, budget: int, rest: int, num_live: int, num_ckpt: int
) -> int:
    """KV blocks: explicit (``num_kv_blocks`` or ``kv_cache_bytes``), or what the checkpoints left.
    A model without attention keeps bookkeeping blocks with no memory behind them."""
    cc = config.cache
    if not shape.has_attention:
        return cc.num_kv_blocks or BOOKKEEPING_BLOCKS
    if cc.num_kv_blocks:
        return cc.num_kv_blocks
    kv_block_bytes = shape.kv_bytes_per_token * cc.block_size
    kv_bytes = cc.kv_cache_bytes if cc.kv_cache_bytes is not None else rest - num_ckpt * shape.state_bytes
    num_blocks = kv_bytes // kv_block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"cache budget {budget / MiB:.1f} MiB leaves no room for a KV block of {kv_block_bytes} bytes "
            f"after {num_live} live slots and {num_ckpt} checkpoint slots of {shape.state_bytes} bytes"
        )
    return num_blocks


def _max_model_len(config: EngineConfig, shape: ModelShape, num_blocks: int, warnings: list[str]) -> int:
    """The explicit ``model.max_model_len`` (refused if the KV pool cannot hold it), else the
    smaller of the model's maximum and the pool's tokens."""
    bs = config.cache.block_size
    model_max = shape.max_position_embeddings
    pool_tokens = num_blocks * bs if shape.has_attention else model_max
    explicit = config.model.max_model_len
    if explicit is not None:
        if explicit > pool_tokens:
            raise ConfigError(
                f"model.max_model_len = {explicit}: the KV pool holds only {pool_tokens} tokens "
                f"({num_blocks} blocks of {bs}); lower max_model_len or raise the cache budget"
            )
        return explicit
    max_len = min(model_max, pool_tokens)
    if max_len < model_max:
        warnings.append(
            f"max_model_len = {max_len}: the model allows {model_max} tokens but the KV pool holds "
            f"{pool_tokens}; raise the cache budget for longer requests"
        )
    return max_len


def build_cache_manager(
    config: EngineConfig, capacity: Capacity, *, checkpoint_policy: str | None = None
) -> CacheManager:
    """The engine's cache manager for ``capacity`` (``checkpoint_policy`` overrides the config's)."""
    cc = config.cache
    return CacheManager(
        CacheManagerConfig(
            block_size=cc.block_size,
            num_kv_blocks=capacity.num_kv_blocks,
            num_live_slots=capacity.num_live_slots,
            num_checkpoint_slots=capacity.num_checkpoint_slots,
            checkpoint_bytes=capacity.state_bytes,
            staging_bytes=cc.checkpoint_staging_bytes,
            has_gdn=capacity.state_bytes > 0,
            checkpoint_interval=cc.checkpoint_interval,
            checkpoint_policy=checkpoint_policy or cc.checkpoint_policy,
            enable_prefix_caching=cc.enable_prefix_caching,
            gdn_chunk_size=capacity.gdn_chunk_size,
            prefill_cost_per_token=capacity.prefill_flops_per_token,
            prefill_cost_per_token_pair=capacity.prefill_flops_per_token_pair,
            num_host_kv_blocks=capacity.num_host_kv_blocks,
            num_host_checkpoint_slots=capacity.num_host_checkpoint_slots,
            num_host_pages=capacity.num_host_pages,
            kv_block_bytes=capacity.kv_block_bytes,
            host_load_bytes_per_step=cc.host_load_bytes_per_step,
        )
    )


def build_scheduler(
    config: EngineConfig, capacity: Capacity, *, checkpoint_policy: str | None = None
) -> Scheduler:
    """Scheduler + CacheManager exactly as the engine runs them, from config and capacity."""
    cache = build_cache_manager(config, capacity, checkpoint_policy=checkpoint_policy)
    sc = config.scheduler
    if sc.max_num_batched_tokens < cache.unit:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens = {sc.max_num_batched_tokens}: must be >= the checkpoint "
            f"unit lcm(cache.block_size, {capacity.gdn_chunk_size}) = {cache.unit}"
        )
    return Scheduler(
        cache,
        make_policy(sc.policy, sc.policy_options),
        max_num_seqs=capacity.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_partial_prefills=sc.max_num_partial_prefills,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
    )
