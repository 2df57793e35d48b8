"""A real Mooncake Store master for the remote-tier tests: started in a subprocess on a free
127.0.0.1 port, stopped in the test. Tests that need it skip only when the ``mooncake``
package cannot be imported or its master cannot start, with that reason."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from deltaserve.cache.remote_client import mooncake_import_error
from deltaserve.cache.remote_master import free_port, master_binary, start_master, wait_listening


@dataclass
class Master:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)  # a master that stops answering

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


def require_mooncake() -> None:
    why = mooncake_import_error()
    if why is not None:
        pytest.skip(f"the remote tier needs mooncake (pip install -e '.[remote]'; libibverbs1): {why}")
    if master_binary() is None:
        pytest.skip("the remote tier needs mooncake_master (pip install -e '.[remote]')")


def run_master() -> Iterator[Master]:
    require_mooncake()
    port = free_port()
    proc = start_master(port)
    try:
        if not wait_listening(proc, "127.0.0.1", port):
            pytest.skip(f"mooncake_master did not start (exit code {proc.poll()})")
        yield Master(proc, port)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def master() -> Iterator[Master]:
    yield from run_master()
