"""A hub id is checked in one request before anything loads it (vlmrl.hub): a typo, an
unreachable hub and a hub switched off each give one line at once. The hub is a local HTTP
server (or a closed port) that huggingface_hub is pointed at with HF_ENDPOINT, which it reads
when imported, so each case runs in a process of its own."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from s3_server import free_port

from vlmrl.pipeline.dvc_env import dvc_env

CHECK = ("import sys; from vlmrl.hub import check_hub_dataset, check_hub_model; "
         "check = check_hub_model if sys.argv[1] == 'model' else check_hub_dataset; "
         "check(sys.argv[2])")


class NotFoundHub(http.server.BaseHTTPRequestHandler):
    """The hub's answer to an id it has no repo for."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def not_found_hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFoundHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def check(kind: str, repo_id: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", CHECK, kind, repo_id], capture_output=True,
                            text=True, env={**dvc_env(), **env}, timeout=120, check=False)
    return result, time.monotonic() - started


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_mistyped_model_id_is_named_at_once(not_found_hub: str, tmp_path) -> None:
    result, seconds = check("model", "Qwen/Qwen3-VL-2B-Instrukt", HF_ENDPOINT=not_found_hub,
                            HF_HOME=str(tmp_path))
    assert result.returncode != 0 and seconds < 30
    assert last_line(result) == (
        "vlmrl.errors.ParamsError: params.yaml model.name: no model 'Qwen/Qwen3-VL-2B-Instrukt' "
        "on the Hugging Face hub (a typo? a private one needs `hf auth login`)")


@pytest.mark.parametrize("kind", ["model", "dataset"])
def test_an_unreachable_hub_fails_at_once_without_retries(kind: str, tmp_path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    result, seconds = check(kind, "openai/gsm8k", HF_ENDPOINT=closed, HF_HOME=str(tmp_path))
    key = "model.name" if kind == "model" else "data.source"
    assert result.returncode != 0 and seconds < 30
    line = last_line(result)
    assert line.startswith(f"vlmrl.errors.ParamsError: params.yaml {key}: the Hugging Face hub "
                           "cannot be reached (")
    assert line.endswith("and set HF_HUB_OFFLINE=1, or name a local folder")


def test_an_offline_hub_without_the_model_in_the_cache_says_what_to_do(tmp_path) -> None:
    result, _ = check("model", "Qwen/Qwen3-VL-2B-Instruct", HF_HUB_OFFLINE="1",
                      HF_HOME=str(tmp_path))
    assert last_line(result) == (
        "vlmrl.errors.ParamsError: params.yaml model.name: model 'Qwen/Qwen3-VL-2B-Instruct' is "
        "not in the local Hugging Face cache and the hub is off (HF_HUB_OFFLINE): download it "
        "where the hub is reachable (`hf download Qwen/Qwen3-VL-2B-Instruct`) and set "
        "HF_HUB_OFFLINE=1, or name a local folder")


def test_a_model_in_the_local_cache_needs_no_hub(tmp_path) -> None:
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    refs = tmp_path / "hub" / "models--org--cached" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    result, _ = check("model", "org/cached", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    assert result.returncode == 0, result.stderr
