"""``deltaserve serve --api-server-count N``: N front-end processes around one engine core process.

The supervisor (this module's ``serve_front_ends``, in the ``deltaserve serve`` process) starts
the core (``engine/core_proc.py``), waits until it is ready, binds the listening socket once
and starts N front ends (``python -m deltaserve.server.front_ends``), each serving HTTP on
that inherited socket (the kernel hands each connection to one of the processes accepting on
it: one accept queue, and ``--port 0`` works) with an ``EngineProcClient`` joined to the core.

Faults and signals: SIGINT / SIGTERM are passed on to the front ends, which drain; when they
have exited the supervisor shuts the core down and exits 0. A front end that dies is logged
and not replaced: the core aborts its requests, the others go on. The core dying ends every
front end (each exits 1, ``CORE_DIED_EXIT``), and so the supervisor, with 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core_proc import CoreHandle, start_core
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.messages import CoreMessage, Hello, Ready, Shutdown, StartFailed
from deltaserve.logs import get_logger
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


def start_front_end(engine_config: EngineConfig, server_config: ServerConfig, address: str, fd: int) -> Any:
    """One front-end process serving on the inherited listening socket ``fd``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.server.front_ends", address, str(fd)],
        stdin=subprocess.PIPE,
        pass_fds=[fd],
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode({"engine": engine_config.to_dict(), "server": server_config}))
    proc.stdin.close()
    return proc


def serve_front_ends(
    engine_config: EngineConfig, server_config: ServerConfig, count: int, out: Any = None
) -> int:
    """Run the core and ``count`` front ends until a signal (module docstring); the exit code."""
    from deltaserve.server.cli import CORE_DIED_EXIT, bind_socket

    out = out or sys.stdout
    handle = start_core(engine_config)
    link = CoreLink(handle)
    try:
        ready = link.wait_ready()
    except BaseException:
        link.shutdown(timeout_s=0.0)
        raise
    sock = bind_socket(server_config.host, server_config.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    front = [
        start_front_end(engine_config, server_config, handle.address, sock.fileno()) for _ in range(count)
    ]
    print(
        f"deltaserve: serving {ready.model_info.name} at http://{shown}:{port}/v1 (OpenAI-compatible; "
        f"{count} front ends, engine core pid {handle.pid})",
        file=out,
        flush=True,
    )
    signals: list[int] = []
    previous = {
        s: signal.signal(s, lambda sig, _frame: signals.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    code = 0
    try:
        code = _supervise(handle, front, signals)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
        link.shutdown()
    print("deltaserve: stopped", file=out, flush=True)
    return CORE_DIED_EXIT if code else 0


def _supervise(handle: CoreHandle, front: list[Any], signals: list[int]) -> int:
    """Until every front end has exited: pass signals on, report deaths. Non-zero if the core died."""
    from deltaserve.server.cli import CORE_DIED_EXIT

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
    """A front end's entry point: ADDRESS FD, the configs as JSON on stdin."""
    import asyncio
    import socket

    from deltaserve.engine import install_uvloop
    from deltaserve.logs import configure_logging
    from deltaserve.server.cli import serve

    address, fd = argv[0], int(argv[1])
    data = msgspec.json.decode(sys.stdin.buffer.read())
    engine_config = EngineConfig.from_dict(data["engine"])
    server_config = msgspec.convert(data["server"], ServerConfig)
    configure_logging(engine_config.logging.level.value)
    sock = socket.socket(fileno=fd)
    install_uvloop()
    with open(os.devnull, "w") as quiet:  # the supervisor prints the URL once
        return asyncio.run(serve(engine_config, server_config, out=quiet, sock=sock, address=address))


if __name__ == "__main__":
    sys.exit(run_front_end(sys.argv[1:]))
