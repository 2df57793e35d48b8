"""``deltaserve store``: a Mooncake Store for the remote cache tier, as ``ray start`` is for Ray.

    deltaserve store [--host 0.0.0.0] [--port 50051] [--segment-bytes 1GiB]

Starts ``mooncake_master`` on ``HOST:PORT`` (``cache/remote_master.py``) and, once it listens,
a client that lends the store ``--segment-bytes`` of this process's memory (objects live in
the memory clients lend: with this one the store's contents outlive the engines that wrote
them; ``0`` lends none). Prints on stderr where engines point ``--remote-cache`` /
``cache.remote`` (``mooncake://ADDRESS:PORT``), then waits. SIGINT / SIGTERM stop the client
and the master and exit 0; a master that exits by itself exits 1, a master that does not
start exits 1, the ``mooncake`` package missing exits 2 (each one line on stderr).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from types import FrameType

from deltaserve.cache.remote_client import MooncakeClient, local_address, mooncake_import_error
from deltaserve.cache.remote_master import start_master, wait_listening
from deltaserve.engine.byte_size import parse_bytes
from deltaserve.engine.errors import ConfigError

DEFAULT_PORT = 50051


def add_store_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "store",
        help="run a Mooncake Store master for the remote cache tier (cache.remote)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0", help="address the master listens on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="the master's RPC port (default %(default)s)"
    )
    p.add_argument(
        "--segment-bytes", default="1GiB", metavar="B",
        help="memory this process lends the store (bytes or 1GiB; 0: none, the engines' only; default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--advertise", default=None, metavar="ADDRESS",
        help="the address engines on other machines reach this one at (default: --host, or this "
        "machine's address on its default route when --host is 0.0.0.0)",
    )  # fmt: skip


def _err(msg: str) -> None:
    print(f"deltaserve store: {msg}", file=sys.stderr, flush=True)


def store_main(args: argparse.Namespace) -> int:
    why = mooncake_import_error()
    if why is not None:
        _err(f"error: the mooncake package cannot be imported (pip install -e '.[remote]'): {why}")
        return 2
    try:
        segment = parse_bytes(args.segment_bytes, "--segment-bytes")
    except ConfigError as e:
        _err(f"error: {e}")
        return 2
    if not 0 < args.port < 65536:
        _err(f"error: --port = {args.port}: not a port (1..65535)")
        return 2
    wildcard = args.host in ("0.0.0.0", "::", "")
    address = args.advertise or (local_address("10.255.255.255", 1) if wildcard else args.host)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        master = start_master(args.port, args.host, log=None)  # its log lines go to our stderr
    except FileNotFoundError as e:
        _err(f"error: {e}")
        return 2
    client: MooncakeClient | None = None
    try:
        probe = "127.0.0.1" if wildcard else args.host
        if not wait_listening(master, probe, args.port):
            _err(
                f"error: mooncake_master did not start on {args.host}:{args.port} (exit code {master.poll()})"
            )
            return 1
        url = f"mooncake://{address}:{args.port}"
        if segment:
            client = MooncakeClient(
                f"mooncake://{probe}:{args.port}", segment_bytes=segment, buffer_bytes=16 << 20,
                timeout_s=30.0, local_hostname=address,
            )  # fmt: skip
            if not client.wait_ready(60.0):
                _err("error: could not lend the store memory (the client did not join the master)")
                return 1
        _err(f"Mooncake Store master listening on {args.host}:{args.port}; engines: --remote-cache {url}")
        _err(f"lending {segment} bytes; stop with Ctrl-C or SIGTERM")
        while not stop.wait(0.5):
            if master.poll() is not None:
                _err(f"error: mooncake_master exited (code {master.returncode})")
                return 1
        _err("stopping")
        return 0
    finally:
        if client is not None:
            client.close()
        if master.poll() is None:
            master.terminate()
            try:
                master.wait(timeout=10)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
