"""A real redis-server (Debian's package: `make test` installs it as root with apt-get, its `redis` target) on a
free loopback port, started and stopped by the tests."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from kvrag.lab.bench.storage import start_redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("CI"):
                pytest.fail("redis-server is not installed: `make test` installs Debian's as root (make redis)")
            pytest.skip("redis-server is not installed (`make redis` as root, or apt-get install redis-server)")
        self.password = password
        started = start_redis(port, password)
        if started is None:
            pytest.fail("redis-server did not start")
        self.proc, self.port = started

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
