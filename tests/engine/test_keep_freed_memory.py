"""``engine.memory``: after ``keep_freed_memory`` a freed large tensor's pages are reused by
the next one of that size (no page fault per page), which is what the CPU step relies on."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from deltaserve.engine.runner.memory import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

SIZE = 48 * 1024**2 // 4  # floats: above glibc's largest default mmap threshold (32 MiB)


def _faults_of_fresh_tensor() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(SIZE)
    t.fill_(1.0)  # touch every page
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_blocks_are_reused_without_page_faults() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
    # The first few blocks of this size grow the heap (their pages fault once, more when the
    # heap's layout from earlier tests is in the way); then the freed block is reused. A mmap'd
    # block (glibc's default above 32 MiB) would fault on every one of its pages, every time.
    faults = [_faults_of_fresh_tensor() for _ in range(8)]
    pages = SIZE * 4 // 4096
    assert max(faults[-3:]) < pages // 10, faults
