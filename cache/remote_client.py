"""The remote tier's connection to a Mooncake Store: one client, its I/O thread, its breaker.

``mooncake://HOST:PORT`` names a Mooncake Store master's RPC address. The client joins with
``P2PHANDSHAKE`` metadata (no metadata server: peers exchange segment descriptors
directly, so the master is the only address a replica needs) over TCP, and lends the store
``segment_bytes`` of its memory (objects live in the segments of the clients that joined:
``deltaserve store`` lends one too, so the store outlives its replicas).

Contract:

* the Mooncake client runs in a child process (its calls hold the GIL while they wait on
  the network: in the engine's process one stalled call would stall every thread), driven
  by this client's one I/O thread: ``call`` waits at most ``timeout_s``; a stalled call
  holds the I/O thread, never the caller; a dead process is started again by the next call;
* a call that fails or times out counts against a circuit breaker: after ``FAILURES_TO_OPEN``
  in a row the breaker opens and calls are refused at once (``RemoteUnavailable``) for a
  backoff that doubles up to ``MAX_BACKOFF_S``; after it, one call is let through (a probe)
  and its success closes the breaker. Opening logs one line (``remote.unavailable``);
* ``call`` never raises anything but ``RemoteUnavailable``: the remote tier loses hits, never
  a request. Counters: ``remote.calls``, ``remote.failures``, ``remote.timeouts``,
  ``remote.refused``, ``remote.breaker_opens``.

The ``mooncake`` package (the ``remote`` extra: ``mooncake-transfer-engine-non-cuda``) is
imported only when a client is made; ``mooncake_import_error`` says why it cannot be.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any, TypeVar
from urllib.parse import urlsplit

from deltaserve.logs import get_logger

log = get_logger("deltaserve.cache")

T = TypeVar("T")
SCHEME = "mooncake"
FAILURES_TO_OPEN = 3
BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class RemoteUnavailable(Exception):
    """The store did not answer in time, failed, or the breaker is open: a miss, not an error."""


def parse_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``mooncake://HOST:PORT``; ``ValueError`` saying what is wrong."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"not a mooncake://HOST:PORT address ({e})") from None
    if parts.scheme != SCHEME:
        raise ValueError("not a mooncake://HOST:PORT address (the scheme must be mooncake)")
    if not parts.hostname or port is None or port <= 0:
        raise ValueError("not a mooncake://HOST:PORT address (a host and a port are required)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError("not a mooncake://HOST:PORT address (nothing may follow the port)")
    return parts.hostname, port


def mooncake_import_error() -> str | None:
    """Why ``mooncake.store`` cannot be imported here (None: it can)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # an ImportError, or an OSError of a missing system library
        return f"{type(e).__name__}: {e}"
    return None


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers reach our segment at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # (UDP: no packet is sent)
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class Breaker:
    """Consecutive failures open it; it half-opens after a backoff that doubles while probes fail."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.failures = 0
        self.backoff = BASE_BACKOFF_S
        self.open_until: float | None = None
        self.opens = 0

    def allow(self) -> bool:
        return self.open_until is None or self.clock() >= self.open_until

    def success(self) -> None:
        self.failures, self.backoff, self.open_until = 0, BASE_BACKOFF_S, None

    def failure(self) -> bool:
        """Count a failure; True when this one opens the breaker (or re-opens it after a probe)."""
        self.failures += 1
        if self.open_until is not None:  # a probe failed: wait longer
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
            self.open_until = self.clock() + self.backoff
            return False
        if self.failures >= FAILURES_TO_OPEN:
            self.open_until = self.clock() + self.backoff
            self.opens += 1
            return True
        return False


class MooncakeClient:
    """One Mooncake store client in a child process, behind an I/O thread, a timeout and a
    breaker (module docstring). The process is started on the I/O thread (and started
    again after it died): making a client never waits on the store."""

    def __init__(
        self,
        url: str,
        *,
        segment_bytes: int,
        buffer_bytes: int,
        timeout_s: float,
        local_hostname: str | None = None,
    ) -> None:
        host, port = parse_url(url)
        self.url, self.timeout_s = url, timeout_s
        me = local_hostname or local_address(host, port)
        self._setup = (me, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", f"{host}:{port}")
        self.breaker = Breaker()
        self.counters: dict[str, int] = dict.fromkeys(
            ("remote.calls", "remote.failures", "remote.timeouts", "remote.refused", "remote.breaker_opens",
             "remote.connects"), 0
        )  # fmt: skip
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[Any], str, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="deltaserve-remote-io", daemon=True)
        self._thread.start()
        self._ready: Future[Any] = Future()
        self._jobs.put((self._ready, "", ()))  # connect now, in the background

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the first connection is made (True) or failed / still going (False)."""
        try:
            self._ready.result(timeout=timeout_s)
            return True
        except Exception:
            return False

    def call(self, name: str, *args: Any, ok: Callable[[Any], bool] | None = None) -> Any:
        """``store.<name>(*args)`` in the client process, its result within ``timeout_s``;
        ``RemoteUnavailable`` if refused (breaker open, closed), timed out, raised, or
        ``ok(result)`` is False (a Mooncake error code)."""
        with self._lock:
            if self._closed or not self.breaker.allow():
                self.counters["remote.refused"] += 1
                raise RemoteUnavailable("refused (the store is unavailable; retried after a backoff)")
            self.counters["remote.calls"] += 1
        fut: Future[Any] = Future()
        self._jobs.put((fut, name, args))
        try:
            result = fut.result(timeout=self.timeout_s)
            good = ok is None or ok(result)
        except FutureTimeout:
            self._fail("remote.timeouts", name, "timed out")
            raise RemoteUnavailable(f"{name} timed out after {self.timeout_s}s") from None
        except Exception as e:
            self._fail("remote.failures", name, repr(e))
            raise RemoteUnavailable(f"{name} failed: {e!r}") from None
        if not good:
            self._fail("remote.failures", name, f"returned {result!r}"[:80])
            raise RemoteUnavailable(f"{name} failed (returned {result!r})"[:120])
        with self._lock:
            self.breaker.success()
        return result

    def _fail(self, counter: str, name: str, why: str) -> None:
        with self._lock:
            self.counters[counter] += 1
            opened = self.breaker.failure()
            if opened:
                self.counters["remote.breaker_opens"] += 1
        if opened:
            log.warning(
                "remote.unavailable", url=self.url, call=name, why=why, backoff_s=self.breaker.backoff
            )

    # ------------------------------------------------------------------ I/O thread
    def _connect(self) -> Connection:
        """The pipe to a live client process, starting one (and its set-up) if there is none."""
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn
        self._stop_proc()
        mine, theirs = socket.socketpair()
        with mine, theirs:
            cmd = [
                sys.executable,
                "-m",
                "deltaserve.cache.remote_proc",
                str(theirs.fileno()),
                json.dumps(self._setup),
            ]
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            parent = Connection(os.dup(mine.fileno()))
        self._proc, self._conn = proc, parent
        with self._lock:
            self.counters["remote.connects"] += 1
        rc = parent.recv()  # (EOFError if it died: a failed call)
        if rc != 0:
            self._stop_proc()
            raise RuntimeError(f"the Mooncake master at {self.url} refused the client (setup returned {rc})")
        return parent

    def _stop_proc(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                proc.kill()  # (closing against a dead master takes seconds: not waited for)
                proc.wait()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._stop_proc()
                return
            fut, name, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                conn = self._connect()
                if not name:  # the connect job
                    fut.set_result(None)
                    continue
                conn.send((name, args))
                good, result = conn.recv()
                if not good:
                    raise RuntimeError(result)
                fut.set_result(result)
            except BaseException as e:
                if isinstance(e, (EOFError, OSError)):
                    self._stop_proc()  # dead or broken: the next call starts a new one
                fut.set_exception(e)

    @property
    def available(self) -> bool:
        """The breaker lets calls through now."""
        with self._lock:
            return not self._closed and self.breaker.allow()

    def close(self, wait_s: float = 2.0) -> None:
        """Refuse further calls; the I/O thread stops the client process after the call in
        flight (waited for at most ``wait_s``: a call stuck on a dead master is left)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=wait_s)
        if self._thread.is_alive():  # stuck in a call: end the process, which ends the call
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
