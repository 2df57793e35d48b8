"""``deltaserve serve --api-server-count N``: N front-end processes around one engine core process.

The supervisor (this module's ``serve_front_ends``, in the ``deltaserve serve`` process) starts
the core (``engine/core/core_proc.py``), waits until it is ready, takes the port and starts N front
ends (``python -m deltaserve.server.front_ends``), each serving HTTP with an ``AsyncEngine`` over
a ``ProcCoreClient`` joined to the core, and prints the URL once every front end listens.

Connections: on Linux the supervisor binds ``host:port`` with ``SO_REUSEPORT`` without
listening (so ``--port 0`` picks the port once) and each front end binds and listens on its own
``SO_REUSEPORT`` socket on that port: the kernel spreads new connections over the front ends'
accept queues by a hash of the client's address and port (one shared listening socket gives
each connection to whichever front end accepts first: on one machine every connection went to
one of two; docs/server.md has the split measured). Elsewhere the front ends accept on one
inherited listening socket. Each response carries ``x-deltaserve-frontend: <1..N>``; the
supervisor logs each front end's number and pid.

Faults and signals: SIGINT / SIGTERM are passed on to the front ends, which drain; when they
have exited the supervisor shuts the core down and exits 0. A front end that dies is logged
and not replaced: the core aborts its requests, the others go on. The core dying ends every
front end (each exits 1, ``CORE_DIED_EXIT``), and so the supervisor, with 1.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.core_proc import CoreHandle, start_core
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.messages import CoreMessage, Hello, Ready, Shutdown, StartFailed
from deltaserve.logs import get_logger
from deltaserve.server.cli_flags import warn_open_host
from deltaserve.server.config import ServerConfig

log = get_logger("deltaserve.server")

#: how often the supervisor looks at its processes
POLL_S = 0.2


class CoreLink:
    """The supervisor's own connection to the core: the hello that waits for it to be ready, and
    the ``Shutdown`` at the end (the supervisor owns the core)."""

    def __init__(self, handle: CoreHandle) -> None:
        import zmq

        self.handle = handle
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(handle.address)

    def wait_ready(self, timeout_s: float = 600.0) -> Ready:
        self.sock.send(msgspec.msgpack.encode(Hello(os.getpid(), True)))
        deadline = time.monotonic() + timeout_s
        while not self.sock.poll(100):
            if not self.handle.alive():
                raise RuntimeError(
                    f"the engine core process exited with code {self.handle.exitcode} at start"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not answer within {timeout_s:.0f} s")
        msg = msgspec.msgpack.decode(self.sock.recv(), type=CoreMessage)
        if isinstance(msg, StartFailed):
            if msg.kind == "ConfigError":
                raise ConfigError(msg.message)
            raise RuntimeError(f"the engine core failed to start: {msg.kind}: {msg.message}")
        assert isinstance(msg, Ready)
        return msg

    def shutdown(self, timeout_s: float = 60.0) -> None:
        if self.handle.alive():
            self.sock.send(msgspec.msgpack.encode(Shutdown()))
            self.handle.join(timeout_s)
        if self.handle.alive():
            log.error("front_ends.core_kill", pid=self.handle.pid)
            self.handle.kill()
            self.handle.join(5.0)
        self.sock.close(linger=0)
        self.ctx.term()


#: the header each front end adds to its responses: its number, 1..N (the supervisor logs the
#: pid of each), so a client or a test can see which one served a connection
FRONT_END_HEADER = "x-deltaserve-frontend"
#: Linux spreads the connections of a port over the sockets bound to it with SO_REUSEPORT (a
#: hash of the client's address and port); elsewhere SO_REUSEPORT does not balance, and the front
#: ends accept on one inherited listening socket instead
REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
#: how long the supervisor waits for a front end to listen (it has only imported and bound)
LISTEN_TIMEOUT_S = 120.0


class FrontEndHeader:
    """ASGI middleware: ``FRONT_END_HEADER: <number>`` on every response."""

    def __init__(self, app: Any, number: int) -> None:
        self.app = app
        self.header = (FRONT_END_HEADER.encode(), str(number).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_tagged)


def start_front_end(
    engine_config: EngineConfig, server_config: ServerConfig, address: str, listen: str, number: int
) -> tuple[Any, int]:
    """Front end ``number``, serving on ``listen`` (``port:P``: its own ``SO_REUSEPORT`` socket
    on ``server_config.host:P``; ``fd:N``: the inherited listening socket ``N``). Returns the
    process and the read end of the pipe on which it says it listens."""
    ready_r, ready_w = os.pipe()
    fds = [ready_w] + ([int(listen[3:])] if listen.startswith("fd:") else [])
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltaserve.server.front_ends",
                address,
                listen,
                str(ready_w),
                str(number),
            ],
            stdin=subprocess.PIPE,
            pass_fds=fds,
        )
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode({"engine": engine_config.to_dict(), "server": server_config}))
    proc.stdin.close()
    log.info("front_ends.started", front_end=number, pid=proc.pid, listen=listen)
    return proc, ready_r


def wait_listening(front: list[tuple[Any, int]], where: str, timeout_s: float = LISTEN_TIMEOUT_S) -> None:
    """Until every front end has said it listens (closing each pipe); ``OSError`` naming the first
    that exits (or stays silent past ``timeout_s``) before."""
    deadline = time.monotonic() + timeout_s
    pipes = [os.fdopen(ready_r, "rb") for _, ready_r in front]
    try:
        for number, ((proc, _), pipe) in enumerate(zip(front, pipes), 1):
            line = b""
            if select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
                line = pipe.readline()
            if line != b"listening\n":
                proc.poll()
                raise OSError(
                    f"front end {number} (pid {proc.pid}) did not listen on {where} "
                    f"(exit code {proc.returncode})"
                )
    finally:
        for pipe in pipes:
            pipe.close()


def _listening_socket(server_config: ServerConfig) -> tuple[socket.socket, str, int]:
    """The supervisor's socket, what the front ends listen on, and the port. With ``REUSE_PORT``
    the socket is bound with ``SO_REUSEPORT`` but does not listen: it takes the port (``--port
    0`` picks it here) and holds it while each front end binds and listens on its own socket, so
    the kernel spreads new connections over the front ends' accept queues. Without, it listens
    and the front ends inherit it (one accept queue: whichever accepts first takes a connection)."""
    from deltaserve.server.serving import bind_socket

    host, port = server_config.host, server_config.port
    if not REUSE_PORT:
        sock = bind_socket(host, port)
        return sock, f"fd:{sock.fileno()}", sock.getsockname()[1]
    # First a plain bind: "address in use" if anything listens there, a server of this user
    # with SO_REUSEPORT included, which the front ends would otherwise join and share
    # connections with. It stays bound (not listening) until the holder has the port too.
    with bind_socket(host, port, listen=False) as probe:
        port = probe.getsockname()[1]
        sock = bind_socket(host, port, reuse_port=True, listen=False)
    return sock, f"port:{port}", port


def serve_front_ends(
    engine_config: EngineConfig, server_config: ServerConfig, count: int, out: Any = None
) -> int:
    """Run the core and ``count`` front ends until a signal (module docstring); the exit code."""
    from deltaserve.server.serving import CORE_DIED_EXIT

    out = out or sys.stdout
    # the port first: one in use is an OSError here, before the core loads the model
    sock, listen, port = _listening_socket(server_config)
    try:
        handle = start_core(engine_config)
        link = CoreLink(handle)
    except BaseException:
        sock.close()
        raise
    try:
        ready = link.wait_ready()
    except BaseException:
        sock.close()
        link.shutdown(timeout_s=0.0)
        raise
    front: list[tuple[Any, int]] = []
    code = 0
    try:
        host = sock.getsockname()[0]
        config = msgspec.structs.replace(server_config, port=port)
        for number in range(1, count + 1):
            front.append(start_front_end(engine_config, config, handle.address, listen, number))
        shown = f"[{host}]" if ":" in host else host
        wait_listening(front, f"{shown}:{port}")
        warn_open_host(server_config)
        print(
            f"deltaserve: serving {ready.model_info.name} at {server_config.scheme}://{shown}:{port}/v1 (OpenAI-compatible; "
            f"{count} front ends, engine core pid {handle.pid})",
            file=out,
            flush=True,
        )
        signals: list[int] = []
        previous = {
            s: signal.signal(s, lambda sig, _frame: signals.append(sig))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            code = _supervise(handle, [p for p, _ in front], signals)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        for proc, _ in front:  # still running only when the start failed
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sock.close()
        link.shutdown()
    print("deltaserve: stopped", file=out, flush=True)
    return CORE_DIED_EXIT if code else 0


def _supervise(handle: CoreHandle, front: list[Any], signals: list[int]) -> int:
    """Until every front end has exited: pass signals on, report deaths. Non-zero if the core died."""
    from deltaserve.server.serving import CORE_DIED_EXIT

    passed = 0
    core_died = False
    reported: set[int] = set()
    while any(p.poll() is None for p in front):
        time.sleep(POLL_S)
        while passed < len(signals):  # the first drains the front ends, a second forces them
            for p in front:
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)
            passed += 1
        if not core_died and not handle.alive():
            core_died = True
            log.error("front_ends.core_died", pid=handle.pid, exit_code=handle.exitcode)
        for p in front:
            if p.poll() is not None and p.pid not in reported:
                reported.add(p.pid)
                if p.returncode not in (0, CORE_DIED_EXIT) or (p.returncode and not core_died):
                    log.warning("front_ends.front_end_exited", pid=p.pid, exit_code=p.returncode)
    return CORE_DIED_EXIT if core_died else 0


def run_front_end(argv: list[str]) -> int:
    """A front end's entry point: ADDRESS LISTEN READY_FD NUMBER (``start_front_end``), the
    configs as JSON on stdin. It listens first, says so on READY_FD, then joins the core."""
    import asyncio

    from deltaserve.engine import install_uvloop
    from deltaserve.logs import configure_logging
    from deltaserve.server.serving import bind_socket, serve

    address, listen, ready_fd, number = argv[0], argv[1], int(argv[2]), int(argv[3])
    data = msgspec.json.decode(sys.stdin.buffer.read())
    engine_config = EngineConfig.from_dict(data["engine"])
    server_config = msgspec.convert(data["server"], ServerConfig)
    configure_logging(engine_config.logging.level.value)
    kind, _, value = listen.partition(":")
    if kind == "fd":
        sock = socket.socket(fileno=int(value))
    else:
        sock = bind_socket(server_config.host, int(value), reuse_port=True)
    os.write(ready_fd, b"listening\n")
    os.close(ready_fd)
    install_uvloop()

    def tag(app: Any) -> None:
        app.add_middleware(FrontEndHeader, number=number)

    with open(os.devnull, "w") as quiet:  # the supervisor prints the URL once
        return asyncio.run(
            serve(engine_config, server_config, out=quiet, sock=sock, address=address, app_hook=tag)
        )


if __name__ == "__main__":
    sys.exit(run_front_end(sys.argv[1:]))
