"""The upload stage on a fresh bucket and a dirty tree, against the moto server: a missing bucket is
one line saying how to create it, `vlmrl create-bucket` and `upload.create_bucket: true` create it,
a `-dirty` version is published after a warning, and upload.json's counts add up."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import test_publish
from s3_server import MotoServer
from test_publish import (
    UPLOAD_DETAILS,
    latest_version,
    make_project,
    run_stage,
    stage_release_files,
)

from vlmrl.cli import main as vlmrl_main

# test_publish's fixtures: a fresh bucket (on conftest's moto server) and only the test
# credentials.
bucket = test_publish.bucket
aws_env = test_publish.aws_env



def fresh_bucket_name() -> str:
    return f"fresh-{uuid.uuid4().hex[:12]}"


def bucket_names(server: MotoServer) -> set[str]:
    return {entry["Name"] for entry in server.client().list_buckets()["Buckets"]}


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
                   cwd=repo, check=True, capture_output=True)


def test_missing_bucket_is_one_line_that_says_how_to_create_it(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    name = fresh_bucket_name()
    project = make_project(
        tmp_path, {"bucket": name, "version": "v1", "endpoint_url": s3_server.endpoint_url})
    completed = run_stage(project)
    assert completed.returncode == 1
    assert completed.stderr.splitlines() == [(
        f"upload failed: bucket '{name}' does not exist at {s3_server.endpoint_url}: create it "
        "with `vlmrl create-bucket` (bucket, endpoint and region from params.yaml), or set "
        "upload.create_bucket: true to let the upload stage create it")]
    assert name not in bucket_names(s3_server)
    assert not (project / "data/metrics/upload.json").exists()


def test_create_bucket_param_creates_it_and_publishes(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    name = fresh_bucket_name()
    project = make_project(tmp_path, {"bucket": name, "version": "v1", "create_bucket": True,
                                      "endpoint_url": s3_server.endpoint_url})
    completed = run_stage(project)
    assert completed.returncode == 0, completed.stderr
    assert f"created bucket '{name}' at {s3_server.endpoint_url}" in completed.stdout
    assert latest_version(s3_server, name) == "v1"

    rerun = run_stage(project)  # the bucket is there now: nothing created, nothing uploaded
    assert rerun.returncode == 0, rerun.stderr
    assert "created bucket" not in rerun.stdout
    files = len(stage_release_files(project))
    assert (f"of {files} files, 0 uploaded and {files} already there; "
            "manifest.json already there") in rerun.stdout


def test_vlmrl_create_bucket_uses_params_and_is_idempotent(
    s3_server: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = fresh_bucket_name()
    project = make_project(tmp_path, {"bucket": name, "endpoint_url": s3_server.endpoint_url})
    monkeypatch.chdir(project)
    assert vlmrl_main(["create-bucket"]) == 0
    assert capsys.readouterr().out == f"created bucket '{name}' at {s3_server.endpoint_url}\n"
    assert name in bucket_names(s3_server)
    assert vlmrl_main(["create-bucket"]) == 0
    assert capsys.readouterr().out == (
        f"bucket '{name}' at {s3_server.endpoint_url} already exists; nothing to do\n")
    assert run_stage(project).returncode == 0


def test_vlmrl_create_bucket_outside_us_east_1_sets_the_region(
    s3_server: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh_bucket_name()
    monkeypatch.chdir(tmp_path)  # no params.yaml: every location flag is explicit
    assert vlmrl_main(["create-bucket", "--bucket", name, "--endpoint-url",
                       s3_server.endpoint_url, "--region", "eu-west-1"]) == 0
    location = s3_server.client().get_bucket_location(Bucket=name)["LocationConstraint"]
    assert location == "eu-west-1"


def test_dirty_version_is_published_after_a_warning(
    s3_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    project = make_project(tmp_path, {"bucket": bucket, "endpoint_url": s3_server.endpoint_url})
    git(project, "init", "-q")
    git(project, "add", "params.yaml")
    git(project, "commit", "-q", "-m", "params")
    with (project / "params.yaml").open("a") as params:
        params.write("# edited after the commit\n")
    completed = run_stage(project)
    assert completed.returncode == 0, completed.stderr
    version = json.loads((project / UPLOAD_DETAILS).read_text())["version"]
    assert version.startswith("git-") and version.endswith("-dirty")
    warnings = [line for line in completed.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [(
        f"warning: publishing version '{version}': the working tree differed from its commit "
        "(a `dvc repro` that rewrote dvc.lock counts), so the version names no exact commit; for "
        "one that does, commit and rerun `dvc repro upload`, or set upload.version")]
    assert latest_version(s3_server, bucket) == version

    clean = make_project(tmp_path / "clean", {"bucket": bucket, "version": "v1",
                                              "endpoint_url": s3_server.endpoint_url})
    assert "warning:" not in run_stage(clean).stderr


def test_upload_json_counts_add_up(s3_server: MotoServer, bucket: str, tmp_path: Path) -> None:
    project = make_project(tmp_path, {"bucket": bucket, "version": "v1",
                                      "endpoint_url": s3_server.endpoint_url})
    completed = run_stage(project)
    assert completed.returncode == 0, completed.stderr
    summary = json.loads((project / UPLOAD_DETAILS).read_text())
    manifest = json.loads((project / "data/reports/upload_manifest.json").read_text())
    assert summary["files"] == len(manifest["files"]) == len(stage_release_files(project))
    assert summary["uploaded_files"] + summary["skipped_files"] == summary["files"]
    assert summary["uploaded_bytes"] == summary["total_bytes"] == sum(
        entry["size"] for entry in manifest["files"])
    assert summary["manifest_uploaded"] is True
    files = summary["files"]
    assert (f"of {files} files, {files} uploaded and 0 already there; manifest.json uploaded"
            in completed.stdout)
