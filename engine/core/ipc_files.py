"""The ipc socket files of engine-core processes: where a run's socket goes, and who removes it.

``new_address()`` puts the socket in a private folder of the run in the temp folder
(``deltaserve-<pid of the process that starts the core>-<random>/core``; ``tempfile.mkdtemp``,
mode 0700), after removing what killed runs left there (``remove_stale``). The core removes its
socket and folder as it exits (``remove_address``), and so does the process that started it
when it sees the core gone (``core_proc.CoreHandle``: a killed core cannot). ``remove_stale``
touches only entries of our names owned by this user whose processes are gone: never anything
else in the temp folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import tempfile
import time

from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")


def pid_alive(pid: int) -> bool:
    """The process ``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the kill probe answered


#: a run's private folder in the temp folder (``tempfile.mkdtemp``, mode 0700): the pid of the
#: process that started the core, then mkdtemp's 8 random characters; it holds the one socket
#: ``CORE_SOCKET``
RUN_DIR = re.compile(r"deltaserve-(\d+)-[a-z0-9_]{8}")
CORE_SOCKET = "core"
#: the socket files of older versions, straight in the temp folder; removed when no process
#: listens on them and they are older than ``LEGACY_MIN_AGE_S`` (a core of an older version
#: binds before it listens: a fresh one may be live)
LEGACY_SOCKET = re.compile(r"deltaserve-core-[0-9a-f]{12}")
LEGACY_MIN_AGE_S = 60.0


def new_address() -> str:
    """A fresh ipc:// address: the socket ``CORE_SOCKET`` in a private folder of this run in the
    temp folder (``RUN_DIR``). What killed runs left there is removed first (``remove_stale``)."""
    tmp = tempfile.gettempdir()
    remove_stale(tmp)
    folder = tempfile.mkdtemp(prefix=f"deltaserve-{os.getpid()}-", dir=tmp)
    return f"ipc://{folder}/{CORE_SOCKET}"


def remove_address(address: str) -> None:
    """Remove the socket file of the ipc:// ``address`` a core bound, and its folder when that is a
    run folder (``RUN_DIR``) left empty; anything else is left alone. Idempotent: the core does
    this as it exits, its starter when it sees the core gone (a killed core cannot)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://") :]
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    folder, name = os.path.split(path)
    if name == CORE_SOCKET and RUN_DIR.fullmatch(os.path.basename(folder)):
        with contextlib.suppress(OSError):  # not empty (not ours to empty), or gone
            os.rmdir(folder)


def _listened_on(path: str) -> bool:
    """Some process may accept connections on the unix socket ``path`` (a live core): only a
    refused connection says no (a full backlog, a timeout or any other error count as yes)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()


def _stale_socket(path: str, min_age_s: float = 0.0) -> bool:
    """``path`` is a unix socket of this user, at least ``min_age_s`` old, that no process
    listens on."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    old_enough = time.time() - st.st_mtime >= min_age_s
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and old_enough and not _listened_on(path)


def remove_stale(tmp: str) -> list[str]:
    """Remove what killed runs left in the temp folder ``tmp``; the paths removed. Only entries of
    our names, owned by this user: a run folder (``RUN_DIR``) whose starter's pid is gone, that
    holds nothing but a socket no process listens on (or nothing); an older version's socket
    file (``LEGACY_SOCKET``) no process listens on, a minute old. Anything else is never touched."""
    removed = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return removed
    for entry in entries:
        if LEGACY_SOCKET.fullmatch(entry.name):
            if _stale_socket(entry.path, LEGACY_MIN_AGE_S):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.path)
            continue
        m = RUN_DIR.fullmatch(entry.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            st = os.lstat(entry.path)
            inside = os.listdir(entry.path) if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None
        except OSError:
            continue
        sock = os.path.join(entry.path, CORE_SOCKET)
        if inside is None or inside not in ([], [CORE_SOCKET]) or (inside and not _stale_socket(sock)):
            continue
        remove_address(f"ipc://{sock}")
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    if removed:
        log.info("core_proc.removed_stale", paths=removed)
    return removed
