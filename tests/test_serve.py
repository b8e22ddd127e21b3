"""`vlmrl serve` on a GGUF folder pulled from a real (moto) S3 store: llama-cpp-python's OpenAI
server on 127.0.0.1, under the release's model name, answers one chat request with an image and
one without, greedily, with the same text the in-process llama.cpp gives for the image turn, and
prints one line, once it is ready (all of llama.cpp's with --verbose). On a text model's folder it
takes OpenAI content parts and refuses an image with HTTP 400; stopped by its process id, it
leaves no server behind. The folder README's commands run as written."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, stop_process
from leftover_processes import descendants
from s3_server import free_port, start_moto_server

from vlmrl import publish as pub
from vlmrl.export.gguf import convert_hf_to_gguf
from vlmrl.export.gguf_release import write_gguf_consumer_files
from vlmrl.export.llama_runtime import image_chat, image_data_url
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.portable import gguf_metadata
from vlmrl.serve.command import ServeError, parse_args, serve_command

QUESTION = "What number is shown?"
MAX_TOKENS = 3
RELEASE_NAME = "tiny-qwen3-vl-gspo"  # what export writes as general.name
TEXT_ALIAS = "tiny-text"


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
    metadata = root / "metadata.json"
    metadata.write_text(json.dumps(gguf_metadata("embedded:tiny-qwen3-vl")))
    convert_hf_to_gguf(model_dir, folder / "model-f16.gguf", "f16", metadata=metadata)
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


def src_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def start_serve(folder: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """`vlmrl serve` as a user starts it, its output in `log`."""
    with log.open("w") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "vlmrl.cli", "serve", "--gguf", str(folder), "--port",
             str(port), "--n-ctx", "2048", *flags], stdout=handle, stderr=subprocess.STDOUT,
            env=src_env())


@dataclass(frozen=True)
class Served:
    base: str  # the API's base URL
    log: Path  # what `vlmrl serve` printed


@contextmanager
def serving(folder: Path, log_dir: Path, *flags: str) -> Iterator[Served]:
    """`vlmrl serve` on `folder` while it runs; stopped afterwards."""
    port = free_port()
    process = start_serve(folder, port, log_dir / "serve.log", *flags)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_up(process, f"{base}/models", log_dir / "serve.log")
        yield Served(base, log_dir / "serve.log")
    finally:
        stop_process(process, 20)


@pytest.fixture(scope="module")
def served(pulled_gguf: Path, tmp_path_factory) -> Iterator[Served]:
    with serving(pulled_gguf, tmp_path_factory.mktemp("serve-log")) as server:
        yield server


@pytest.fixture(scope="module")
def text_gguf(tmp_path_factory) -> Path:
    """The embedded text model's f16 GGUF: a folder without a projector."""
    folder = tmp_path_factory.mktemp("text-gguf")
    convert_hf_to_gguf(ensure_embedded_model("embedded:tiny-qwen3"), folder / "model-f16.gguf",
                       "f16")
    return folder


@pytest.fixture(scope="module")
def text_served(text_gguf: Path, tmp_path_factory) -> Iterator[Served]:
    """The text model's folder served with --verbose and a model id of the user's choosing."""
    with serving(text_gguf, tmp_path_factory.mktemp("serve-text-log"), "--verbose",
                 "--alias", TEXT_ALIAS) as server:
        yield server


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


def model_ids(base: str) -> list[str]:
    with urllib.request.urlopen(f"{base}/models", timeout=10) as response:
        return [model["id"] for model in json.loads(response.read())["data"]]


def test_served_chat_answers_with_and_without_an_image(served: Served, pulled_gguf: Path,
                                                       image) -> None:
    server_url = served.base
    assert model_ids(server_url) == [RELEASE_NAME]  # the GGUF's general.name, not its path

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
    # quiet: no model metadata, no image-slice or request logs, one line once it answers
    ready = (f"vlmrl serve: ready on {server_url} (OpenAI chat API), model id "
             f"{RELEASE_NAME!r}; Ctrl-C stops it")
    assert served.log.read_text().splitlines() == [ready]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_serve_command_uses_the_projector_and_names_a_missing_file(pulled_gguf: Path,
                                                                   tmp_path: Path) -> None:
    command = serve_command(pulled_gguf, port=9000)
    assert command[1:5] == ["-m", "vlmrl.serve.app", "--model",
                            str(pulled_gguf / "model-f16.gguf")]
    assert option(command, "--clip_model_path") == str(pulled_gguf / "mmproj-f16.gguf")
    assert option(command, "--host") == "127.0.0.1"
    assert (option(command, "--model_alias"), option(command, "--verbose")) == (RELEASE_NAME,
                                                                                "False")
    verbose = serve_command(pulled_gguf, alias="mine", verbose=True)
    assert (option(verbose, "--model_alias"), option(verbose, "--verbose")) == ("mine", "True")
    assert "--clip_model_path" not in serve_command(pulled_gguf, projector=False)
    with pytest.raises(ServeError, match="model-Q4_K_M.gguf: no such GGUF file"):
        serve_command(pulled_gguf, file="model-Q4_K_M.gguf")
    with pytest.raises(ServeError, match="no GGUF model file there"):
        serve_command(tmp_path)
    cut = tmp_path / "model-f16.gguf"
    cut.write_bytes((pulled_gguf / "model-f16.gguf").read_bytes()[:4096])
    with pytest.raises(ServeError, match=f"^{cut}: llama.cpp cannot read this GGUF file"):
        serve_command(tmp_path)


def test_verbose_serve_shows_llama_cpp_logs_under_the_alias_given(text_served: Served) -> None:
    assert model_ids(text_served.base) == [TEXT_ALIAS]
    log = text_served.log.read_text()
    assert "llama_model_loader: - kv" in log and "general.name" in log  # the model metadata
    assert "Uvicorn running on" in log
    assert (f"vlmrl serve: ready on {text_served.base} (OpenAI chat API), model id "
            f"{TEXT_ALIAS!r}") in log


def test_text_model_takes_content_parts_and_refuses_an_image(text_served: Served,
                                                              image) -> None:
    text_server_url = text_served.base
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


def test_a_file_llama_cpp_cannot_load_is_one_line_naming_it(text_gguf: Path,
                                                             tmp_path: Path) -> None:
    """Refused by `vlmrl serve` as it reads the model's name, or, with --alias, by the server as
    it loads the model: either way one line and exit status 1, no traceback."""
    cut = tmp_path / "model-f16.gguf"
    data = (text_gguf / "model-f16.gguf").read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    for flags, why in (((), "cannot read this GGUF file (error loading model: tensor '"),
                       (("--alias", "x"), "cannot load it (Failed to load model from file")):
        result = subprocess.run(
            [sys.executable, "-m", "vlmrl.cli", "serve", "--gguf", str(tmp_path), "--port",
             str(free_port()), *flags], capture_output=True, text=True, env=src_env(),
            timeout=120, check=False)
        lines = (result.stdout + result.stderr).splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stdout + result.stderr
        assert lines[0].startswith(f"serve failed: {cut}: llama.cpp {why}"), lines


def readme_commands(folder: Path) -> dict[str, str]:
    """The GGUF folder README's shell lines, by program, continuation lines joined and the
    comments left off."""
    readme = (folder / "README.md").read_text()
    block = readme.split("## Run it\n\n```sh\n", 1)[1].split("```", 1)[0]
    lines = [line.split("   # ")[0] for line in block.replace("\\\n", "").splitlines()]
    return {shlex.split(line)[0]: line for line in lines}


def test_readme_commands_run_with_what_the_install_provides(pulled_gguf: Path,
                                                           tmp_path: Path) -> None:
    """The released folder's README runs as written: llama-cpp-python's own server on the files,
    asked by its curl line; `vlmrl serve`'s line names this folder's files; Ollama's Modelfile
    names files beside it."""
    commands = readme_commands(pulled_gguf)
    assert set(commands) == {"vlmrl", "python", "curl", "ollama"}
    port, log = free_port(), tmp_path / "llama_cpp.server.log"
    server = shlex.split(commands["python"].replace("--port 8080", f"--port {port}"))
    with log.open("w") as handle:
        process = subprocess.Popen([sys.executable, *server[1:]], cwd=pulled_gguf,
                                   stdout=handle, stderr=subprocess.STDOUT)
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}/v1/models", log)
        asked = subprocess.run(["bash", "-c", commands["curl"].replace(":8080", f":{port}")],
                               capture_output=True, text=True, check=True, timeout=300)
    finally:
        stop_process(process, 20)
    assert json.loads(asked.stdout)["object"] == "chat.completion"

    args = parse_args(shlex.split(commands["vlmrl"])[2:])
    command = serve_command(pulled_gguf / args.gguf, file=args.file)
    assert option(command, "--model") == str(pulled_gguf / "model-f16.gguf")
    assert "--clip_model_path" in command
    modelfile = (pulled_gguf / "Modelfile").read_text()
    froms = [line.split()[1] for line in modelfile.splitlines() if line.startswith("FROM ")]
    assert froms == ["./model-f16.gguf", "./mmproj-f16.gguf"]


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
