"""Chained block hashes: the key of a full KV block names its whole prefix.

``h_i = xxh3_128(h_{i-1} || salt || tokens_i)`` with ``h_{-1} = 0``. Equal keys mean
equal prefixes (up to a 2^-128 collision), so a radix tree keyed by these hashes needs no
token comparison. The salt separates caches that must never share (model, adapter,
tenant ``cache_salt``). Partial blocks are never hashed: they are never shared.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash


def make_salt(*parts: str | None) -> bytes:
    """Combine namespace strings (model id, adapter, per-request cache_salt) into a salt."""
    return b"\x1f".join((p or "").encode() for p in parts)


def hash_block(parent: int, salt: bytes, tokens: Sequence[int]) -> int:
    h = xxhash.xxh3_128()
    h.update(parent.to_bytes(16, "little"))
    h.update(salt)
    h.update(array("q", tokens).tobytes())
    return h.intdigest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, *, start_block: int = 0, parent: int = 0
) -> list[int]:
    """Hashes of the full blocks ``start_block, start_block+1, ...`` of ``token_ids``.

    ``parent`` must be the hash of block ``start_block - 1`` (0 for the first block).
    """
    out: list[int] = []
    h = parent
    for i in range(start_block, len(token_ids) // block_size):
        h = hash_block(h, salt, token_ids[i * block_size : (i + 1) * block_size])
        out.append(h)
    return out
