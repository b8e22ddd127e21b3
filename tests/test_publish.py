"""The upload stage, `vlmrl pull` / `vlmrl versions` and a DVC remote, against a real moto S3 server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import stage_command
from s3_server import TEST_ACCESS_KEY, TEST_SECRET_KEY, MotoServer, start_moto_server

from vlmrl import publish as pub
from vlmrl.cli import main as vlmrl_main

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_DVC = Path(sys.executable).parent / "dvc"
PREFIX = "vlmrl/test"
BIG_FILE_SIZE = 6 * 1024 * 1024  # over the 5 MiB multipart threshold used here
WRONG_SECRET = "wrong-secret-that-must-never-be-printed"

UPLOAD_DETAILS = "data/reports/details/upload.json"  # the summary; metrics/upload.json: its counts


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def auth_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = start_moto_server(
        tmp_path_factory.mktemp("moto-auth"), {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    )
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only the test credentials reach boto3, and it never asks an instance metadata service."""
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "DVC_EXP_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")


@pytest.fixture
def bucket(s3_server: MotoServer) -> str:
    name = f"releases-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


# --------------------------------------------------------------------------- helpers


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def make_project(root: Path, upload: dict[str, Any], many_files: int = 0) -> Path:
    """A directory laid out like the pipeline's outputs, with a params.yaml."""
    models, metrics = root / "data" / "models", root / "data" / "metrics"
    write_bytes(models / "adapter" / "adapter_config.json", b'{"r": 16}')
    write_bytes(models / "adapter" / "adapter_model.safetensors", os.urandom(100_000))
    write_bytes(models / "merged" / "config.json", b'{"model_type": "qwen3_vl"}')
    write_bytes(models / "merged" / "model.safetensors", os.urandom(BIG_FILE_SIZE))
    write_bytes(models / "merged" / "tokenizer" / "vocab.json", b'{"a": 1}')
    write_bytes(models / "merged" / "README.md", b"a card the upload stage replaces")
    write_bytes(models / "gguf" / "model-Q4_K_M.gguf", os.urandom(300_000))
    write_bytes(models / "gguf" / "mmproj-f16.gguf", os.urandom(50_000))
    write_bytes(models / "gguf" / "README.md", b"# GGUF files (export's README)\n")
    for index in range(many_files):
        write_bytes(models / "gguf" / "shards" / f"part-{index:04d}.bin", os.urandom(32_000))
    write_bytes(metrics / "post_eval.json", json.dumps({"accuracy": 0.625, "n": 64}).encode())
    write_bytes(metrics / "baseline_eval.json", json.dumps({"accuracy": 0.5, "n": 64}).encode())
    write_bytes(metrics / "train.json", b'{"steps": 10}')
    write_bytes(metrics / "train_log.json", b'[{"step": 1, "loss": 1.0}]\n')
    write_bytes(metrics / "export.json", b'{"checks_failed": 0, "logit_max_abs_diff": {}}')
    params = {
        "upload": {
            "prefix": PREFIX,
            "region": "us-east-1",
            "multipart_threshold_mb": 5,
            "max_attempts": 3,
            **upload,
        }
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def inputs_of(project: Path) -> dict[str, Path]:
    models = project / "data" / "models"
    return {
        "adapter": models / "adapter",
        "merged": models / "merged",
        "gguf": models / "gguf",
        "metrics": project / "data" / "metrics",
    }


def local_files(project: Path) -> dict[str, bytes]:
    """What the upload should publish: every input file but the stage's own upload.json."""
    return {
        f"{group}/{path.relative_to(root).as_posix()}": path.read_bytes()
        for group, root in inputs_of(project).items()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != "upload.json"
    }


def stage_release_files(project: Path) -> dict[str, bytes]:
    """What the upload stage publishes: the inputs, with its model cards as README.md of the
    adapter, merged and GGUF groups."""
    reports = project / "data/reports"
    cards = {"adapter/README.md": (reports / "model_card_adapter.md").read_bytes(),
             "merged/README.md": (reports / "model_card.md").read_bytes(),
             "gguf/README.md": (reports / "model_card_gguf.md").read_bytes()}
    assert all(card.startswith(b"---\nbase_model:") for card in cards.values())
    return local_files(project) | cards


def upload_params(server: MotoServer, bucket: str, **overrides: Any) -> pub.UploadParams:
    return pub.UploadParams(
        bucket=bucket,
        prefix=PREFIX,
        endpoint_url=server.endpoint_url,
        multipart_threshold_mb=5,
        max_attempts=3,
        **overrides,
    )


def publish_project(project: Path, params: pub.UploadParams) -> pub.UploadResult:
    return pub.publish(inputs_of(project), params, params_digest="0" * 64, repo_dir=project)


def stage_env(**overrides: str) -> dict[str, str]:
    python_path = os.pathsep.join(
        filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])
    )
    return {**os.environ, "PYTHONPATH": python_path, **overrides}


def upload_command(*args: str) -> list[str]:
    """The upload stage as dvc.yaml runs it (its paths come from there), with `args` added."""
    _python, script, *flags = stage_command("upload", REPO_ROOT)
    return [sys.executable, str(REPO_ROOT / script), *flags, *args]


def run_stage(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        upload_command(*args),
        check=False,
        cwd=project,
        env=stage_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def location_args(server: MotoServer, bucket: str) -> list[str]:
    return ["--bucket", bucket, "--prefix", PREFIX, "--endpoint-url", server.endpoint_url]


def latest_version(server: MotoServer, bucket: str) -> str | None:
    try:
        body = server.client().get_object(Bucket=bucket, Key=f"{PREFIX}/latest.json")["Body"]
    except server.client().exceptions.NoSuchKey:
        return None
    return json.loads(body.read())["version"]


def keys_under(server: MotoServer, bucket: str, prefix: str) -> list[str]:
    response = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for item in response.get("Contents", [])]


def directory_snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- upload + pull


def test_stage_upload_then_pull_round_trip(
    s3_server: MotoServer, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(
        tmp_path / "proj",
        {"bucket": bucket, "version": "v1", "endpoint_url": s3_server.endpoint_url},
    )
    completed = run_stage(project)
    assert completed.returncode == 0, completed.stderr
    assert "published s3://" in completed.stdout

    summary = json.loads((project / UPLOAD_DETAILS).read_text())
    originals = stage_release_files(project)
    assert summary["uploaded"] is True and summary["version"] == "v1"
    assert summary["bucket"] == bucket and summary["prefix"] == PREFIX
    assert summary["uploaded_files"] == summary["files"] == len(originals)
    assert summary["skipped_files"] == 0 and summary["manifest_uploaded"] is True
    manifest = json.loads((project / "data/reports/upload_manifest.json").read_text())
    assert manifest["metrics"]["post_eval"]["accuracy"] == 0.625
    assert {f"{e['group']}/{e['path']}" for e in manifest["files"]} == set(originals)
    assert latest_version(s3_server, bucket) == "v1"

    big = s3_server.client().head_object(Bucket=bucket, Key=f"{PREFIX}/v1/merged/model.safetensors")
    assert big["ETag"].strip('"').endswith("-2"), "6 MiB over a 5 MiB threshold goes multipart"
    assert len(big["Metadata"]["sha256"]) == 64

    destination = tmp_path / "pulled" / "everything"
    assert (
        vlmrl_main(
            [
                "pull",
                "--version",
                "latest",
                "--what",
                "all",
                "--to",
                str(destination),
                *location_args(s3_server, bucket),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "merged/model.safetensors" in printed and "6.0 MiB" in printed
    pulled = directory_snapshot(destination)
    assert pulled.pop("manifest.json")
    assert pulled == originals

    adapter_only = tmp_path / "adapter"
    assert (
        pub.cli_pull(
            [
                "--version",
                "v1",
                "--what",
                "adapter",
                "--to",
                str(adapter_only),
                *location_args(s3_server, bucket),
            ]
        )
        == 0
    )
    assert directory_snapshot(adapter_only) == {
        name.removeprefix("adapter/"): data
        for name, data in originals.items()
        if name.startswith("adapter/")
    }
    assert not [p for p in (tmp_path / "pulled").iterdir() if p.name.startswith(".")]


def test_rerun_uploads_nothing_new(s3_server: MotoServer, bucket: str, tmp_path: Path) -> None:
    project = make_project(tmp_path, {})
    params = upload_params(s3_server, bucket, version="v1")
    first = publish_project(project, params)
    second = publish_project(project, params)
    file_count = len(local_files(project))
    assert (first.uploaded_files, first.skipped_files, first.manifest_uploaded) == (
        file_count,
        0,
        True,
    )
    assert (second.uploaded_files, second.skipped_files, second.uploaded_bytes) == (
        0,
        file_count,
        0,
    )
    assert second.manifest_uploaded is False
    assert second.manifest == first.manifest  # the published manifest (and created_at) is kept


def test_interrupted_upload_keeps_latest_and_rerun_completes(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    publish_project(
        make_project(tmp_path / "v1", {}), upload_params(s3_server, bucket, version="v1")
    )
    project = make_project(
        tmp_path / "v2",
        {"bucket": bucket, "version": "v2", "endpoint_url": s3_server.endpoint_url},
        many_files=100,
    )
    process = subprocess.Popen(
        upload_command(),
        cwd=project,
        env=stage_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not keys_under(s3_server, bucket, f"{PREFIX}/v2/") and process.poll() is None:
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the upload finished before it could be killed"

    uploaded_before_kill = keys_under(s3_server, bucket, f"{PREFIX}/v2/")
    assert uploaded_before_kill
    assert f"{PREFIX}/v2/manifest.json" not in uploaded_before_kill
    assert latest_version(s3_server, bucket) == "v1"
    assert not (project / "data/metrics/upload.json").exists()
    assert not (project / "data/reports/upload_manifest.json").exists()

    completed = run_stage(project)
    assert completed.returncode == 0, completed.stderr
    summary = json.loads((project / UPLOAD_DETAILS).read_text())
    assert summary["skipped_files"] >= 1
    assert (
        summary["uploaded_files"] + summary["skipped_files"]
        == summary["files"]
        == len(stage_release_files(project))
    )
    assert latest_version(s3_server, bucket) == "v2"


def test_corrupted_object_is_caught_on_pull_and_destination_untouched(
    s3_server: MotoServer, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path / "proj", {})
    publish_project(project, upload_params(s3_server, bucket, version="v1"))
    key = f"{PREFIX}/v1/gguf/model-Q4_K_M.gguf"
    client = s3_server.client()
    genuine = client.head_object(Bucket=bucket, Key=key)
    # Same size and the same sha256 metadata: only the bytes are wrong.
    client.put_object(
        Bucket=bucket,
        Key=key,
        Body=os.urandom(genuine["ContentLength"]),
        Metadata=genuine["Metadata"],
    )

    destination = tmp_path / "out" / "gguf"
    write_bytes(destination / "keep.txt", b"previous pull")
    before = directory_snapshot(destination)
    assert (
        pub.cli_pull(
            [
                "--what",
                "gguf",
                "--to",
                str(destination),
                "--force",
                *location_args(s3_server, bucket),
            ]
        )
        == 1
    )
    error = capsys.readouterr().err
    assert "checksum mismatch" in error and key in error
    assert directory_snapshot(destination) == before
    assert sorted(p.name for p in destination.parent.iterdir()) == ["gguf"]

    fresh = tmp_path / "out" / "fresh"
    with pytest.raises(pub.IntegrityError, match="checksum mismatch"):
        pub.pull(
            client, pub.S3Location(bucket, PREFIX, s3_server.endpoint_url), "v1", ["gguf"], fresh
        )
    assert not fresh.exists()


def test_missing_object_is_named_on_pull(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    publish_project(
        make_project(tmp_path / "proj", {}), upload_params(s3_server, bucket, version="v1")
    )
    key = f"{PREFIX}/v1/adapter/adapter_model.safetensors"
    s3_server.client().delete_object(Bucket=bucket, Key=key)
    location = pub.S3Location(bucket, PREFIX, s3_server.endpoint_url)
    with pytest.raises(pub.IntegrityError, match=f"missing object s3://{bucket}/{key}"):
        pub.pull(s3_server.client(), location, "latest", ["adapter"], tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_pull_refuses_a_non_empty_destination_without_force(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    publish_project(
        make_project(tmp_path / "proj", {}), upload_params(s3_server, bucket, version="v1")
    )
    destination = tmp_path / "adapter"
    write_bytes(destination / "old.bin", b"old")
    location = pub.S3Location(bucket, PREFIX, s3_server.endpoint_url)
    with pytest.raises(pub.PublishError, match="not empty; pass --force"):
        pub.pull(s3_server.client(), location, "v1", ["adapter"], destination)
    result = pub.pull(s3_server.client(), location, "v1", ["adapter"], destination, force=True)
    assert sorted(f.path for f in result.files) == sorted(directory_snapshot(destination))
    assert "old.bin" not in directory_snapshot(destination)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_pulled_files_and_folders_follow_the_umask(
    s3_server: MotoServer, bucket: str, tmp_path: Path, umask: int
) -> None:
    """Another user or service reads a pull as it would any file the user made: the staging
    folder that becomes the destination is not left at mkdtemp's 0700."""
    publish_project(
        make_project(tmp_path / "proj", {}), upload_params(s3_server, bucket, version="v1")
    )
    location = pub.S3Location(bucket, PREFIX, s3_server.endpoint_url)
    previous = os.umask(umask)
    try:
        pub.pull(s3_server.client(), location, "v1", list(pub.GROUPS), tmp_path / "all")
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
             for p in [tmp_path / "all", *(tmp_path / "all").rglob("*")]}
    folders = {name for name in modes if (tmp_path / name).is_dir()}
    assert {"all", "all/merged/tokenizer", "all/gguf"} <= folders
    assert {modes[name] for name in folders} == {0o777 & ~umask}
    assert {mode for name, mode in modes.items() if name not in folders} == {0o666 & ~umask}


# --------------------------------------------------------------------------- refusals and errors


def test_refuses_to_overwrite_a_different_published_version(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    project = make_project(tmp_path / "proj", {})
    publish_project(project, upload_params(s3_server, bucket, version="v1"))
    write_bytes(project / "data/models/gguf/model-Q4_K_M.gguf", b"retrained weights")
    (project / "data/models/merged/tokenizer/vocab.json").unlink()

    with pytest.raises(pub.VersionConflictError) as refused:
        publish_project(project, upload_params(s3_server, bucket, version="v1"))
    message = str(refused.value)
    assert "'v1'" in message and "upload.overwrite" in message
    assert "gguf/model-Q4_K_M.gguf" in message and "merged/tokenizer/vocab.json" in message
    assert "adapter/adapter_config.json" not in message

    result = publish_project(
        project, upload_params(s3_server, bucket, version="v1", overwrite=True)
    )
    assert (result.uploaded_files, result.manifest_uploaded) == (1, True)  # the changed GGUF
    assert f"{PREFIX}/v1/merged/tokenizer/vocab.json" not in keys_under(s3_server, bucket, PREFIX)
    location = pub.S3Location(bucket, PREFIX, s3_server.endpoint_url)
    pub.pull(s3_server.client(), location, "v1", ["gguf"], tmp_path / "gguf")
    assert (tmp_path / "gguf/model-Q4_K_M.gguf").read_bytes() == b"retrained weights"


def test_wrong_credentials_give_a_clear_error_without_secrets(
    auth_s3_server: MotoServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = make_project(
        tmp_path / "proj",
        {"bucket": "secured", "version": "v1", "endpoint_url": auth_s3_server.endpoint_url},
    )
    completed = run_stage(
        project, AWS_ACCESS_KEY_ID="AKIAWRONGKEY0000", AWS_SECRET_ACCESS_KEY=WRONG_SECRET
    )
    assert completed.returncode == 1
    for expected in (
        "bucket 'secured'",
        auth_s3_server.endpoint_url,
        "AWS credential chain",
        "InvalidAccessKeyId",
    ):
        assert expected in completed.stderr
    assert WRONG_SECRET not in completed.stderr + completed.stdout
    assert "Traceback" not in completed.stderr
    assert not (project / "data/metrics/upload.json").exists()
    assert not (project / "data/reports/upload_manifest.json").exists()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    assert (
        pub.cli_versions(["--bucket", "secured", "--endpoint-url", auth_s3_server.endpoint_url])
        == 1
    )
    error = capsys.readouterr().err
    assert "AWS credential chain" in error and WRONG_SECRET not in error


def test_missing_credentials_give_a_clear_error(
    s3_server: MotoServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(pub.CredentialsError, match="no usable credentials.*AWS credential chain"):
        publish_project(make_project(tmp_path, {}), upload_params(s3_server, bucket, version="v1"))


def test_missing_bucket_is_named(s3_server: MotoServer, tmp_path: Path) -> None:
    with pytest.raises(pub.PublishError, match="bucket 'no-such-bucket' does not exist"):
        publish_project(make_project(tmp_path, {}), upload_params(s3_server, "no-such-bucket"))


def test_no_bucket_writes_the_manifest_and_uploads_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path, {"bucket": ""})
    completed = run_stage(project)  # with the flags dvc.yaml passes
    assert completed.returncode == 0, completed.stderr
    assert (
        "no upload.bucket configured: nothing was uploaded; manifest written to" in completed.stdout
    )
    summary = json.loads((project / UPLOAD_DETAILS).read_text())
    assert (
        summary["uploaded"] is False
        and summary["bucket"] is None
        and summary["uploaded_files"] == 0
    )
    manifest = json.loads((project / "data/reports/upload_manifest.json").read_text())
    assert len(manifest["files"]) == len(stage_release_files(project))
    assert manifest["version"].startswith("local-")
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"])


def test_missing_input_directory_names_the_stage_that_makes_it(tmp_path: Path) -> None:
    project = make_project(tmp_path, {"bucket": ""})
    shutil.rmtree(project / "data/models/gguf")
    completed = run_stage(project)
    assert completed.returncode == 1
    assert "data/models/gguf" in completed.stderr and "export" in completed.stderr
    assert not (project / "data/reports/upload_manifest.json").exists()


# --------------------------------------------------------------------------- versions


def test_versions_lists_published_versions_and_marks_latest(
    s3_server: MotoServer, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path, {})
    publish_project(project, upload_params(s3_server, bucket, version="v1"))
    publish_project(project, upload_params(s3_server, bucket, version="v2"))
    s3_server.client().put_object(Bucket=bucket, Key=f"{PREFIX}/v3-incomplete/adapter/x", Body=b"x")

    assert vlmrl_main(["versions", *location_args(s3_server, bucket)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[2:].split()[0]: line for line in lines[3:]}
    assert set(rows) == {"v1", "v2"}
    assert rows["v2"].startswith("* ") and not rows["v1"].startswith("*")
    assert "post_eval.accuracy=0.625" in rows["v1"]

    assert pub.cli_versions(["--json", *location_args(s3_server, bucket)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["version"], v["is_latest"]) for v in listed] == [("v1", False), ("v2", True)]


def test_cli_reads_bucket_and_prefix_from_params_yaml(
    s3_server: MotoServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = make_project(
        tmp_path / "proj", {"bucket": bucket, "endpoint_url": s3_server.endpoint_url}
    )
    publish_project(project, upload_params(s3_server, bucket, version="v1"))
    monkeypatch.chdir(project)
    assert pub.cli_pull(["--what", "merged", "--to", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged/model.safetensors").stat().st_size == BIG_FILE_SIZE


def test_cli_without_bucket_anywhere_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        pub.cli_pull(["--to", "x"])
    assert exited.value.code == 2


# --------------------------------------------------------------------------- version naming


def git(repo: Path, *args: str) -> str:
    completed = subprocess.run(
        ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return completed.stdout.strip()


def test_version_derivation_order(tmp_path: Path) -> None:
    digest = "ab" * 32
    assert pub.derive_version("", digest, tmp_path, env={}) == f"local-{digest[:12]}"

    git(tmp_path, "init", "-q")
    (tmp_path / "params.yaml").write_text("a: 1\n")
    git(tmp_path, "add", "params.yaml")
    git(tmp_path, "commit", "-q", "-m", "init")
    short_sha = git(tmp_path, "rev-parse", "--short=12", "HEAD")
    assert pub.derive_version("", digest, tmp_path, env={}) == f"git-{short_sha}"
    (tmp_path / "params.yaml").write_text("a: 2\n")
    assert pub.derive_version("", digest, tmp_path, env={}) == f"git-{short_sha}-dirty"
    assert (
        pub.derive_version("", digest, tmp_path, env={"DVC_EXP_NAME": "lucky-lion"}) == "lucky-lion"
    )
    git(tmp_path, "tag", "-a", "gguf@v1.0.0", "-m", "artifact registry tag, not a release")
    assert pub.derive_version("", digest, tmp_path, env={}) == f"git-{short_sha}-dirty"
    git(tmp_path, "tag", "release/v1.2")
    assert pub.derive_version("", digest, tmp_path, env={"DVC_EXP_NAME": "x"}) == "release-v1.2"
    assert pub.derive_version("v9", digest, tmp_path, env={}) == "v9"
    assert pub.git_revision(tmp_path) == git(tmp_path, "rev-parse", "HEAD")
    for invalid in ("latest", "a/b", "has space"):
        with pytest.raises(pub.PublishError, match="invalid upload version"):
            pub.derive_version(invalid, digest, tmp_path, env={})


# --------------------------------------------------------------------------- DVC remote


@pytest.mark.skipif(not VENV_DVC.exists(), reason=f"dvc is not installed at {VENV_DVC}")
def test_dvc_push_and_pull_through_the_s3_remote(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}

    def dvc(*args: str) -> str:
        completed = subprocess.run(
            [str(VENV_DVC), *args],
            check=False,
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert completed.returncode == 0, (
            f"dvc {' '.join(args)}:\n{completed.stdout}\n{completed.stderr}"
        )
        return completed.stdout

    git(repo, "init", "-q")
    dvc("init", "-q")
    dvc("remote", "add", "-d", "s3remote", f"s3://{bucket}/dvcstore")
    dvc("remote", "modify", "s3remote", "endpointurl", s3_server.endpoint_url)
    artifact = repo / "model.gguf"
    payload = os.urandom(BIG_FILE_SIZE + 12345)
    artifact.write_bytes(payload)
    dvc("add", "model.gguf")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "track model with dvc")
    dvc("push")
    assert keys_under(s3_server, bucket, "dvcstore/"), "dvc push stored nothing in the bucket"

    artifact.unlink()
    shutil.rmtree(repo / ".dvc" / "cache")
    dvc("pull")
    assert artifact.read_bytes() == payload


# --------------------------------------------------------------------------- same inputs


def write_pipeline_records(project: Path, learning_rate: float) -> None:
    """A dvc.yaml and the dvc.lock of a run: a training stage whose code, data and params DVC
    hashed, its adapter (an output, whose hash a rerun may change), and the upload stage."""
    (project / "stages").mkdir(exist_ok=True)
    (project / "stages" / "upload.py").write_text("# the upload stage\n")
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "train": {"cmd": "python stages/train.py", "deps": ["stages/train.py"]},
        "upload": {"cmd": "python stages/upload.py",
                   "deps": ["stages/upload.py", "${paths.adapter}"]}}}))
    adapter_md5 = uuid.uuid4().hex  # a rerun of the same inputs writes other bytes
    (project / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"train": {
        "cmd": "python stages/train.py",
        "deps": [{"path": "stages/train.py", "md5": "a" * 32},
                 {"path": "data/prepared/train", "md5": "b" * 32 + ".dir"}],
        "params": {"params.yaml": {"train.grpo.learning_rate": learning_rate}},
        "outs": [{"path": "data/models/adapter", "md5": adapter_md5 + ".dir"}]}}}))


def test_a_version_republished_from_the_same_inputs_is_a_no_op(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """An unchanged pipeline run again writes an adapter that differs in the last bits: the same
    version is then left as published, bit for bit; other inputs are still refused."""
    project = make_project(tmp_path / "project", {})
    write_pipeline_records(project, learning_rate=3e-4)
    params = upload_params(s3_server, bucket, version="v1")
    first = publish_project(project, params)
    assert first.uploaded_files == len(first.manifest["files"])
    assert first.manifest["built_from"]["train"]["params"] == {
        "params.yaml": {"train.grpo.learning_rate": 3e-4}}
    assert "data/models/adapter" not in json.dumps(first.manifest["built_from"])
    client, adapter_key = s3_server.client(), f"{PREFIX}/v1/adapter/adapter_model.safetensors"
    published = client.get_object(Bucket=bucket, Key=adapter_key)["Body"].read()

    write_bytes(project / "data/models/adapter/adapter_model.safetensors", os.urandom(100_000))
    write_pipeline_records(project, learning_rate=3e-4)
    again = publish_project(project, params)
    assert again.already_published and again.uploaded_files == 0
    assert again.skipped_files == len(again.manifest["files"])
    assert again.manifest == first.manifest
    assert client.get_object(Bucket=bucket, Key=adapter_key)["Body"].read() == published

    write_pipeline_records(project, learning_rate=1e-4)
    with pytest.raises(pub.VersionConflictError, match=r"^version 'v1' is already published .* "
                                                       r"with different files: adapter/"):
        publish_project(project, params)
    assert client.get_object(Bucket=bucket, Key=adapter_key)["Body"].read() == published
