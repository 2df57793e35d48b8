"""Capacity planning and the torch-free construction of ``Scheduler`` + ``CacheManager``.

One memory budget covers the three pools a hybrid model needs:

* **live state slots** — one GDN state (conv + recurrent, every GDN layer) per running
  request, up to ``scheduler.max_num_seqs``;
* **checkpoint slots** — GDN states published in the prefix index;
* **KV blocks** — ``block_size`` tokens of K and V for every full-attention layer.

Split rule (documented in ``CacheConfig`` and docs/config.md): live slots first, at most
half the budget (beyond that fewer live slots are made and ``warnings`` says so). Then:

* **shared** (the default for a model with both GDN and full-attention layers and prefix
  caching on): the rest is ``num_pages`` pages of ``page_blocks`` KV blocks each, where
  ``page_blocks = max(1, ceil(state / KV block))`` (the state padded as the device arena lays
  it out), so a page holds one checkpoint or ``page_blocks`` KV blocks and the cache manager
  trades them. Live slots are pages too. ``num_kv_blocks`` / ``num_checkpoint_slots`` are
  then the maxima (every page as KV / as a checkpoint), not a split.
* **fixed** (``checkpoint_fraction`` set, an explicit pool size, or a model or config the
  shared pool does not apply to): ``checkpoint_fraction`` of the rest (0.2 when only a KV
  size is given) goes to checkpoints and what remains to KV. An explicit pool size
  (``num_kv_blocks`` / ``kv_cache_bytes``, ``checkpoint_pool_bytes``) replaces that pool's
  share (explicit sizes beyond the budget are used as given, with a warning).

``max_model_len`` defaults to min(model maximum, tokens the KV pool holds); an explicit
value the pool cannot hold is a ``ConfigError`` naming both numbers.

Host memory (a CPU engine, ``ModelShape.weight_bytes`` > 0): the capacity line states the
resident memory the engine plans for, ``expected_rss_mib`` = weights + the pools (device and
host tier) + the activation workspace of one step (``max_num_batched_tokens`` tokens through
the widest projection, and the logits of ``max_num_seqs`` rows) + ``FIXED_OVERHEAD_BYTES``
(interpreter, torch, tokenizer). ``engine.release_memory`` keeps the process there across runs.

Both ``EngineCore`` and ``tools/simulate_cache.py`` build their scheduler with
``build_scheduler`` from a ``Capacity``, so the simulator replays exactly the engine's
configuration. Torch-free by design: ``ModelShape`` is plain numbers (the engine derives
it from the loaded model's ``CacheSpec``; the simulator from flags or a config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.cache.arena import blocks_per_page
from deltaserve.cache.manager import GDN_CHUNK_SIZE, CacheManager, CacheManagerConfig
from deltaserve.engine.byte_size import format_bytes
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.scheduler.policy import make_policy
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.step_budget import StepBudget

MiB = 1024**2
DEFAULT_CPU_MEMORY_BYTES = 1024**3
#: live slots may take at most this share of the budget
LIVE_SLOT_SHARE = 0.5
#: pure-GDN models keep KV blocks as bookkeeping only: this many (no memory behind them)
BOOKKEEPING_BLOCKS = 1 << 20
#: fixed split: the checkpoints' share when only the KV pool's size is explicit
DEFAULT_CHECKPOINT_FRACTION = 0.2
#: resident memory besides weights, pools and activations: Python, torch, transformers, the
#: tokenizer (twice: the step thread detokenizes with its own copy), the server. Measured
#: 0.43 GiB for the engine and for ``deltaserve serve`` on the built-in model; the rest is
#: headroom for a full-size tokenizer.
FIXED_OVERHEAD_BYTES = 768 * MiB
#: live float32 values per token, in units of the widest projection's output, at the peak of a
#: prefill step: the projection output, its activation, the residual stream and the GDN/attention
#: temporaries. Measured 4.8 on the Qwen3.5-0.8B shape (315 MiB for 2,048 tokens); 6 is the bound.
ACTIVATION_WIDTHS = 6
#: the logits of a sampled row and the sampler's temporaries (probabilities, sorted copy)
LOGITS_COPIES = 3


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
    # one state as a shared-arena page lays it out (per-layer ranges aligned); 0: state_bytes
    padded_state_bytes: int = 0
    # host memory planning (a CPU engine; 0: not stated): the weights as loaded, the widest
    # projection's output features and the vocabulary (activation workspace, ``workspace_bytes``)
    weight_bytes: int = 0
    widest_features: int = 0
    vocab_size: int = 0

    @property
    def has_gdn(self) -> bool:
        return self.state_bytes > 0

    @property
    def page_state_bytes(self) -> int:
        return self.padded_state_bytes or self.state_bytes

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
    # one device budget (cache/arena.py): pages of ``page_blocks`` KV blocks or one checkpoint
    # each; 0 = the fixed pools (then ``num_kv_blocks`` / ``num_checkpoint_slots`` are their sizes,
    # else the most each kind can take)
    num_pages: int = 0
    page_blocks: int = 0
    # the host tier as one budget: pages of ``host_page_blocks`` host blocks or one checkpoint
    num_host_pages: int = 0
    host_page_blocks: int = 0
    # host memory (a CPU engine; 0 = not stated): weights, one step's activations, the rest
    weight_bytes: int = 0
    workspace_bytes: int = 0
    overhead_bytes: int = 0
    warnings: tuple[str, ...] = field(default=())

    @property
    def shared(self) -> bool:
        return self.num_pages > 0

    @property
    def pool_bytes(self) -> int:
        """The device cache tensors: the shared arena, or the fixed pools."""
        if self.shared:
            return self.arena_bytes
        return self.kv_bytes + self.live_bytes + self.checkpoint_bytes

    @property
    def host_tier_bytes(self) -> int:
        """The host tier's tensors (``cache.host_*``)."""
        pages = self.num_host_pages * self.host_page_blocks * self.kv_block_bytes
        return (
            pages
            + self.num_host_kv_blocks * self.kv_block_bytes
            + self.num_host_checkpoint_slots * self.state_bytes
        )

    @property
    def expected_resident_bytes(self) -> int:
        """What the process should hold resident (a CPU engine): weights + pools + host tier +
        one step's activations + the fixed overhead; 0 when the weights are not known."""
        if not self.weight_bytes:
            return 0
        return (
            self.weight_bytes
            + self.pool_bytes
            + self.host_tier_bytes
            + self.workspace_bytes
            + self.overhead_bytes
        )

    @property
    def page_bytes(self) -> int:
        return self.page_blocks * self.kv_block_bytes

    @property
    def arena_bytes(self) -> int:
        """Shared mode: the one device buffer (live pages + pool pages)."""
        return (self.num_live_slots + self.num_pages) * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes

    @property
    def live_bytes(self) -> int:
        return self.num_live_slots * (self.page_bytes if self.shared else self.state_bytes)

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoint_slots * self.state_bytes

    @property
    def max_concurrent_at_max_len(self) -> int:
        """Requests of ``max_model_len`` tokens that fit at once (KV and live slots)."""
        by_kv = self.num_kv_blocks // -(-self.max_model_len // self.block_size)
        return min(by_kv, self.num_live_slots) if self.num_live_slots else by_kv

    def describe(self) -> dict[str, Any]:
        """The capacity line of ``engine.ready`` (and the CLI's start-up message). In shared mode
        ``kv_blocks`` / ``kv_tokens`` / ``checkpoint_slots`` are maxima over one pool of pages."""
        if self.shared:
            pools: dict[str, Any] = {
                "mode": "shared",
                "arena_mib": round(self.arena_bytes / MiB, 1),
                "pages": self.num_pages,
                "page_blocks": self.page_blocks,
                "page_mib": round(self.page_bytes / MiB, 3),
                "kv_tokens": self.kv_tokens,
                "kv_blocks": self.num_kv_blocks,
                "live_slots": self.num_live_slots,
                "live_mib": round(self.live_bytes / MiB, 1),
                "checkpoint_slots": self.num_checkpoint_slots,
                "checkpoint_mib_each": round(self.state_bytes / MiB, 3),
            }
        else:
            pools = {
                "mode": "fixed",
                "kv_tokens": self.kv_tokens,
                "kv_blocks": self.num_kv_blocks,
                "kv_mib": round(self.kv_bytes / MiB, 1),
                "live_slots": self.num_live_slots,
                "live_mib": round(self.live_bytes / MiB, 1),
                "checkpoint_slots": self.num_checkpoint_slots,
                "checkpoint_mib_each": round(self.state_bytes / MiB, 3),
                "checkpoint_mib": round(self.checkpoint_bytes / MiB, 1),
            }
        return {
            "budget_mib": round(self.budget_bytes / MiB, 1),
            **pools,
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
            **self._resident(),
            **(
                {
                    "host_pages": self.num_host_pages,
                    "host_mib": round(
                        self.num_host_pages * self.host_page_blocks * self.kv_block_bytes / MiB, 1
                    ),
                }
                if self.num_host_pages
                else {}
            ),
        }

    def _resident(self) -> dict[str, Any]:
        """The host-memory part of the capacity line (empty when the weights are not known)."""
        if not self.weight_bytes:
            return {}
        return {
            "expected_rss_mib": round(self.expected_resident_bytes / MiB, 1),
            "weights_mib": round(self.weight_bytes / MiB, 1),
            "workspace_mib": round(self.workspace_bytes / MiB, 1),
            "overhead_mib": round(self.overhead_bytes / MiB, 1),
        }


def workspace_bytes(config: EngineConfig, shape: ModelShape) -> int:
    """One step's activation temporaries, bounded: ``max_num_batched_tokens`` tokens of
    ``ACTIVATION_WIDTHS`` x the widest projection, and the logits of ``max_num_seqs`` rows, in
    float32 (0 when the model's widths are not known)."""
    sc = config.scheduler
    prefill = sc.max_num_batched_tokens * ACTIVATION_WIDTHS * shape.widest_features * 4
    logits = sc.max_num_seqs * LOGITS_COPIES * shape.vocab_size * 4
    return prefill + logits


def shared_mode(config: EngineConfig, shape: ModelShape) -> bool:
    """KV blocks and checkpoints share one pool of pages: a hybrid model, prefix caching on, and
    no fixed split asked for (``cache.checkpoint_fraction`` or an explicit pool size)."""
    cc = config.cache
    return shape.has_gdn and shape.has_attention and cc.enable_prefix_caching and not cc.fixed_split


def page_blocks(shape: ModelShape, block_size: int) -> int:
    """KV blocks per shared page: enough bytes for one (padded) state."""
    return blocks_per_page(shape.page_state_bytes, shape.kv_bytes_per_token * block_size)


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
    num_pages = per_page = 0
    if shared_mode(config, shape):
        # 1. live slots first (pages of the arena); 2. the rest is pages, KV or checkpoint each
        per_page = page_blocks(shape, bs)
        page_bytes = per_page * kv_block_bytes
        num_live = _live_slots(sc.max_num_seqs, shape, budget, warnings, slot_bytes=page_bytes)
        num_pages = max(budget - num_live * page_bytes, 0) // page_bytes
        if num_pages < 1:  # one live slot and one page is the least that runs
            raise _budget_too_small(
                config,
                budget_bytes,
                budget,
                2 * page_bytes,
                f"one live GDN state and one cache page of {format_bytes(page_bytes)} "
                f"(a page holds one checkpoint or {per_page} KV blocks of {bs} tokens)",
            )
        num_ckpt, num_blocks = num_pages, num_pages * per_page
        used = (num_live + num_pages) * page_bytes
    else:
        # 1. live slots first; 2. checkpoints and KV split the rest
        num_live = _live_slots(sc.max_num_seqs, shape, budget, warnings)
        rest = max(budget - num_live * shape.state_bytes, 0)
        num_ckpt = _checkpoint_slots(config, shape, rest)
        num_blocks = _kv_blocks(config, shape, budget, rest, num_live, num_ckpt, budget_bytes)
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
    host_kv, host_ckpt = cc.host_kv_cache_bytes, cc.host_checkpoint_pool_bytes
    num_host_pages = host_page_blocks = 0
    if cc.host_memory_bytes and caching:
        if shape.has_attention and shape.has_gdn:  # one host budget of pages
            host_page_blocks = page_blocks(shape, bs)
            num_host_pages = cc.host_memory_bytes // (host_page_blocks * kv_block_bytes)
        elif shape.has_attention:  # one kind only: the budget is that kind's
            host_kv = cc.host_memory_bytes
        else:
            host_ckpt = cc.host_memory_bytes
    num_host_kv = host_kv // kv_block_bytes if shape.has_attention and caching else 0
    num_host_ckpt = host_ckpt // shape.state_bytes if shape.has_gdn and caching else 0
    return Capacity(
        num_host_pages=num_host_pages,
        host_page_blocks=host_page_blocks,
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
        num_pages=num_pages,
        page_blocks=per_page,
        weight_bytes=shape.weight_bytes,
        workspace_bytes=workspace_bytes(config, shape) if shape.weight_bytes else 0,
        overhead_bytes=FIXED_OVERHEAD_BYTES if shape.weight_bytes else 0,
        warnings=tuple(warnings),
    )


def _live_slots(
    max_num_seqs: int, shape: ModelShape, budget: int, warnings: list[str], *, slot_bytes: int = 0
) -> int:
    """One live slot per running request, at most ``LIVE_SLOT_SHARE`` of the budget; a slot
    costs ``slot_bytes`` (a shared page) or one state."""
    if not shape.has_gdn:
        return 0
    cap = int(budget * LIVE_SLOT_SHARE) // (slot_bytes or shape.state_bytes)
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
    fraction = DEFAULT_CHECKPOINT_FRACTION if cc.checkpoint_fraction is None else cc.checkpoint_fraction
    return int(rest * fraction) // shape.state_bytes


def _kv_blocks(
    config: EngineConfig,
    shape: ModelShape,
    budget: int,
    rest: int,
    num_live: int,
    num_ckpt: int,
    budget_bytes_given: int | None = None,
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
    if num_blocks < 1 and cc.kv_cache_bytes is not None:
        raise ConfigError(
            f"cache.kv_cache_bytes = {cc.kv_cache_bytes} is below the minimum {format_bytes(kv_block_bytes)} "
            f"({kv_block_bytes} bytes: one KV block of {cc.block_size} tokens)"
        )
    if num_blocks < 1:
        raise _budget_too_small(
            config,
            budget_bytes_given,
            budget,
            _least_budget(config, shape, budget),
            f"one KV block of {format_bytes(kv_block_bytes)} beside {num_live} live GDN states and "
            f"{num_ckpt} checkpoints of {format_bytes(shape.state_bytes)}",
        )
    return num_blocks


def _budget_too_small(
    config: EngineConfig, budget_bytes: int | None, budget: int, minimum: int, need: str
) -> ConfigError:
    """The one-line error for a cache budget below ``minimum``: it names the key that set the
    budget (``cache.memory_bytes`` on the CPU, ``cache.gpu_memory_utilization`` on CUDA)."""
    if budget_bytes is None:
        value = config.cache.memory_bytes
        shown = str(value) if value is not None else f"{format_bytes(DEFAULT_CPU_MEMORY_BYTES)} (the default)"
        return ConfigError(
            f"cache.memory_bytes = {shown} is below the minimum {format_bytes(minimum)} ({minimum} bytes) "
            f"needed for {need}"
        )
    return ConfigError(
        f"cache.gpu_memory_utilization = {config.cache.gpu_memory_utilization}: the cache budget it leaves "
        f"after the weights and activations, {format_bytes(budget)}, is below the minimum "
        f"{format_bytes(minimum)} needed for {need}; raise gpu_memory_utilization"
    )


def _fits(config: EngineConfig, shape: ModelShape, budget: int) -> bool:
    """Whether a fixed split of ``budget`` leaves room for one KV block (``_kv_blocks``' test)."""
    cc = config.cache
    num_live = _live_slots(config.scheduler.max_num_seqs, shape, budget, [])
    rest = max(budget - num_live * shape.state_bytes, 0)
    num_ckpt = _checkpoint_slots(config, shape, rest)
    return rest - num_ckpt * shape.state_bytes >= shape.kv_bytes_per_token * cc.block_size


def _least_budget(config: EngineConfig, shape: ModelShape, budget: int) -> int:
    """The smallest budget above ``budget`` whose fixed split fits, by bisection (live and
    checkpoint slots grow with the budget, so the test is only nearly monotone: the answer is a
    budget that fits with one byte less that does not)."""
    lo, hi = budget, max(budget, 1) * 2
    while not _fits(config, shape, hi) and hi < 1 << 50:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(config, shape, mid):
            hi = mid
        else:
            lo = mid
    return hi


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
            # shared mode: the maxima (every page as KV / as a checkpoint); the pages are the budget
            num_kv_blocks=capacity.num_kv_blocks,
            num_live_slots=capacity.num_live_slots,
            num_checkpoint_slots=capacity.num_checkpoint_slots,
            shared_pages=capacity.num_pages,
            page_blocks=capacity.page_blocks,
            checkpoint_bytes=capacity.state_bytes,
            staging_bytes=cc.checkpoint_staging_bytes,
            has_gdn=capacity.state_bytes > 0,
            checkpoint_interval=cc.checkpoint_interval,
            checkpoint_policy=checkpoint_policy or cc.checkpoint_policy,
            enable_prefix_caching=cc.enable_prefix_caching,
            gdn_chunk_size=capacity.gdn_chunk_size,
            checkpoint_granularity=cc.checkpoint_granularity,
            prefill_cost_per_token=capacity.prefill_flops_per_token,
            prefill_cost_per_token_pair=capacity.prefill_flops_per_token_pair,
            num_host_kv_blocks=capacity.num_host_kv_blocks,
            num_host_checkpoint_slots=capacity.num_host_checkpoint_slots,
            num_host_pages=capacity.num_host_pages,
            host_page_blocks=capacity.host_page_blocks,
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
            f"unit ({cache.unit} tokens: cache.block_size, or lcm(cache.block_size, "
            f"{capacity.gdn_chunk_size}) with cache.checkpoint_granularity = chunk)"
        )
    return Scheduler(
        cache,
        make_policy(sc.policy, sc.policy_options),
        max_num_seqs=capacity.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_partial_prefills=sc.max_num_partial_prefills,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        shared_prefix_wait_tokens=sc.shared_prefix_wait_tokens if config.cache.enable_prefix_caching else 0,
        step_budget=_step_budget(config, cache.unit),
        burst_window_s=sc.burst_window_ms / 1000.0,
        reserve_prompts=sc.reserve_prompt_kv,
    )


def _step_budget(config: EngineConfig, unit: int) -> StepBudget | None:
    """The bound on a decode step's prefill (``scheduler.decode_step_factor`` /
    ``max_decode_step_ms``); None when both are 0 (off)."""
    sc = config.scheduler
    if sc.max_decode_step_ms <= 0 and sc.decode_step_factor <= 0:
        return None
    return StepBudget(min_tokens=unit, factor=sc.decode_step_factor, target_ms=sc.max_decode_step_ms)
