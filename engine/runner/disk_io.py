"""The disk tier's copies: cache rows to bytes for the store, verified bytes back into rows.

An item's bytes are its rows of every layer's tensors, concatenated in a fixed order (a KV
block: each attention layer's K row, then each one's V row; a checkpoint: each GDN layer's
conv state, then each one's recurrent state), so the same bytes fit the device and the host
tiers, arena or not. ``identity`` names what must match for a store's bytes to be reused.

``save`` runs first in a step (before the host saves and the block moves can overwrite
what it reads) and never waits on the disk: it hands bytes to the store's writer queue. A
failed copy-out drops those items (logged); it never fails the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from deltaserve.cache.disk_store import DiskStore, ItemKind, StoreIdentity
from deltaserve.cache.types import DiskItemKind, DiskSave, Tier, Transfer, TransferKind
from deltaserve.logs import get_logger
from deltaserve.models import LoadedModel, ModelCaches

log = get_logger("deltaserve.engine")

#: how cache salts are formed (``InputProcessor``: model path, dtype, namespace, request salt)
SALT_RULE = "path|dtype|namespace|cache_salt:v1"


def kv_tensors(caches: ModelCaches) -> list[torch.Tensor]:
    return [*caches.k_cache, *caches.v_cache]


def row_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one row (index 0 along dim 0) across ``tensors``."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def pack(tensors: Sequence[torch.Tensor], ids: Sequence[int]) -> list[bytes]:
    """Each row of ``ids``, every tensor's row concatenated, as bytes."""
    if not ids:
        return []
    idx = torch.tensor(list(ids), dtype=torch.int64, device=tensors[0].device)
    parts = [t.index_select(0, idx).reshape(len(ids), -1).view(torch.uint8).cpu() for t in tensors]
    rows = torch.cat(parts, dim=1)
    return [rows[i].numpy().tobytes() for i in range(len(ids))]


def unpack(tensors: Sequence[torch.Tensor], ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write each payload into row ``ids[i]`` of every tensor (the inverse of ``pack``)."""
    if not ids:
        return
    data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(ids), -1)
    idx = torch.tensor(list(ids), dtype=torch.int64, device=tensors[0].device)
    off = 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        rows = data[:, off : off + n].contiguous().view(t.dtype).view(len(ids), *t.shape[1:])
        t.index_copy_(0, idx, rows.to(t.device))
        off += n


def weights_fingerprint(loaded: LoadedModel) -> str:
    """A cheap fingerprint of the weights: every parameter's name, shape and dtype, and the
    bytes of its first and last 4 KiB (a full hash of many GB would cost seconds at start-up;
    weights that differ only in their middle are not a deployment anyone makes)."""
    h = xxhash.xxh3_128()
    for name, p in loaded.model.state_dict().items():
        flat = p.detach().reshape(-1).view(torch.uint8) if p.numel() else p.detach().reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[:4096].cpu().numpy().tobytes())
        h.update(flat[-4096:].cpu().numpy().tobytes())
    return h.hexdigest()


def identity(loaded: LoadedModel, caches: ModelCaches, block_size: int, gdn_chunk_size: int) -> StoreIdentity:
    """What a store must match to be reused by this engine."""
    config = loaded.hf_config.to_json_string(use_diff=False)
    return StoreIdentity(
        model=xxhash.xxh3_128_hexdigest(config.encode()),
        weights=weights_fingerprint(loaded),
        dtype=str(kv_tensors(caches)[0].dtype if caches.k_cache else caches.ssm_state[0].dtype),
        block_size=block_size,
        gdn_chunk_size=gdn_chunk_size,
        salt_rule=SALT_RULE,
        kv_block_bytes=row_bytes(kv_tensors(caches)) if caches.k_cache else 0,
        checkpoint_bytes=row_bytes(caches.state_tensors()),
    )


class DiskIO:
    """The runner's side of the disk tier: copies out (saves) and in (loads)."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store

    @torch.inference_mode()
    def save(self, saves: Sequence[DiskSave], device: ModelCaches, host: ModelCaches | None) -> None:
        """Copy each save's rows out and queue them on the store (dropped when its queue is
        full); a failed copy drops the batch, logged."""
        if not saves:
            return
        try:
            groups: dict[tuple[DiskItemKind, Tier], list[DiskSave]] = {}
            for s in saves:
                groups.setdefault((s.kind, s.tier), []).append(s)
            payloads: dict[int, bytes] = {}
            for (kind, tier), group in groups.items():
                caches = device if tier is Tier.DEVICE else host
                assert caches is not None, "a disk save from a host tier that does not exist"
                tensors = kv_tensors(caches) if kind is DiskItemKind.KV else caches.state_tensors()
                for s, data in zip(group, pack(tensors, [s.src for s in group]), strict=True):
                    payloads[id(s)] = data
        except Exception as e:
            log.error("disk.save_failed", items=len(saves), error=repr(e))
            return
        put = self.store.put
        for s in saves:  # in plan order: parents before their children
            put(ItemKind(int(s.kind)), s.key, s.parent, payloads[id(s)], s.cost)

    @torch.inference_mode()
    def load(self, loads: Sequence[Transfer], device: ModelCaches) -> None:
        """Write the disk loads' bytes into their device blocks and live slots."""
        kv = [t for t in loads if t.kind is TransferKind.DISK_KV_LOAD]
        state = [t for t in loads if t.kind is TransferKind.DISK_STATE_LOAD]
        if kv:
            unpack(kv_tensors(device), [t.dst for t in kv], [t.payload or b"" for t in kv])
        if state:
            unpack(device.state_tensors(), [t.dst for t in state], [t.payload or b"" for t in state])
