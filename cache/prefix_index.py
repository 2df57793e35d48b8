"""The KV prefix side of the cache: block pool + radix index, matching, publishing, pins.

Every KV block id is exactly one of: free (in the pool), held by one tree node, or private
to one active request (the tail of its block table past its pinned path). A request pins
every node of its path; pinned nodes are never evicted. ``check_integrity`` proves this.

Eviction of a leaf's *checkpoint* is the checkpoint store's business: this side only says
which unpinned leaf it would drop (``peek_evictable_leaf``: checkpoint-less first, LRU) and
removes one when told. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from deltaserve.cache.block_pool import BlockPool, PagedBlockPool
from deltaserve.cache.hashing import block_hashes
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import PrefixMatch, SeqCache


class PrefixIndex:
    def __init__(
        self,
        tree: RadixTree,
        host: HostTier,
        block_size: int,
        blocks: BlockPool | PagedBlockPool,
        *,
        has_gdn: bool,
    ) -> None:
        self.block_size = block_size
        self.has_gdn = has_gdn
        self.blocks = blocks
        self.tree = tree
        self.host = host  # a published block that is cached on the host releases its host copy
        # full-block hashes of active requests' prompts -> number of such requests
        self.inflight: dict[int, int] = {}
        # observer of the cache events (``cache/event_collector.py``): a published block's tokens
        self.on_tokens: Callable[[int, Sequence[int]], None] | None = None

    @property
    def version(self) -> int:
        return self.tree.version

    # ------------------------------------------------------------------ hashing / matching
    def extend_hashes(self, token_ids: Sequence[int], salt: bytes, hashes: list[int]) -> list[int]:
        """Extend ``hashes`` (the chained hashes of the leading full blocks) in place."""
        parent = hashes[-1] if hashes else 0
        hashes.extend(block_hashes(token_ids, self.block_size, salt, start_block=len(hashes), parent=parent))
        return hashes

    def match(self, token_ids: Sequence[int], salt: bytes, hashes: list[int]) -> PrefixMatch:
        """The prompt's path in the tree and its joint hit (deepest checkpoint on the path,
        at most ``len(prompt) - 1`` tokens; any depth for a model without GDN layers)."""
        bs = self.block_size
        self.extend_hashes(token_ids, salt, hashes)
        path = self.tree.match(hashes[: len(token_ids) // bs])
        hit = min(len(path), (len(token_ids) - 1) // bs)  # at least one token is computed
        if self.has_gdn:  # a checkpoint in either tier (joint hits may combine tiers)
            while hit > 0 and not path[hit - 1].has_checkpoint:
                hit -= 1
        return PrefixMatch(path, hit, hashes, len(token_ids), self.tree.version, bs)

    def branch_boundary(self, match: PrefixMatch, token_ids: Sequence[int], unit: int) -> int:
        """The divergence boundary when the prompt provably shares more than its joint hit
        covers (0: none) — with the tree, or with a prompt still being computed (admitted,
        not yet published). A path that simply ends (a leaf: the previous turn of this very
        conversation) is extended, not branched: only a path that goes on past the
        divergence, or another request computing the same prefix, proves a shared boundary."""
        path = match.path
        shared = self.inflight_depth(match, token_ids)
        diverges = shared > len(path) or (len(path) > 0 and bool(path[-1].children))
        branch = (shared * self.block_size // unit) * unit
        return branch if diverges and branch > match.hit_tokens else 0

    def inflight_depth(self, match: PrefixMatch, token_ids: Sequence[int]) -> int:
        """Full blocks of the prompt that the tree holds or another admitted request is
        computing (its prompt's blocks not yet published), from the root."""
        shared, hashes = len(match.path), match.hashes
        full = len(token_ids) // self.block_size
        while shared < full and hashes[shared] in self.inflight:
            shared += 1
        return shared

    def hold_inflight(self, seq: SeqCache, num_blocks: int) -> None:
        """Register the request's first ``num_blocks`` prompt blocks as being computed."""
        seq.num_inflight = num_blocks
        for h in seq.hashes[:num_blocks]:
            self.inflight[h] = self.inflight.get(h, 0) + 1

    def release_inflight(self, seq: SeqCache) -> None:
        for h in seq.hashes[: seq.num_inflight]:
            left = self.inflight[h] - 1
            if left:
                self.inflight[h] = left
            else:
                del self.inflight[h]
        seq.num_inflight = 0

    def checkpoint_depth_above(self, seq: SeqCache, boundary: int, skip: Node | None) -> int:
        """Depth of the deepest checkpoint on ``seq``'s path above ``boundary`` (0: none),
        ``skip`` aside."""
        bs, nodes = self.block_size, seq.nodes
        for i in range(min(boundary // bs - 1, len(nodes)) - 1, -1, -1):
            if nodes[i].checkpoint_slot is not None and nodes[i] is not skip:
                return (i + 1) * bs
        return 0

    # ------------------------------------------------------------------ pins
    def pin_path(self, seq: SeqCache, nodes: Iterable[Node]) -> None:
        for node in nodes:
            self.tree.pin(node)
            self.tree.touch(node)
            seq.nodes.append(node)
            seq.block_table.append(node.block_id)

    def release(self, seq: SeqCache) -> None:
        """Unpin the request's path and return its private blocks."""
        for node in seq.nodes:
            self.tree.unpin(node)
        for block_id in seq.block_table[len(seq.nodes) :]:
            self.blocks.free(block_id)
        seq.nodes = []
        seq.block_table = []

    # ------------------------------------------------------------------ blocks
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peek_evictable_leaf(self) -> Node | None:
        return self.tree.peek_evictable_leaf()

    def remove_leaf(self, node: Node) -> None:
        """Drop an unpinned, checkpoint-less leaf and free its block."""
        assert node.checkpoint_slot is None, "a leaf's checkpoint goes first (checkpoint store)"
        self.tree.remove_leaf(node)
        self.blocks.free(node.block_id)

    def grow(self, seq: SeqCache, need: int) -> None:
        """Append ``need`` fresh private blocks (the caller made room)."""
        for _ in range(need):
            seq.block_table.append(self.blocks.allocate())
        self.tree.compact()

    def publish(self, seq: SeqCache, token_ids: Sequence[int], num_computed: int) -> None:
        """Insert the request's newly full, computed blocks into the tree (and pin them).

        Each block is published whole (in the tree, pinned, on ``seq``'s path) or not at all:
        if one raises, the blocks before it stay published and it stays private."""
        if num_computed // self.block_size <= len(seq.nodes):
            return  # no newly full block (most decode steps): nothing to hash or insert yet
        hashes = self.extend_hashes(token_ids, seq.salt, seq.hashes)
        tree = self.tree
        for i in range(len(seq.nodes), num_computed // self.block_size):
            parent = seq.nodes[-1] if seq.nodes else tree.root
            key = hashes[i]
            node = parent.children.get(key)
            if node is not None and node.moving:
                break  # being copied between tiers: keep ours private, publish after it lands
            if node is not None and node.block_id < 0:
                # Cached on the host tier: our computed block brings it back to the device.
                self._publish_promote(node, seq.block_table[i])
            elif node is not None:
                # Same prefix already cached (computed by another request): share it and
                # return our duplicate block.
                self._publish_share(seq, i, node)
            else:
                node = tree.insert(parent, key, seq.block_table[i])
                try:
                    tree.pin(node)
                except BaseException:
                    tree.remove_leaf(node)
                    raise
            seq.nodes.append(node)
            if self.on_tokens is not None:
                self.on_tokens(key, token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _publish_promote(self, node: Node, block_id: int) -> None:
        """Host node ``node`` takes computed block ``block_id`` (the caller's), pinned; its
        host copy goes last, so that until then the promotion can be undone."""
        tree = self.tree
        tree.promote(node, block_id)
        pinned = False
        try:
            tree.touch(node)
            tree.pin(node)
            pinned = True
            self.host.release_block(node)
        except BaseException:  # back to the host copy (the caller keeps its block)
            if pinned:
                tree.unpin(node)
            tree.demote(node, node.host_block)
            tree.set_moving(node, False)
            raise

    def _publish_share(self, seq: SeqCache, i: int, node: Node) -> None:
        """Block ``i`` of ``seq`` is cached already: share ``node``'s, return ours, pinned."""
        own = seq.block_table[i]
        self.blocks.free(own)
        seq.block_table[i] = node.block_id
        try:
            self.tree.touch(node)
            self.tree.pin(node)
        except BaseException:  # keep a private block (any: it holds no cached content)
            seq.block_table[i] = self.blocks.allocate()
            raise

    def node_at(self, seq: SeqCache, boundary: int) -> Node | None:
        depth = boundary // self.block_size
        return seq.nodes[depth - 1] if 0 < depth <= len(seq.nodes) else None

    # ------------------------------------------------------------------ invariants
    def usage(self) -> dict[str, int | float]:
        total, free = self.blocks.num_blocks, self.blocks.num_free
        return {
            "kv.total_blocks": total,
            "kv.free_blocks": free,
            "kv.cached_blocks": self.tree.num_nodes,
            "kv.pinned_blocks": self.tree.num_pinned,
            "kv.usage": (total - free) / total if total else 0.0,
        }

    def check_integrity(self, active: Sequence[SeqCache]) -> list[Node]:
        """Every block free / held by one node / private to one request; pins = ref counts;
        in-flight prompt hashes = the active requests'. Returns the tree's nodes."""
        tree, pool = self.tree, self.blocks
        nodes = list(tree.nodes())
        assert len(nodes) == tree.num_nodes, "node count drift"
        assert tree.num_pinned == sum(1 for n in nodes if n.ref_count > 0), "pinned count drift"
        assert tree.num_checkpoints == sum(1 for n in nodes if n.checkpoint_slot is not None), (
            "ckpt count drift"
        )
        tree.check_deeper(nodes)
        owner: dict[int, str] = {}

        def claim(block_id: int, who: str) -> None:
            assert pool.is_valid(block_id), f"bad block id {block_id} ({who})"
            assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {who}"
            owner[block_id] = who

        for b in pool.free_ids():
            claim(b, "free")
        for node in nodes:
            if node.block_id >= 0:
                claim(node.block_id, "tree")
            parent = node.parent
            assert parent is not None and parent.children.get(node.key) is node, f"{node} detached"
            assert node.depth == parent.depth + 1, f"{node} depth"
        refs: dict[int, int] = {}
        for seq in active:
            assert len(seq.block_table) >= len(seq.nodes)
            prev: Node = tree.root
            for i, node in enumerate(seq.nodes):
                assert node.parent is prev, f"{seq.request_id}: path broken at block {i}"
                assert seq.block_table[i] == node.block_id, f"{seq.request_id}: block table != path"
                refs[id(node)] = refs.get(id(node), 0) + 1
                prev = node
            for b in seq.block_table[len(seq.nodes) :]:
                claim(b, f"request {seq.request_id}")
        inflight: dict[int, int] = {}
        for seq in active:
            for h in seq.hashes[: seq.num_inflight]:
                inflight[h] = inflight.get(h, 0) + 1
        assert inflight == self.inflight, "in-flight prompt hash counts drift"
        assert len(owner) == pool.num_blocks, (
            f"{pool.num_blocks - len(owner)} KV blocks leaked (neither free, cached nor owned)"
        )
        for node in nodes:
            assert node.ref_count == refs.get(id(node), 0), f"{node}: ref_count {node.ref_count} != pins"
        return nodes
