"""The cache manager's configuration and the checkpoint unit (``cache/manager.py``).

``CacheManagerConfig`` is plain numbers (the engine sizes them, ``engine/core/sizing.py``; the
simulator sets them directly). ``checkpoint_unit`` is the grid a hit, a tail, a branch or an
output capture sits on. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaserve.cache.types import CheckpointGranularity

GDN_CHUNK_SIZE = 64


def checkpoint_unit(
    block_size: int,
    has_gdn: bool = True,
    granularity: CheckpointGranularity = CheckpointGranularity.BLOCK,
    chunk_size: int = GDN_CHUNK_SIZE,
) -> int:
    """Tokens between two boundaries a hit (and a tail / branch / output capture) may sit on:
    the block, or lcm(block, GDN chunk) with ``chunk`` granularity on a model with GDN layers."""
    if has_gdn and granularity is CheckpointGranularity.CHUNK:
        return math.lcm(block_size, chunk_size)
    return block_size


@dataclass
class CacheManagerConfig:
    block_size: int
    num_kv_blocks: int
    num_live_slots: int = 0
    num_checkpoint_slots: int = 0
    checkpoint_bytes: int = 0  # size of one checkpoint (all GDN layers)
    staging_bytes: int | None = None  # per-step capture budget; None = unbounded
    has_gdn: bool = True
    checkpoint_interval: int = 0  # tokens; rounded up to lcm(block_size, gdn_chunk_size); 0 = off
    checkpoint_policy: str = "default"
    enable_prefix_caching: bool = True
    gdn_chunk_size: int = GDN_CHUNK_SIZE
    checkpoint_granularity: CheckpointGranularity = CheckpointGranularity.BLOCK
    # value model (cache/value_eviction.py): prefill cost of d tokens = a*d + b*d^2/2, any unit
    prefill_cost_per_token: float = 1.0  # a: GDN, MLP and projections (linear in tokens)
    prefill_cost_per_token_pair: float = 1.0 / 65536  # b: full attention (per token pair)
    # host tier (cache/host_tier.py): 0 = off
    num_host_kv_blocks: int = 0
    num_host_checkpoint_slots: int = 0
    num_host_pages: int = 0  # one host budget (pages of one checkpoint's size); 0: the pair above
    host_page_blocks: int = 0  # host blocks per host page (0: ceil(checkpoint_bytes / kv_block_bytes))
    kv_block_bytes: int = 0  # one KV block over all attention layers (transfer accounting)
    host_load_bytes_per_step: int | None = None  # loads staged per step; None = unbounded
    # one device budget (cache/arena.py): ``shared_pages`` pages of ``page_blocks`` KV blocks
    # or one checkpoint each, after the live slots; 0 = the fixed pools above
    shared_pages: int = 0
    page_blocks: int = 0
    headroom_blocks: int | None = None  # free KV kept when captures take KV pages; None: page_blocks // 2
