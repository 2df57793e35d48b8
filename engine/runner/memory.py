"""The engine process's host memory: what is resident, and giving freed memory back to the OS.

Contract:

* ``resident()`` reads the process's resident set from ``/proc/self/status``: total, anonymous
  (weights, cache pools, activations, the interpreter) and file-backed (mapped files, shared
  libraries), in bytes; ``None`` where there is no such file (not Linux).
* ``keep_freed_memory()`` (the model runner, on the CPU; once per process) raises glibc's mmap
  and trim thresholds so that while work runs freed activation buffers up to 256 MiB stay in
  the heap and are reused, instead of being unmapped and faulted in again next step.
* ``release()`` is ``malloc_trim(0)``: the free pages of every glibc arena (the step thread's
  included) go back to the OS. Returns False off glibc (nothing to do there). ``Releaser``
  calls it once each time the engine goes idle after work, so a quiet engine holds what it
  planned for and no more.

Why keep while busy, release at idle: torch's CPU allocator is ``malloc``; by default glibc
serves a block above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh
``mmap``, so each step's large temporaries start on untouched pages and every first write
takes a page fault per 4 KiB. A 512-token depthwise conv of the 0.8B shape spent two thirds of
its time there (33 -> 11 ms with the thresholds raised); thresholds *lowered* so that every
freed buffer of 1 MiB or more is unmapped made the elementwise ops of a 400-token chunk 7x
slower. What the heap keeps while busy is bounded by the largest step
(``max_num_batched_tokens``); at idle it goes back. Neither touches memory in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")

MiB = 1024**2
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class Resident:
    """Resident memory of this process, in bytes."""

    total: int  # VmRSS
    anon: int  # RssAnon: private memory (heap, tensors, mapped pools)
    file: int  # RssFile: pages of mapped files (libraries, memory-mapped weights)
    peak: int  # VmHWM: the most ``total`` has been

    def mib(self) -> dict[str, float]:
        """The four numbers in MiB, rounded to 0.1 (for log lines)."""
        return {
            "rss_mib": round(self.total / MiB, 1),
            "rss_anon_mib": round(self.anon / MiB, 1),
            "rss_file_mib": round(self.file / MiB, 1),
            "rss_peak_mib": round(self.peak / MiB, 1),
        }


def parse_status(text: str) -> Resident:
    """The resident set from the text of ``/proc/<pid>/status`` (its values are in kB).
    A field the kernel does not report (RssAnon/RssFile before Linux 4.5) reads as 0."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    if "VmRSS" not in fields:
        raise ValueError("no VmRSS line in the status text")
    return Resident(
        total=fields["VmRSS"],
        anon=fields.get("RssAnon", 0),
        file=fields.get("RssFile", 0),
        peak=fields.get("VmHWM", fields["VmRSS"]),
    )


def resident() -> Resident | None:
    """This process's resident memory; None where ``/proc/self/status`` does not exist."""
    try:
        return parse_status(_STATUS.read_text())
    except OSError:
        return None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only; musl and others lack it
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def release() -> bool:
    """``malloc_trim(0)``: free pages of every arena go back to the OS; False off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class Releaser:
    """Calls ``release()`` once each time the engine goes idle after doing work.

    ``worked()`` after a step that ran the model; ``idle()`` when nothing is left to run.
    Disabled (``enabled=False``) it does nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.pending = False  # work ran since the last release
        self.releases = 0
        self.last_release_s = 0.0  # how long the last release took

    def worked(self) -> None:
        self.pending = self.enabled

    def idle(self) -> bool:
        """Release if work ran since the last release; whether it did."""
        if not self.pending:
            return False
        self.pending = False
        started = time.perf_counter()
        if not release():
            return False
        self.releases += 1
        self.last_release_s = time.perf_counter() - started
        now = resident()
        log.debug("memory.released", ms=round(self.last_release_s * 1000, 2), **(now.mib() if now else {}))
        return True


# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 * MiB  # blocks up to this size come from the heap and are reused
TRIM_THRESHOLD = 512 * MiB  # free memory at the heap top kept while busy (``release`` frees it)


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether it took effect."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("memory.mallopt_refused", mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    return ok
