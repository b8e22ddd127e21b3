"""`vlmrl serve` on a GGUF folder pulled from a real (moto) S3 store: llama-cpp-python's OpenAI
server on 127.0.0.1 answers one chat request with an image and one without, greedily, with the
same text the in-process llama.cpp gives for the image turn. On a text model's folder it takes
OpenAI content parts and refuses an image with HTTP 400; stopped by its process id, it leaves no
server behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT, stop_process
from leftover_processes import descendants
from s3_server import free_port, start_moto_server

from vlmrl import publish as pub
from vlmrl.export.gguf_release import write_gguf_consumer_files
from vlmrl.export.gguf import convert_hf_to_gguf, image_chat, image_data_url
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.serve.command import ServeError, serve_command

QUESTION = "What number is shown?"
MAX_TOKENS = 3


def test_imports_nothing_it_cannot_find() -> None:
    from vlmrl.serve.command import check_server_installed

    check_server_installed()  # the gguf extra brings llama-cpp-python[server]


@pytest.fixture(scope="module")
def pulled_gguf(tmp_path_factory) -> Iterator[Path]:
    """The embedded model's f16 GGUF and projector, published to moto and pulled back."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = ensure_embedded_model("embedded:tiny-qwen3-vl")
    folder = root / "release/gguf"
    folder.mkdir(parents=True)
    convert_hf_to_gguf(model_dir, folder / "model-f16.gguf", "f16")
    convert_hf_to_gguf(model_dir, folder / "mmproj-f16.gguf", "f16", mmproj=True)
    names = {"f16": "model-f16.gguf", "mmproj": "mmproj-f16.gguf"}
    write_gguf_consumer_files(folder, names, "tiny", "You solve maths.", {})
    (root / "moto").mkdir()
    server = start_moto_server(root / "moto")
    try:
        client = server.client()
        client.create_bucket(Bucket="serve")
        params = pub.UploadParams(bucket="serve", prefix="t", endpoint_url=server.endpoint_url,
                                  version="v1")
        pub.publish({"gguf": folder}, params, params_digest="0" * 64, repo_dir=root,
                    client=client)
        location = pub.S3Location("serve", "t", server.endpoint_url)
        pub.pull(client, location, "latest", ["gguf"], root / "pulled")
    finally:
        server.stop()
    yield root / "pulled"


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def wait_until_up(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vlmrl serve exited early: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise RuntimeError(f"vlmrl serve did not answer within {timeout_s}s: {log.read_text()}")


def start_serve(folder: Path, port: int, log: Path) -> subprocess.Popen:
    """`vlmrl serve` as a user starts it, its output in `log`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "vlmrl.cli", "serve", "--gguf", str(folder), "--port",
             str(port), "--n-ctx", "2048"], stdout=handle, stderr=subprocess.STDOUT, env=env)


@contextmanager
def serving(folder: Path, log_dir: Path) -> Iterator[str]:
    """The API base URL of `vlmrl serve` on `folder` while it runs; stopped afterwards."""
    port = free_port()
    process = start_serve(folder, port, log_dir / "serve.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_up(process, f"{base}/models", log_dir / "serve.log")
        yield base
    finally:
        stop_process(process, 20)


@pytest.fixture(scope="module")
def server_url(pulled_gguf: Path, tmp_path_factory) -> Iterator[str]:
    with serving(pulled_gguf, tmp_path_factory.mktemp("serve-log")) as base:
        yield base


@pytest.fixture(scope="module")
def text_gguf(tmp_path_factory) -> Path:
    """The embedded text model's f16 GGUF: a folder without a projector."""
    folder = tmp_path_factory.mktemp("text-gguf")
    convert_hf_to_gguf(ensure_embedded_model("embedded:tiny-qwen3"), folder / "model-f16.gguf",
                       "f16")
    return folder


@pytest.fixture(scope="module")
def text_server_url(text_gguf: Path, tmp_path_factory) -> Iterator[str]:
    with serving(text_gguf, tmp_path_factory.mktemp("serve-text-log")) as base:
        yield base


@pytest.fixture(scope="module")
def image():
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(picture).text((100, 110), "42", fill="black")
    return picture


def chat(base: str, content) -> dict:
    return post(f"{base}/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "seed": 0})


def test_served_chat_answers_with_and_without_an_image(server_url: str, pulled_gguf: Path,
                                                       image) -> None:
    models = json.loads(urllib.request.urlopen(f"{server_url}/models", timeout=10).read())
    assert models["data"][0]["id"].endswith("model-f16.gguf")

    text_reply = chat(server_url, QUESTION)
    image_reply = chat(server_url, [
        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
        {"type": "text", "text": QUESTION}])

    for reply in (text_reply, image_reply):
        assert reply["object"] == "chat.completion"
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert image_reply["usage"]["prompt_tokens"] > text_reply["usage"]["prompt_tokens"] + 8
    direct = image_chat(pulled_gguf / "model-f16.gguf", pulled_gguf / "mmproj-f16.gguf", image,
                        QUESTION, max_tokens=MAX_TOKENS)
    assert image_reply["choices"][0]["message"]["content"] == direct["text"]


def test_serve_command_uses_the_projector_and_names_a_missing_file(pulled_gguf: Path,
                                                                   tmp_path: Path) -> None:
    command = serve_command(pulled_gguf, port=9000)
    assert command[1:5] == ["-m", "vlmrl.serve.app", "--model",
                            str(pulled_gguf / "model-f16.gguf")]
    assert command[command.index("--clip_model_path") + 1] == str(pulled_gguf / "mmproj-f16.gguf")
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--clip_model_path" not in serve_command(pulled_gguf, projector=False)
    with pytest.raises(ServeError, match="model-Q4_K_M.gguf: no such GGUF file"):
        serve_command(pulled_gguf, file="model-Q4_K_M.gguf")
    with pytest.raises(ServeError, match="no GGUF model file there"):
        serve_command(tmp_path)


def test_text_model_takes_content_parts_and_refuses_an_image(text_server_url: str,
                                                              image) -> None:
    as_text = chat(text_server_url, f"{QUESTION}\nAnswer briefly.")
    as_parts = chat(text_server_url, [{"type": "text", "text": QUESTION},
                                      {"type": "text", "text": "Answer briefly."}])
    assert as_parts["choices"][0]["message"]["content"] == as_text["choices"][0]["message"][
        "content"]
    assert as_parts["usage"] == as_text["usage"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        chat(text_server_url, [{"type": "text", "text": QUESTION},
                               {"type": "image_url", "image_url": {"url": image_data_url(image)}}])
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error["message"].startswith("messages[0].content[1] is an image, but this model is "
                                       "served without a vision projector")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_stopping_serve_by_its_pid_leaves_no_server(text_gguf: Path, tmp_path: Path,
                                                    stop_signal: signal.Signals) -> None:
    """What Prefect, systemd or a test does: signal the `vlmrl serve` process itself. The
    server is that process (exec), so the port is free afterwards and nothing below it runs."""
    port = free_port()
    process = start_serve(text_gguf, port, tmp_path / "serve.log")
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}/v1/models", tmp_path / "serve.log")
        below = descendants(process.pid)
        os.kill(process.pid, stop_signal)
        process.wait(timeout=30)
    finally:
        stop_process(process, 5)
    still_running = [pid for pid in below if alive(pid)]
    for pid in still_running:
        os.kill(pid, signal.SIGKILL)  # stopped here, so the failure below is the only trace
    assert still_running == [], "processes of vlmrl serve outlived it"
    assert port_is_free(port)
