"""The remote tier's client process (started by ``cache/remote_client.MooncakeClient``).

``python -m deltaserve.cache.remote_proc FD SETUP_JSON``: one ``MooncakeDistributedStore``
set up with ``SETUP_JSON`` (its ``setup`` arguments), serving ``(name, args)`` calls read from
the ``multiprocessing`` connection on file descriptor ``FD``; each answer is ``(True, result)``
or ``(False, repr(exception))``. The first message sent is ``setup``'s return code; on EOF
or ``None`` the process closes the store and exits. Mooncake's calls hold the GIL while they
wait on the network: in a process of their own they never stall the engine's threads.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection, setup: tuple[Any, ...]) -> None:
    """The client process: one ``MooncakeDistributedStore`` serving calls from the pipe.
    (Mooncake's calls hold the GIL while they wait on the network: in a process of their
    own they never stall the engine's threads.)"""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(*setup)
    try:
        conn.send(rc)
    except OSError:  # the parent is gone: nothing to serve
        if rc == 0:
            store.close()
        os._exit(0)
    while rc == 0:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        name, args = msg
        try:
            answer = (True, getattr(store, name)(*args))
        except Exception as e:  # sent back: the parent counts it as a failed call
            answer = (False, repr(e))
        try:
            conn.send(answer)
        except OSError:  # the parent is gone (or gave up on this pipe)
            break
    if rc == 0:
        store.close()  # unmounts this client's segment (the parent does not wait for it)
    os._exit(0)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), tuple(json.loads(sys.argv[2])))
