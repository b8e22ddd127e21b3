"""A user's first month, on a reproduced pipeline: a rerun with a broken param fails in one line
that says how to get the last good results back, and `dvc checkout` brings back every metric and
report byte for byte; an unchanged `dvc repro -f` republishes the same version as a no-op, while
other inputs under that version are refused (on a real S3 server, moto's)."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import pytest
from conftest import dvc_repro, run, update_params
from s3_server import TEST_ACCESS_KEY, TEST_SECRET_KEY, MotoServer

from vlmrl.pipeline.dvc_env import dvc_env

KEPT = ("data/metrics", "data/reports")


@pytest.fixture(scope="module")
def reproduced(pipeline_repo: Path) -> Path:
    dvc_repro(pipeline_repo)
    return pipeline_repo


@pytest.fixture
def repo(reproduced: Path, tmp_path: Path) -> Path:
    """A copy of the reproduced pipeline (its DVC cache too), committed."""
    copy = tmp_path / "repo"
    shutil.copytree(reproduced, copy, symlinks=True)
    run(["git", "add", "-A"], copy)
    run(["git", "commit", "-qm", "reproduced"], copy)
    return copy


def snapshot(repo: Path) -> dict[str, bytes]:
    return {str(path.relative_to(repo)): path.read_bytes()
            for folder in KEPT for path in sorted((repo / folder).rglob("*"))
            if path.is_file() and path.name != ".gitignore"}


def error_lines(stderr: str) -> list[str]:
    """The stage's own error lines (`<stage> failed...`), without DVC's."""
    return [line for line in stderr.splitlines() if re.match(r"^\w+ failed", line)]


@pytest.mark.slow
def test_a_failed_rerun_loses_no_metric_or_report(repo: Path) -> None:
    before = snapshot(repo)
    assert any(name.startswith("data/metrics/train") for name in before)
    update_params(repo, {"train.grpo.learning_rate": -1e-4})

    failed = dvc_repro(repo, check=False)
    assert failed.returncode != 0
    assert "Traceback" not in failed.stderr
    [line] = error_lines(failed.stderr)
    assert line.startswith("train_gspo failed: ") and "learning_rate" in line
    assert line.endswith("the outputs of its last good run come back with "
                         "`dvc checkout train_gspo`")
    assert not (repo / "data/metrics/train.json").exists()  # DVC removed them before the run

    run(["dvc", "checkout", "train_gspo"], repo)
    assert snapshot(repo) == before


def objects(server: MotoServer, bucket: str) -> dict[str, str]:
    listed = server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {item["Key"]: item["ETag"] for item in listed}


@pytest.mark.slow
def test_an_unchanged_rerun_republishes_nothing_and_other_inputs_are_refused(
        repo: Path, s3_server: MotoServer) -> None:
    bucket = f"releases-{uuid.uuid4().hex[:12]}"
    env = {**dvc_env(), "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    update_params(repo, {"upload.bucket": bucket, "upload.endpoint_url": s3_server.endpoint_url,
                         "upload.create_bucket": True, "upload.version": "v1"})
    run(["dvc", "repro"], repo, env=env)
    published = objects(s3_server, bucket)
    assert any(key.endswith("/v1/manifest.json") for key in published)

    again = run(["dvc", "repro", "-f"], repo, env=env)
    assert "Running stage 'train_gspo'" in again.stdout
    assert objects(s3_server, bucket) == published  # not one object rewritten

    update_params(repo, {"eval.max_new_tokens": 40})
    refused = run(["dvc", "repro"], repo, env=env, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    [line] = error_lines(refused.stderr)
    assert line.startswith("upload failed: version 'v1' is already published at ")
    assert "with different files" in line
    assert objects(s3_server, bucket) == published
