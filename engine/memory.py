"""The engine process's host memory: what is resident, and giving freed memory back to the OS.

Contract:

* ``resident()`` reads the process's resident set from ``/proc/self/status``: total, anonymous
  (weights, cache pools, activations, the interpreter) and file-backed (mapped files, shared
  libraries), in bytes; ``None`` where there is no such file (not Linux).
* ``configure_allocator()`` sets glibc malloc's thresholds once per process: buffers of
  ``MMAP_THRESHOLD`` bytes or more get a mapping of their own, unmapped when freed, and free
  memory above ``TRIM_THRESHOLD`` at the top of a heap goes back at ``free``. glibc otherwise
  raises its mmap threshold to the largest buffer freed so far (up to 32 MiB), so the
  activation temporaries of a large prefill step stay in the heap free lists after the step.
  Returns whether the settings took effect (False off glibc; nothing is changed then).
* ``release()`` is ``malloc_trim(0)``: the free pages of every arena (the step thread's
  included) go back to the OS. Returns False off glibc. ``Releaser`` calls it once each time
  the engine goes idle after work, so a quiet engine holds what it planned for and no more.

Neither touches memory that is in use: they only change where freed memory goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from pathlib import Path

from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")

MiB = 1024**2
#: buffers this large or larger are mapped on their own and unmapped when freed
MMAP_THRESHOLD = 1 * MiB
#: free memory beyond this at the top of a heap is returned at ``free``
TRIM_THRESHOLD = 16 * MiB
# mallopt parameter numbers (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

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
    """The C library when it is glibc (it has ``malloc_trim`` and ``mallopt``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only; musl and others lack it
        libc.malloc_trim  # noqa: B018
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


@functools.cache
def configure_allocator() -> bool:
    """Fixed mmap and trim thresholds for glibc malloc (once per process); False off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; either setting also stops glibc's dynamic threshold
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("memory.mallopt_failed", mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    return ok


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

    def worked(self) -> None:
        self.pending = self.enabled

    def idle(self) -> bool:
        """Release if work ran since the last release; whether it did."""
        if not self.pending:
            return False
        self.pending = False
        if release():
            self.releases += 1
            return True
        return False
