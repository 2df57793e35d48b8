"""Test helpers over the cache manager's public surface."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.cache import CacheManager


def lookup(
    cm: CacheManager,
    token_ids: Sequence[int],
    salt: bytes,
    hashes: list[int] | None = None,
    *,
    key: str | None = None,
) -> int:
    """Joint-hit length in tokens of a prompt (``CacheManager.match``), without side effects."""
    return cm.match(token_ids, salt, hashes, key=key).hit_tokens
