"""The host tier's tensors and the copies between tiers (``cache/host_tier.py`` plans them).

``HostPool`` holds KV blocks and checkpoint slots in host memory, in the same layouts as
the device caches (``CacheSpec.allocate``): pinned on CUDA, plain CPU tensors on the CPU,
where the device pools are CPU tensors too and every copy is a memcpy through the same
code path, so everything is tested without a GPU.

``transfer(plan)`` runs a step's copies before its forward: first the saves (device ->
host: a demoted block's device copy may be reused by this very step; host KV blocks moved
out of a page vacated for a checkpoint go before them, as that checkpoint's save may write
the page), then ``between`` (the runner's device block moves, on the compute stream), then
each request's loads (host -> device block, host checkpoint -> the request's live slot).
A request's loads are one unit: a failure fails only them (and is returned, for the engine to end
that request); a failed batch of saves is returned too (the cache drops those items).

On CUDA the copies run on a separate stream. The step's forward waits for the saves
only: loads write blocks and live slots of requests that do not compute in this step (a
loading request computes once its loads have landed), so they overlap the forward, and
the next step's copies and forward wait for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from deltaserve.cache.types import StepPlan, Transfer, TransferKind
from deltaserve.logs import get_logger
from deltaserve.models import CacheSpec, ModelCaches

log = get_logger("deltaserve.engine")

Failure = tuple[Transfer, BaseException]


class HostPool:
    def __init__(
        self,
        spec: CacheSpec,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device,
        *,
        num_pages: int = 0,
    ) -> None:
        self.device = device
        if num_pages:  # one host budget: an arena of pages laid out as the device's (host block b = row b, slot s = page s)
            caches = spec.allocate_arena(0, num_pages, block_size, "cpu")
            assert caches.arena is not None and caches.layout is not None
            self.caches: ModelCaches = (
                spec.arena_views(caches.arena.pin_memory(), caches.layout)
                if device.type == "cuda"
                else caches
            )
        else:
            self.caches = spec.allocate(num_blocks, block_size, num_slots, "cpu")
            if device.type == "cuda":  # pinned: the copies are true async DMA
                for tensors in (
                    self.caches.k_cache,
                    self.caches.v_cache,
                    self.caches.conv_state,
                    self.caches.ssm_state,
                ):
                    tensors[:] = [t.pin_memory() for t in tensors]
        if device.type == "cuda":
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.stream = None
        self._loads_done: torch.cuda.Event | None = None

    @torch.inference_mode()
    def transfer(
        self, plan: StepPlan, device: ModelCaches, *, between: Callable[[], None] | None = None
    ) -> list[Failure]:
        """Run ``plan``'s saves, then ``between`` (if given; what it raises propagates), then the
        loads; the copies that failed, with their error."""
        failed: list[Failure] = []
        loads = [t for t in plan.loads if not t.kind.from_disk]  # (the runner runs those)
        if not plan.saves and not loads:
            if between is not None:
                between()
            return failed
        current = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if self.stream is not None:
            self.stream.wait_stream(current)  # saves read what earlier steps computed
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if plan.saves:
                try:
                    self._copy(plan.saves, device)
                except Exception as e:
                    log.error("host.save_failed", items=len(plan.saves), error=repr(e))
                    failed += [(t, e) for t in plan.saves]
            if self.stream is not None:
                current.wait_stream(self.stream)  # the forward may reuse what was just saved
        if between is not None:
            between()  # on the compute stream, after the saves have read their blocks
            if self.stream is not None:
                self.stream.wait_stream(current)  # loads land where the moves have vacated
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for group in _by_request(loads):
                try:
                    self._copy(group, device)
                except Exception as e:
                    log.error("host.load_failed", request_id=group[0].seq.request_id, error=repr(e))  # type: ignore[union-attr]
                    failed += [(t, e) for t in group]
            if self.stream is not None:
                self._loads_done = torch.cuda.Event()
                self._loads_done.record(self.stream)
        return failed

    def wait(self) -> None:
        """CUDA: the compute stream waits for the last loads (before a step that may use them)."""
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def _copy(self, transfers: Sequence[Transfer], device: ModelCaches) -> None:
        """One batched copy per kind and tensor, the host's own block moves first."""
        host = self.caches
        by_kind: dict[TransferKind, tuple[list[int], list[int]]] = {}
        for t in transfers:
            src, dst = by_kind.setdefault(t.kind, ([], []))
            src.append(t.src)
            dst.append(t.dst)
        moves = by_kind.pop(TransferKind.KV_MOVE, None)
        if moves is not None:
            # a gather then a scatter: every source is read before any block is written
            src_idx, dst_idx = (torch.tensor(ids, dtype=torch.int64) for ids in moves)
            for hst in host.k_cache + host.v_cache:
                _move(hst, src_idx, hst, dst_idx)
        for kind, (src, dst) in by_kind.items():
            if kind.is_kv:
                pairs = list(zip(device.k_cache + device.v_cache, host.k_cache + host.v_cache, strict=True))
            else:
                pairs = list(zip(device.state_tensors(), host.state_tensors(), strict=True))
            if not pairs:
                continue
            # the index tensors once per kind, each on the side it indexes
            host_ids, dev_ids = (src, dst) if kind.is_load else (dst, src)
            host_idx = torch.tensor(host_ids, dtype=torch.int64)
            dev_idx = torch.tensor(dev_ids, dtype=torch.int64, device=pairs[0][0].device)
            for dev, hst in pairs:
                if kind.is_load:
                    _move(hst, host_idx, dev, dev_idx)
                else:
                    _move(dev, dev_idx, hst, host_idx)


def _move(src_t: torch.Tensor, src_idx: torch.Tensor, dst_t: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst_t[dst_idx] = src_t[src_idx]`` across devices (host side pinned on CUDA)."""
    rows = src_t.index_select(0, src_idx)
    if rows.device != dst_t.device:
        if rows.device.type == "cpu":  # host -> device: async from pinned memory
            rows = rows.pin_memory().to(dst_t.device, non_blocking=True)
        else:  # device -> host: the host writes the rows right after, so this one waits
            rows = rows.to(dst_t.device)
    dst_t.index_copy_(0, dst_idx, rows)


def _by_request(loads: Sequence[Transfer]) -> list[list[Transfer]]:
    """The loads grouped by the request that waits for them (a group fails together)."""
    groups: dict[int, list[Transfer]] = {}
    for t in loads:
        groups.setdefault(id(t.seq), []).append(t)
    return list(groups.values())
