"""ReaderPool: the disk tier's reads, on a few daemon threads that nobody waits for.

``concurrent.futures.ThreadPoolExecutor`` joins its workers at interpreter exit, so one read
stuck in the kernel (a stalled network filesystem) would hang the process's exit as well
as every read queued behind it. This pool differs in what matters for that:

* its threads are daemons and are never joined unless ``shutdown(wait=True)`` asks: a stuck
  read costs its thread, not the process's exit;
* at most ``READER_THREADS`` threads (started on demand) serve one queue, so a stuck read
  holds one of them while the others go on (the tier gives the stuck fetch up at its
  deadline: ``cache/disk_tier.py``);
* ``shutdown(cancel_futures=True)`` cancels what has not started; without it, what is queued
  still runs (then the threads end).

Contract: an ``Executor`` (``submit`` returns a ``Future``; after ``shutdown`` it raises
``RuntimeError``). A task's exception is set on its future, never raised in the thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

# enough that one or two stuck reads leave others flowing, few enough that a stalled
# filesystem cannot take more than this many threads
READER_THREADS = 4

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class ReaderPool(Executor):
    """A pool of daemon threads over one FIFO queue (module docstring); a thread is started
    when a task finds none free, up to ``threads``."""

    def __init__(self, threads: int = READER_THREADS, name: str = "deltaserve-disk-read") -> None:
        if threads <= 0:
            raise ValueError(f"threads must be > 0, got {threads}")
        self._max, self._name = threads, name
        self._cond = threading.Condition()
        self._tasks: deque[_Task] = deque()
        self._threads: list[threading.Thread] = []
        self._free = 0  # threads not running a task (each takes the next one queued)
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot submit to a ReaderPool after shutdown")
            self._tasks.append((future, fn, args, kwargs))
            if self._free < len(self._tasks) and len(self._threads) < self._max:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                self._free += 1
                t.start()
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._tasks:
                    self._tasks.popleft()[0].cancel()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                t.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._shutdown:
                    self._cond.wait()
                if not self._tasks:  # shut down and drained
                    self._free -= 1
                    return
                future, fn, args, kwargs = self._tasks.popleft()
                self._free -= 1
            if future.set_running_or_notify_cancel():  # (False: cancelled while queued)
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # set on the future: seen where it is collected
                    future.set_exception(e)
                else:
                    future.set_result(result)
            with self._cond:
                self._free += 1
