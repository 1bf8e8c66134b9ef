"""A real ``mooncake_master`` for the tests that need the Mooncake Store (the storage tier's mooncake
backend, alone and under TP ranks): what is installed, a master on free 127.0.0.1 ports, and a
backend on it. The fixtures ``master_binary`` and ``master`` (tests/conftest.py) build on these."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

HANG_S = 60.0  # a call that has not returned by then is hung


# -- what is installed ----------------------------------------------------------------------------------
def client_missing() -> str | None:
    """Why the Mooncake Store client cannot be used here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError from a missing libibverbs
        from hicache.storage.mooncake import install_hint

        return f"the Mooncake Store client does not import ({e}); {install_hint()}"
    return None


def master_binary_path() -> str | None:
    env = os.environ.get("HICACHE_MOONCAKE_MASTER")
    if env:
        return env
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "mooncake_master"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("mooncake_master")


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Master:
    """A ``mooncake_master`` subprocess on free 127.0.0.1 ports, with its embedded HTTP metadata server."""

    def __init__(self, binary: str, log_path: Path) -> None:
        self.binary, self.log_path = binary, log_path
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = HANG_S) -> Master:
        args = [self.binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--logtostderr"]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not (listening(self.rpc_port) and listening(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"mooncake_master did not start on 127.0.0.1:{self.rpc_port}:\n{tail}")
            time.sleep(0.05)
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen master must run to die of SIGKILL's wait
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)
        self.proc = None


def make_backend(address: str, **kw):
    from hicache.storage.mooncake import MooncakeBackend

    kw = {"metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", "global_segment_size": 64 << 20,
          "local_buffer_size": 16 << 20, **kw}  # fmt: skip
    return MooncakeBackend(address, **kw)
