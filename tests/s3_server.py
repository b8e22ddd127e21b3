"""A real S3 endpoint for tests: moto's server in a subprocess on 127.0.0.1.

A server rather than moto's in-process mock, so that subprocesses (the upload stage, dvc) talk to
the same store over HTTP exactly as they would to MinIO or AWS.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEST_ACCESS_KEY = "testing-access-key"
TEST_SECRET_KEY = "testing-secret-key"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class MotoServer:
    endpoint_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def client(self, access_key: str = TEST_ACCESS_KEY, secret_key: str = TEST_SECRET_KEY) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(s3={"addressing_style": "path"}),
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait_until_up(server: MotoServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"moto server exited early; log: {server.log_path.read_text()}")
        try:
            urllib.request.urlopen(server.endpoint_url + "/moto-api/", timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer means it is serving
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"moto server did not start within {timeout_s}s")


def start_moto_server(
    log_dir: Path, extra_env: dict[str, str] | None = None, timeout_s: float = 30
) -> MotoServer:
    """extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"} makes the server check credentials, so
    unknown access keys are refused as AWS would refuse them."""
    port = free_port()
    log_path = log_dir / f"moto-{port}.log"
    env = {**os.environ, **(extra_env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = MotoServer(f"http://127.0.0.1:{port}", process, log_path)
    _wait_until_up(server, timeout_s)
    return server
