"""Pull and upload trust nothing they read from the bucket: crafted releases on the moto server
(127.0.0.1) are refused with a message naming the problem, with nothing written outside `--to`
(the whole temporary root is walked) and `--to` as it was; a good release still pulls, one file
at a time if asked; `latest` only moves forward; uploads carry a SHA256 the store checks; and
`vlmrl pull` / `vlmrl versions` never import torch or transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_server import TEST_ACCESS_KEY, TEST_SECRET_KEY, MotoServer
from test_publish import (  # noqa: F401  (aws_env: the autouse fixture, for these tests too)
    PREFIX,
    REPO_ROOT,
    aws_env,
    directory_snapshot,
    latest_version,
    location_args,
    make_project,
    publish_project,
    upload_params,
    write_bytes,
)

from vlmrl import publish as pub
from vlmrl.cli import main as vlmrl_main
from vlmrl.params import ParamsError
from vlmrl.publish.cli import printable
from vlmrl.publish.errors import IntegrityError, PublishError
from vlmrl.publish.s3 import copy_bounded
from vlmrl.publish.schema import parse_latest, parse_manifest, path_problem, safe_join

GOOD_SHA = "ab" * 32
MANIFEST_KEY = f"{PREFIX}/v1/manifest.json"
QUANT_KEY = f"{PREFIX}/v1/gguf/model-Q4_K_M.gguf"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def golden_bucket(s3_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One good release, v1, copied into a fresh bucket for each test to tamper with."""
    name = f"golden-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    project = make_project(tmp_path_factory.mktemp("golden"), {})
    with pytest.MonkeyPatch.context() as env:  # the function-scoped aws_env is not active yet
        env.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        env.delenv("AWS_PROFILE", raising=False)
        publish_project(project, upload_params(s3_server, name, version="v1"))
    return name


@pytest.fixture
def release(s3_server: MotoServer, golden_bucket: str) -> str:
    client = s3_server.client()
    name = f"release-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    for item in client.list_objects_v2(Bucket=golden_bucket)["Contents"]:
        source = {"Bucket": golden_bucket, "Key": item["Key"]}
        client.copy_object(Bucket=name, Key=item["Key"], CopySource=source)
    return name


@pytest.fixture
def temporary_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp()


# --------------------------------------------------------------------------- helpers


def get_json(server: MotoServer, bucket: str, key: str) -> Any:
    return json.loads(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def put(server: MotoServer, bucket: str, key: str, body: Any) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    server.client().put_object(Bucket=bucket, Key=key, Body=data)


def tamper_manifest(server: MotoServer, bucket: str, change: Callable[[dict], Any]) -> None:
    put(server, bucket, MANIFEST_KEY, change(get_json(server, bucket, MANIFEST_KEY)))


def quant_entry(manifest: dict) -> dict:
    return next(e for e in manifest["files"] if e["path"] == "model-Q4_K_M.gguf")


def tree_state(root: Path) -> dict[str, tuple]:
    """Every folder and file under `root`, files with size and mtime; moto's logs grow, so they
    are left out."""
    state: dict[str, tuple] = {}
    for directory, folders, files in os.walk(root):
        for name in folders:
            state[os.path.join(directory, name)] = ("dir",)
        for name in files:
            if not (name.startswith("moto-") and name.endswith(".log")):
                stat = os.lstat(os.path.join(directory, name))
                state[os.path.join(directory, name)] = ("file", stat.st_size, stat.st_mtime_ns)
    return state


# --------------------------------------------------------------------------- hostile releases


def path_with_dotdot(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    def change(manifest: dict) -> dict:
        quant_entry(manifest)["path"] = "../../escaped.gguf"
        return manifest

    genuine = server.client().get_object(Bucket=bucket, Key=QUANT_KEY)["Body"].read()
    put(server, bucket, f"{PREFIX}/v1/gguf/../../escaped.gguf", genuine)  # what a naive pull gets
    tamper_manifest(server, bucket, change)
    return ["manifest.json", ".path = '../../escaped.gguf'", "'..' part"]


def absolute_path(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    target = str(tmp_path / "absolute-escape.gguf")

    def change(manifest: dict) -> dict:
        quant_entry(manifest)["path"] = target
        return manifest

    genuine = server.client().get_object(Bucket=bucket, Key=QUANT_KEY)["Body"].read()
    put(server, bucket, f"{PREFIX}/v1/gguf/{target.lstrip('/')}", genuine)
    tamper_manifest(server, bucket, change)
    return [f".path = '{target}'", "is absolute"]


def latest_version_with_dotdot(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    latest = get_json(server, bucket, f"{PREFIX}/latest.json")
    put(server, bucket, f"{PREFIX}/latest.json", {**latest, "version": "../v1"})
    return ["latest.json", "version = '../v1'"]


def larger_object(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    genuine = server.client().get_object(Bucket=bucket, Key=QUANT_KEY)["Body"].read()
    put(server, bucket, QUANT_KEY, genuine + b"more bytes than the manifest says")
    return [QUANT_KEY, "larger than its manifest size"]


def wrong_sha256(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    def change(manifest: dict) -> dict:
        quant_entry(manifest)["sha256"] = "0" * 64
        return manifest

    tamper_manifest(server, bucket, change)
    return ["checksum mismatch", QUANT_KEY]


def manifest_not_json(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    put(server, bucket, MANIFEST_KEY, b'{"schema": 1, "files": [')
    return [MANIFEST_KEY, "is not valid JSON"]


def duplicated_path(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    def change(manifest: dict) -> dict:
        manifest["files"].append(dict(quant_entry(manifest)))
        return manifest

    tamper_manifest(server, bucket, change)
    return ["'model-Q4_K_M.gguf' (gguf) is listed twice"]


def empty_file_list(server: MotoServer, bucket: str, tmp_path: Path) -> list[str]:
    tamper_manifest(server, bucket, lambda manifest: {**manifest, "files": []})
    return ["files = []", "at least 1 item"]


HOSTILE = [
    path_with_dotdot,
    absolute_path,
    latest_version_with_dotdot,
    larger_object,
    wrong_sha256,
    manifest_not_json,
    duplicated_path,
    empty_file_list,
]


def refused_pull(
    server: MotoServer,
    bucket: str,
    destination: Path,
    temporary_root: Path,
    capsys: pytest.CaptureFixture[str],
    *extra: str,
) -> str:
    """Runs `vlmrl pull`, which must fail, and checks that nothing under the temporary root
    changed (so `--to` is as it was); returns stderr."""
    before_root = tree_state(temporary_root)
    before_destination = directory_snapshot(destination) if destination.exists() else None
    code = vlmrl_main(
        ["pull", "--what", "gguf", "--to", str(destination), "--force", *extra,
         *location_args(server, bucket)]
    )
    error = capsys.readouterr().err
    after_root = tree_state(temporary_root)
    assert sorted(after_root.keys() - before_root.keys()) == [], "a refused pull left new files"
    assert after_root == before_root, "a refused pull changed files"
    assert code != 0, error
    if before_destination is None:
        assert not destination.exists()
    else:
        assert directory_snapshot(destination) == before_destination
    return error


@pytest.mark.parametrize("existing", [True, False], ids=["existing-to", "fresh-to"])
@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.__name__ for h in HOSTILE])
def test_crafted_release_is_refused_and_nothing_is_written(
    hostile: Callable[[MotoServer, str, Path], list[str]],
    existing: bool,
    s3_server: MotoServer,
    release: str,
    tmp_path: Path,
    temporary_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = hostile(s3_server, release, tmp_path)
    destination = tmp_path / "out" / "a" / "b" / "to"
    if existing:
        write_bytes(destination / "keep.txt", b"a previous pull")
    error = refused_pull(s3_server, release, destination, temporary_root, capsys)
    message = error.strip().splitlines()[-1]  # a progress bar may come before it
    assert message.startswith("error: ") and "Traceback" not in error
    for words in expected:
        assert words in message


def test_version_with_dotdot_on_the_command_line_is_refused(
    s3_server: MotoServer, release: str, tmp_path: Path, temporary_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    destination = tmp_path / "fresh" / "to"
    error = refused_pull(
        s3_server, release, destination, temporary_root, capsys, "--version", "../v1"
    )
    assert "invalid version '../v1'" in error
    assert not (tmp_path / "fresh").exists()


# --------------------------------------------------------------------------- what is validated


@pytest.mark.parametrize(
    ("path", "problem"),
    [("a/../b", "'..' part"), ("/etc/passwd", "absolute"), ("a\\b", "backslash"),
     ("C:evil", "drive letter"), ("a\x00b", "NUL"), ("a//b", "empty part"), ("a/", "empty part"),
     ("", "empty"), ("./a", "'.' part"), ("a\nb", "control character")],
)
def test_unsafe_paths_are_named(path: str, problem: str) -> None:
    assert problem in path_problem(path)
    with pytest.raises(IntegrityError, match="path"):
        safe_join(Path("/tmp/staging"), path)


def test_a_symlinked_folder_cannot_lead_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(IntegrityError, match="outside"):
        safe_join(root, "link/escaped.bin")
    assert safe_join(root, "model/file.bin") == root / "model" / "file.bin"


def manifest_json(**changes: Any) -> bytes:
    entry = {"group": "gguf", "path": "m.gguf", "size": 3, "sha256": GOOD_SHA}
    manifest = {"schema": 1, "version": "v1", "created_at": "2026-01-01T00:00:00+00:00",
                "git_revision": None, "params_hash": GOOD_SHA, "metrics": {}, "files": [entry]}
    files = changes.pop("files", None)
    if files is not None:
        manifest["files"] = [{**entry, **change} for change in files]
    return json.dumps({**manifest, **changes}).encode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"files": [{"group": "secrets"}]}, "files[0].group = 'secrets'"),
     ({"files": [{"sha256": "AB" * 32}]}, "files[0].sha256"),
     ({"files": [{"sha256": "ab"}]}, "files[0].sha256 = 'ab'"),
     ({"files": [{"size": -1}]}, "files[0].size = -1"),
     ({"files": [{"size": 2**41}]}, "files[0].size"),
     ({"files": [{"size": "3"}]}, "files[0].size = '3'"),
     ({"files": [{"size": True}]}, "files[0].size = True"),
     ({"files": [{"mode": "0777"}]}, "files[0].mode"),
     ({"files": [{"path": "a"}, {"path": "a/b"}]}, "needs a folder where files[0] is a file"),
     ({"version": "latest"}, "version = 'latest'"),
     ({"version": "v1/../v2"}, "version = 'v1/../v2'"),
     ({"schema": 2}, "schema = 2"),
     ({"created_at": "yesterday"}, "created_at = 'yesterday'")],
)
def test_manifest_schema_names_the_field_and_value(changes: dict, message: str) -> None:
    with pytest.raises(PublishError, match="^manifest: ") as refused:
        parse_manifest(manifest_json(**changes), "manifest")
    assert message in str(refused.value)


def test_missing_fields_are_named() -> None:
    body = json.dumps({"version": "v1", "created_at": "2026-01-01T00:00:00Z"}).encode()
    with pytest.raises(PublishError, match="latest.json: manifest is missing"):
        parse_latest(body, "latest.json")
    assert parse_manifest(manifest_json(), "m").files[0].size == 3


def test_reads_stop_as_soon_as_an_object_outgrows_its_size() -> None:
    served: list[int] = []

    def endless() -> Iterator[bytes]:
        while True:
            served.append(4)
            yield b"abcd"

    written: list[bytes] = []
    with pytest.raises(IntegrityError, match="larger than 10 bytes; stopped after reading 12"):
        copy_bounded(endless(), 10, written.append, "s3://b/k")
    assert len(served) == 3 and b"".join(written) == b"abcdabcd"


# --------------------------------------------------------------------------- good releases


def test_single_file_pull_by_quant_or_file_name(
    s3_server: MotoServer, release: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    location = location_args(s3_server, release)
    quant = tmp_path / "quant"
    assert vlmrl_main(["pull", "--what", "gguf", "--file", "Q4_K_M", "--to", str(quant),
                       *location]) == 0
    genuine = s3_server.client().get_object(Bucket=release, Key=QUANT_KEY)["Body"].read()
    assert directory_snapshot(quant) == {"model-Q4_K_M.gguf": genuine}

    both = tmp_path / "both"
    assert vlmrl_main(["pull", "--what", "gguf", "--file", "mmproj-f16.gguf", "--file",
                       "q4_k_m", "--to", str(both), *location]) == 0
    assert sorted(directory_snapshot(both)) == ["mmproj-f16.gguf", "model-Q4_K_M.gguf"]

    capsys.readouterr()
    assert vlmrl_main(["pull", "--what", "gguf", "--file", "Q8_0", "--to",
                       str(tmp_path / "none"), *location]) == 1
    error = capsys.readouterr().err
    assert "no gguf files matching 'Q8_0'" in error and "model-Q4_K_M.gguf" in error
    assert not (tmp_path / "none").exists()
    with pytest.raises(SystemExit) as usage:
        vlmrl_main(["pull", "--file", "Q4_K_M", "--to", str(tmp_path / "x"), *location])
    assert usage.value.code == 2


def test_versions_lists_an_invalid_release_with_its_problem(
    s3_server: MotoServer, release: str, capsys: pytest.CaptureFixture[str]
) -> None:
    put(s3_server, release, f"{PREFIX}/v0/manifest.json", b"not json")
    put(s3_server, release, f"{PREFIX}/bad..name/manifest.json", b"{}")
    assert vlmrl_main(["versions", *location_args(s3_server, release)]) == 0
    rows = {line[2:].split()[0]: line for line in capsys.readouterr().out.splitlines()[3:]}
    assert set(rows) == {"v0", "bad..name", "v1"}
    assert "invalid: " in rows["v0"] and "is not valid JSON" in rows["v0"]
    assert "invalid: invalid version name" in rows["bad..name"]
    assert rows["v1"].startswith("* ")
    assert printable("red \x1b[31m text\n") == "red ?[31m text?"


# --------------------------------------------------------------------------- upload


def test_latest_moves_only_forward_unless_promoted(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    bucket = f"forward-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    project = make_project(tmp_path, {})
    publish_project(project, upload_params(s3_server, bucket, version="v1"))
    publish_project(project, upload_params(s3_server, bucket, version="v2"))
    assert latest_version(s3_server, bucket) == "v2"

    again = publish_project(project, upload_params(s3_server, bucket, version="v1"))
    assert (again.uploaded_files, again.latest) == (0, "v2")  # a no-op that keeps latest
    assert latest_version(s3_server, bucket) == "v2"

    promoted = publish_project(project, upload_params(s3_server, bucket, version="v1",
                                                      promote=True))
    assert promoted.latest == "v1" and latest_version(s3_server, bucket) == "v1"
    publish_project(project, upload_params(s3_server, bucket, version="v3"))
    assert latest_version(s3_server, bucket) == "v3"

    put(s3_server, bucket, f"{PREFIX}/latest.json", {"version": "../v3"})
    with pytest.raises(PublishError, match="latest.json.*upload.promote: true"):
        publish_project(project, upload_params(s3_server, bucket, version="v4"))
    publish_project(project, upload_params(s3_server, bucket, version="v4", promote=True))
    assert latest_version(s3_server, bucket) == "v4"


@pytest.mark.parametrize("checksum", [True, False])
def test_uploads_carry_a_sha256_checksum_unless_turned_off(
    s3_server: MotoServer, tmp_path: Path, checksum: bool
) -> None:
    bucket = f"checksum-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    project = make_project(tmp_path, {})
    publish_project(project, upload_params(s3_server, bucket, version="v1", checksum=checksum))
    for key in (f"{PREFIX}/v1/adapter/adapter_config.json", f"{PREFIX}/v1/manifest.json"):
        head = s3_server.client().head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert ("ChecksumSHA256" in head) is checksum


def test_upload_refuses_a_file_name_that_pull_would_refuse(tmp_path: Path) -> None:
    project = make_project(tmp_path, {"bucket": ""})
    write_bytes(project / "data/models/merged/bad\\name.json", b"{}")
    with pytest.raises(PublishError, match=r"the manifest to publish: files\[\d+\].path"):
        publish_project(project, pub.UploadParams())


@pytest.mark.parametrize(
    ("values", "message"),
    [({"checksum": "yes"}, "upload.checksum: must be true or false, got 'yes'"),
     ({"promote": 1}, "upload.promote: must be true or false, got 1"),
     ({"max_attempts": 0}, "upload.max_attempts: input should be greater than or equal to 1, got 0"),
     ({"multipart_threshold_mb": 1},
      "upload.multipart_threshold_mb: input should be greater than or equal to 5, got 1"),
     ({"threads": 4}, "upload has unknown keys ['threads']")],
)
def test_upload_params_errors_are_params_errors(values: dict, message: str) -> None:
    with pytest.raises(ParamsError, match="params.yaml") as refused:
        pub.UploadParams.from_params(values)
    assert message in str(refused.value)
    assert pub.UploadParams.from_params({}).checksum is True


# --------------------------------------------------------------------------- CLI weight


PROBE = """
import json, sys, time
start = time.perf_counter()
import boto3, vlmrl.cli, vlmrl.publish.cli
imported = time.perf_counter() - start
location = sys.argv[1:]
codes = [vlmrl.cli.main(["versions", *location]),
         vlmrl.cli.main(["pull", "--what", "adapter", "--to", "pulled", *location])]
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(json.dumps({"import_s": imported, "codes": codes, "heavy": heavy}))
"""


def test_pull_and_versions_import_neither_torch_nor_transformers(
    s3_server: MotoServer, release: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(
        [sys.executable, "-c", PROBE, *location_args(s3_server, release)],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    probe = json.loads(completed.stdout.strip().splitlines()[-1])
    assert probe["codes"] == [0, 0]
    assert (tmp_path / "pulled" / "adapter_config.json").is_file()
    assert probe["heavy"] == []
    with capsys.disabled():
        print(f"\nvlmrl pull / vlmrl versions import in {probe['import_s']:.2f} s "
              "(vlmrl.cli, vlmrl.publish.cli and boto3)")
