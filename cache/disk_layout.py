"""The disk store's folder: what it owns, and file operations that never follow a link.

The store owns only what it made. Its marker is ``manifest.json`` (a regular file of at most
``MANIFEST_MAX_BYTES``) that decodes with ``"magic": STORE_MAGIC``, or one that decodes whole
as a ``Manifest`` without a ``magic`` field (what earlier versions wrote). What an open finds
(``survey``, read-only, then again under the lock):

* **empty**: nothing, or only what a creation cut short leaves (``lock``, ``manifest.json.tmp``)
  and set-asides that carry their marker: the store is created there, manifest first.
* **store**: the marker is there (its identity is the caller's to compare), or the manifest is
  missing or invalid but the folder is clearly a store: it holds only the store's own names,
  ``items/`` is a real folder of ``<xx>`` fan folders of item files, ``tmp/`` (if there) holds
  only item files.
* **foreign**: anything else. The store refuses it (``DiskStoreError``) and changes nothing:
  no lock file, no rename, no removal.

A store of another identity, or one without a valid manifest, is *set aside*: a new
``set-aside-<stamp>/`` gets ``SET_ASIDE_MARKER`` first, then only the store's own entries
(``STORE_ENTRIES``) are renamed into it, except a regular ``manifest.json``, which is copied
(the caller renames the new store's manifest over it: the folder is never without its
marker, whenever a crash comes). Anything else in the folder stays where it is. Only set-asides that carry the marker are ever removed (the newest stays);
one without it (an older version's, or not ours) is kept and logged.

No link inside the store is followed (the store path itself may be one: the user's choice).
Names are resolved relative to directory descriptors opened with ``O_NOFOLLOW``; a file is
read only if ``fstat`` says it is regular (opened ``O_NONBLOCK``: a FIFO never blocks); a file
is written as a new ``O_EXCL | O_NOFOLLOW`` temporary, fsynced and renamed over the name (a
link there is replaced, its target never written).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from deltaserve.cache.disk_format import Manifest, accounted_bytes, fan_of, parse_item_name
from deltaserve.cache.disk_index import DiskEntry
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cache")

STORE_MAGIC = "deltaserve-disk-store"
SET_ASIDE_MAGIC = "deltaserve-disk-store-set-aside"
MANIFEST = "manifest.json"
ITEMS = "items"
TMP = "tmp"
INDEX = "index.bin"
LOCK = "lock"
SET_ASIDE_PREFIX = "set-aside-"
SET_ASIDE_MARKER = "set-aside.json"
# the store's own entries: what a set-aside moves (the manifest last, and as a copy)
STORE_ENTRIES = (ITEMS, TMP, INDEX, INDEX + ".tmp", MANIFEST + ".tmp", MANIFEST)
# a manifest is ~500 bytes; anything far larger is not one (decoded only below this)
MANIFEST_MAX_BYTES = 64 << 10
_FAN_NAME = re.compile(r"[0-9a-f]{2}")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskStoreError(Exception):
    """The disk store cannot be opened as asked: an identity whose ``format`` is not this
    module's, a path that cannot be locked or created, a non-empty folder that is not a
    store. Raised by ``DiskStore(...)`` only; I/O errors after the open are never raised (a
    write drops, a read misses)."""


class DiskStoreLocked(DiskStoreError):
    """Another ``DiskStore`` (in this process or another) holds the path's lock: one store
    per path at a time. The message names the path."""


class _Head(msgspec.Struct):
    """The manifest's marker field alone (any other field is skipped)."""

    magic: str = ""


class _SetAside(msgspec.Struct):
    magic: str
    reason: str
    created: float


# what a damaged JSON document can raise from msgspec (deep nesting: RecursionError)
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "a link"
    return f"unreadable ({errno.errorcode.get(e.errno or 0, str(e))})"


def read_regular(dir_fd: int, name: str, limit: int) -> tuple[bytes | None, str]:
    """The bytes of regular file ``name`` in ``dir_fd`` (at most ``limit``), or None and why
    not: missing, a link, not a regular file (a FIFO, a device: never waited on), too large,
    or unreadable."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, _why(e)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        data = b""
        if st.st_size <= limit:
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(limit + 1)  # (a file growing meanwhile is caught here)
        if st.st_size > limit or len(data) > limit:
            return None, f"larger than {limit} bytes"
        return data, ""
    except OSError as e:
        return None, _why(e)
    finally:
        os.close(fd)


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` in ``dir_fd`` crash-safely: a new ``<name>.tmp`` (a leftover, a link
    included, is unlinked first; never opened), fsynced, renamed over ``name``."""
    tmp = name + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def open_dir(dir_fd: int, name: str) -> int:
    """A descriptor of the real folder ``name`` in ``dir_fd`` (a link there: ``OSError``)."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def own_dir(dir_fd: int, name: str) -> int:
    """The store's own folder ``name`` in ``dir_fd``, made if missing; anything else under
    that name (a link, a file) is unlinked first: the name is the store's, a link's target is
    never touched."""
    try:
        return open_dir(dir_fd, name)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dir_fd)
        log.warning("disk_store.entry_replaced", name=name, reason="not a folder (a link or a file)")
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    return open_dir(dir_fd, name)


def decode_manifest(raw: bytes) -> tuple[Manifest | None, bool, str]:
    """(the manifest when it decodes whole, whether it is the store's marker, why it is not
    a valid manifest). Never raises, whatever the bytes."""
    try:
        head = msgspec.json.decode(raw, type=_Head)
    except _DECODE_ERRORS as e:
        return None, False, f"invalid ({type(e).__name__})"
    if head.magic not in ("", STORE_MAGIC):
        return None, False, "invalid (another magic)"
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except _DECODE_ERRORS as e:
        # with the magic it is ours whatever the rest says; without it, nothing says so
        return None, head.magic == STORE_MAGIC, f"identity invalid ({type(e).__name__})"
    return manifest, True, ""


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(manifest, magic=STORE_MAGIC))


@dataclass(frozen=True, slots=True)
class Survey:
    """What an open found at the store path (module docstring)."""

    kind: Literal["empty", "store", "foreign"]
    manifest: Manifest | None  # a valid manifest (kind "store" only)
    legacy: bool  # that manifest has no magic: rewritten with it on reuse
    reason: str  # why the manifest is not valid ("" when it is)


def refuse_foreign(found: Survey, path: Path) -> None:
    """A ``DiskStoreError`` for a folder that is neither empty nor a store."""
    if found.kind == "foreign":
        raise DiskStoreError(
            f"{path} is not a deltaserve disk store and is not empty (manifest.json: {found.reason}); "
            "choose an empty folder or a new path"
        )


def _entries(dir_fd: int) -> dict[str, os.DirEntry[str]]:
    with os.scandir(dir_fd) as it:
        return {e.name: e for e in it}


def _is_file(e: os.DirEntry[str]) -> bool:
    return e.is_file(follow_symlinks=False)


def _is_dir(e: os.DirEntry[str]) -> bool:
    return e.is_dir(follow_symlinks=False)


def marked_set_aside(dir_fd: int, name: str) -> bool:
    """``name`` is a real folder that carries the set-aside marker (one this store made)."""
    try:
        fd = open_dir(dir_fd, name)
    except OSError:
        return False
    try:
        raw, _ = read_regular(fd, SET_ASIDE_MARKER, MANIFEST_MAX_BYTES)
    finally:
        os.close(fd)
    if raw is None:
        return False
    try:
        return msgspec.json.decode(raw, type=_SetAside).magic == SET_ASIDE_MAGIC
    except _DECODE_ERRORS:
        return False


def _only_items(dir_fd: int, name: str, fans: bool) -> bool:
    """Folder ``name`` is real and holds nothing but item files (``fans``: nothing but fan
    folders of item files, at least one)."""
    try:
        fd = open_dir(dir_fd, name)
    except OSError:
        return False
    try:
        entries = _entries(fd).values()
        if not fans:
            return all(parse_item_name(e.name) is not None for e in entries)
        return bool(entries) and all(
            is_fan(e.name) and _is_dir(e) and _only_items(fd, e.name, fans=False) for e in entries
        )
    finally:
        os.close(fd)


def _clearly_a_store(dir_fd: int, entries: dict[str, os.DirEntry[str]]) -> bool:
    """Without a valid manifest: nothing but the store's names, ``items/`` a real folder of
    fan folders of item files, ``tmp/`` (if there) of item files. A folder of someone else's
    does not look like that by accident."""
    ours = {*STORE_ENTRIES, LOCK}
    if any(n not in ours and not n.startswith(SET_ASIDE_PREFIX) for n in entries):
        return False
    return _only_items(dir_fd, ITEMS, fans=True) and (
        TMP not in entries or _only_items(dir_fd, TMP, fans=False)
    )


def survey(dir_fd: int) -> Survey:
    """Classify the folder of ``dir_fd`` (reads only; module docstring)."""
    raw, reason = read_regular(dir_fd, MANIFEST, MANIFEST_MAX_BYTES)
    manifest, ours = None, False
    if raw is not None:
        manifest, ours, reason = decode_manifest(raw)
    if ours:
        return Survey("store", manifest, manifest is not None and manifest.magic != STORE_MAGIC, reason)
    entries = _entries(dir_fd)
    leftover = {LOCK, MANIFEST + ".tmp"}
    if all(
        (n in leftover and _is_file(e)) or (n.startswith(SET_ASIDE_PREFIX) and marked_set_aside(dir_fd, n))
        for n, e in entries.items()
    ):
        return Survey("empty", None, False, reason)
    if _clearly_a_store(dir_fd, entries):
        return Survey("store", None, False, reason)
    return Survey("foreign", None, False, reason)


def set_aside(dir_fd: int, reason: str) -> str:
    """Move the store's own entries into a new marked ``set-aside-<stamp>`` folder (the
    manifest as a copy: the caller replaces it); the folder's name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name, n = f"{SET_ASIDE_PREFIX}{stamp}", 1
    while True:
        try:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
            break
        except FileExistsError:
            n += 1
            name = f"{SET_ASIDE_PREFIX}{stamp}-{n}"
    dest = open_dir(dir_fd, name)
    try:
        replace_file(
            dest, SET_ASIDE_MARKER, msgspec.json.encode(_SetAside(SET_ASIDE_MAGIC, reason, time.time()))
        )
        present = _entries(dir_fd)
        for entry in STORE_ENTRIES:
            if entry not in present:
                continue
            if entry == MANIFEST and _is_file(present[entry]):
                # copied: the folder keeps a manifest until the caller's new one is renamed
                # over it, so a crash in between leaves a store, not an unmarked folder
                raw, _ = read_regular(dir_fd, MANIFEST, MANIFEST_MAX_BYTES)
                if raw is not None:
                    replace_file(dest, MANIFEST, raw)
                continue
            os.rename(entry, entry, src_dir_fd=dir_fd, dst_dir_fd=dest)  # a link moves, not its target
    finally:
        os.close(dest)
    return name


def remove_older_set_asides(dir_fd: int, path: Path, keep: str) -> None:
    """Only the newest set-aside stays: switching models back and forth must not fill the
    disk. A set-aside is removed only if it carries the marker (``rmtree`` never follows a
    link); any other ``set-aside-*`` is kept and named in a warning."""
    for name, entry in _entries(dir_fd).items():
        if not name.startswith(SET_ASIDE_PREFIX) or name == keep:
            continue
        if _is_dir(entry) and marked_set_aside(dir_fd, name):
            shutil.rmtree(path / name, ignore_errors=True)
            log.warning("disk_store.set_aside_removed", path=str(path / name))
        else:
            log.warning(
                "disk_store.set_aside_kept",
                path=str(path / name),
                reason="no set-aside marker: not made by this store version; remove it yourself if unneeded",
            )


def is_fan(name: str) -> bool:
    return _FAN_NAME.fullmatch(name) is not None


def create_file(dir_fd: int, name: str) -> int:
    """A new file ``name`` in ``dir_fd`` for writing; a leftover under that name (a crashed
    write, a planted link) is unlinked first, never opened."""
    try:
        return os.open(name, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, CREATE_FLAGS, 0o644, dir_fd=dir_fd)


def unlink_in(dir_fd: int, sub: str, name: str) -> None:
    """Unlink ``sub/name`` under ``dir_fd`` (``sub`` a real folder: a link there is not
    traversed); an error is ignored (the name is gone or cannot be reached)."""
    try:
        fd = open_dir(dir_fd, sub)
    except OSError:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def take_lock(dir_fd: int, path: Path) -> tuple[int, bool]:
    """The ``flock``ed ``lock`` file's descriptor, and whether this call created the file
    (a link or anything but a regular file there: ``DiskStoreError``)."""
    made = True
    try:
        try:
            fd = os.open(
                LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd
            )
        except FileExistsError:
            made = False
            fd = os.open(LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise DiskStoreError(f"cannot lock disk store {path}: {e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DiskStoreError(f"cannot lock disk store {path}: {LOCK} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DiskStoreLocked(f"disk store {path} is in use by another DiskStore (lock held)") from e
        raise DiskStoreError(f"cannot lock disk store {path}: {e}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def clear_tmp(tmp_fd: int, path: Path) -> None:
    """Partial writes of a crashed process go (``tmp/`` of store ``path`` is its own)."""
    with os.scandir(tmp_fd) as it:
        entries = list(it)
    for e in entries:
        if _is_dir(e):
            shutil.rmtree(path / TMP / e.name, ignore_errors=True)  # never follows a link
        else:
            with contextlib.suppress(OSError):
                os.unlink(e.name, dir_fd=tmp_fd)


def list_items(items_fd: int) -> list[DiskEntry]:
    """Every item file in ``items/<xx>/``, by its name alone (no file is opened). Anything
    else that is not a folder goes: a link is unlinked, its target never seen."""
    found: list[DiskEntry] = []
    for sub in _entries(items_fd).values():
        if not _is_dir(sub):
            with contextlib.suppress(OSError):
                os.unlink(sub.name, dir_fd=items_fd)
            continue
        fan = int(sub.name, 16) if is_fan(sub.name) else -1
        try:
            fd = open_dir(items_fd, sub.name)
        except OSError:
            continue
        try:
            for entry in _entries(fd).values():
                if _is_dir(entry):
                    continue  # never written by the store; not removed (nothing recursive)
                parsed = parse_item_name(entry.name) if _is_file(entry) else None
                if parsed is None or fan_of(parsed[1]) != fan:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=fd)
                    continue
                kind, key, parent, length, cost = parsed
                found.append(DiskEntry(kind, key, parent, length, accounted_bytes(length), cost))
        finally:
            os.close(fd)
    return found
