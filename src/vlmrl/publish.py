"""Publish a run's artifacts to S3 as a versioned, verifiable release, and fetch releases back.

DVC's remote shares every stage's outputs with people who have the git repo; this module is for
consumers who only have a bucket. It puts the LoRA adapter, the merged model, the GGUF files and
the metrics under `s3://BUCKET/PREFIX/VERSION/` next to a `manifest.json` of sha256 sums. A
version is advertised through `PREFIX/latest.json` only after every object of it (manifest
included) has been verified, so a reader never sees a half-uploaded release; a rerun skips what is
already there and finishes an interrupted upload; a published version is never silently replaced.
Credentials come only from the standard AWS chain, so nothing secret is in params or logs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vlmrl.config import ParamsError, load_params, section
from vlmrl.outputs import atomic_dir

GROUPS = ("adapter", "merged", "gguf", "metrics")
PRODUCING_STAGES = {
    "adapter": "train_gspo",
    "merged": "export",
    "gguf": "export",
    "metrics": "the eval stages (baseline_eval, post_eval, verify_lora)",
}
MANIFEST_METRIC_SECTIONS = ("post_eval", "baseline_eval", "verify_lora")
HEADLINE_METRIC_KEYS = ("accuracy", "exact_match", "pass_rate", "mean_reward", "reward")
TRAIN_LOG_NAME = "train_log.jsonl"
# The stage writes its own summary into the metrics dir; it is an output, never an input.
UPLOAD_METRICS_NAME = "upload.json"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest.json"
RESERVED_VERSIONS = frozenset({"latest"})
MANIFEST_SCHEMA = 1
MIB = 1024 * 1024
MIN_PART_SIZE = 5 * MIB  # S3 rejects multipart parts smaller than this (except the last).
HASH_CHUNK = 8 * MIB
AUTH_ERROR_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "InvalidClientTokenId",
        "403",
        "Forbidden",
    }
)
NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
SAFE_VERSION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+")


class PublishError(RuntimeError):
    """Anything that stops an upload or a pull; the message is meant for the person at the CLI."""


class MissingInputError(PublishError):
    pass


class CredentialsError(PublishError):
    pass


class VersionConflictError(PublishError):
    pass


class IntegrityError(PublishError):
    pass


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str = "us-east-1"

    def key(self, *parts: str) -> str:
        return "/".join(part.strip("/") for part in (self.prefix, *parts) if part.strip("/"))

    def url(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"

    def endpoint_description(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region})"


@dataclass(frozen=True)
class UploadParams:
    """The `upload` section of params.yaml."""

    bucket: str = ""
    prefix: str = "vlmrl/qwen3-vl"
    version: str = ""
    endpoint_url: str = ""
    region: str = "us-east-1"
    overwrite: bool = False
    multipart_threshold_mb: float = 64
    max_attempts: int = 5

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> UploadParams:
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise PublishError(f"unknown keys in params upload section: {', '.join(unknown)}")
        clean = {name: value for name, value in values.items() if value is not None}
        params = cls(**clean)
        if params.multipart_threshold_mb * MIB < MIN_PART_SIZE:
            raise PublishError(
                "upload.multipart_threshold_mb must be at least 5 (S3's part minimum)"
            )
        if params.max_attempts < 1:
            raise PublishError("upload.max_attempts must be at least 1")
        return params

    def location(self) -> S3Location | None:
        if not self.bucket:
            return None
        return S3Location(self.bucket, self.prefix, self.endpoint_url or None, self.region)


# --------------------------------------------------------------------------- local artifacts


@dataclass(frozen=True)
class ArtifactFile:
    group: str
    path: str  # POSIX path relative to the group's directory
    local_path: Path
    size: int
    sha256: str

    def manifest_entry(self) -> dict[str, Any]:
        return {"group": self.group, "path": self.path, "size": self.size, "sha256": self.sha256}


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _group_file_paths(group: str, root: Path) -> list[Path]:
    if group == "metrics":
        candidates = [*root.glob("*.json"), root / TRAIN_LOG_NAME]
        return sorted(p for p in candidates if p.is_file() and p.name != UPLOAD_METRICS_NAME)
    found = [Path(directory) / name for directory, _, names in os.walk(root) for name in names]
    return sorted(p for p in found if p.is_file())


def collect_group(group: str, root: Path) -> list[ArtifactFile]:
    stage = PRODUCING_STAGES[group]
    if not root.is_dir():
        raise MissingInputError(f"missing input directory {root} ({group}); it is made by {stage}")
    paths = _group_file_paths(group, root)
    if not paths:
        raise MissingInputError(f"input directory {root} ({group}) has no files; rerun {stage}")
    return [
        ArtifactFile(group, p.relative_to(root).as_posix(), p, p.stat().st_size, sha256_of_file(p))
        for p in paths
    ]


def collect_artifacts(inputs: Mapping[str, Path]) -> list[ArtifactFile]:
    unknown = sorted(set(inputs) - set(GROUPS))
    if unknown:
        raise PublishError(f"unknown artifact groups: {', '.join(unknown)}")
    return [
        file for group in GROUPS if group in inputs for file in collect_group(group, inputs[group])
    ]


def read_manifest_metrics(metrics_dir: Path | None) -> dict[str, Any]:
    if metrics_dir is None:
        return {}
    sections = {}
    for name in MANIFEST_METRIC_SECTIONS:
        path = metrics_dir / f"{name}.json"
        if path.is_file():
            sections[name] = json.loads(path.read_text())
    return sections


# --------------------------------------------------------------------------- provenance


def params_hash(params: Any) -> str:
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _git(args: Sequence[str], repo_dir: Path) -> str | None:
    try:
        completed = subprocess.run(
            ["git", *args], cwd=repo_dir, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None


def git_revision(repo_dir: Path) -> str | None:
    return _git(["rev-parse", "HEAD"], repo_dir)


def _is_dirty(repo_dir: Path) -> bool:
    return bool(_git(["status", "--porcelain", "--untracked-files=no"], repo_dir))


def _sanitize_version(raw: str) -> str:
    return "".join(char if char in SAFE_VERSION_CHARS else "-" for char in raw).strip("-.")


def validate_version(version: str) -> str:
    if not version or version in RESERVED_VERSIONS or _sanitize_version(version) != version:
        raise PublishError(
            f"invalid upload version {version!r}: use letters, digits and . _ - + only, "
            f"and not {', '.join(sorted(RESERVED_VERSIONS))}"
        )
    return version


def derive_version(
    configured: str, params_digest: str, repo_dir: Path, env: Mapping[str, str] = os.environ
) -> str:
    """params' version, else the exact git tag at HEAD, else $DVC_EXP_NAME, else git-SHORTSHA
    (+ -dirty), else local-PARAMSHASH[:12]. Artifact-registry tags (NAME@vX.Y.Z, read by
    `dvc artifacts get`) name one artifact, not the release, so they are not versions."""
    if configured:
        return validate_version(configured)
    tag = _git(["describe", "--tags", "--exact-match", "--exclude=*@*", "HEAD"], repo_dir)
    if tag:
        return validate_version(_sanitize_version(tag))
    if env.get("DVC_EXP_NAME"):
        return validate_version(_sanitize_version(env["DVC_EXP_NAME"]))
    short_sha = _git(["rev-parse", "--short=12", "HEAD"], repo_dir)
    if short_sha:
        return f"git-{short_sha}" + ("-dirty" if _is_dirty(repo_dir) else "")
    return f"local-{params_digest[:12]}"


def build_manifest(
    files: Sequence[ArtifactFile],
    version: str,
    git_rev: str | None,
    params_digest: str,
    metrics: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "schema": MANIFEST_SCHEMA,
        "version": version,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_revision": git_rev,
        "params_hash": params_digest,
        "metrics": dict(metrics),
        "files": [file.manifest_entry() for file in files],
    }


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


# --------------------------------------------------------------------------- S3 plumbing


def make_s3_client(location: S3Location, max_attempts: int = 5) -> Any:
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {"retries": {"max_attempts": max_attempts, "mode": "standard"}}
    if location.endpoint_url:
        # S3-compatible stores (MinIO, R2, moto) want path-style URLs, and several reject the
        # default CRC trailers that boto3 >= 1.36 adds to every upload.
        options["s3"] = {"addressing_style": "path"}
        options["request_checksum_calculation"] = "when_required"
        options["response_checksum_validation"] = "when_required"
    session = boto3.session.Session(region_name=location.region)
    return session.client("s3", endpoint_url=location.endpoint_url, config=Config(**options))


def transfer_config(multipart_threshold_mb: float) -> Any:
    from boto3.s3.transfer import TransferConfig

    threshold = int(multipart_threshold_mb * MIB)
    return TransferConfig(
        multipart_threshold=threshold, multipart_chunksize=max(threshold, MIN_PART_SIZE)
    )


def _error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _credentials_message(location: S3Location, reason: str) -> str:
    return (
        f"S3 refused access to bucket '{location.bucket}' at {location.endpoint_description()} "
        f"({reason}). Credentials were taken from the standard AWS credential chain "
        "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, or an instance role); "
        "fix them there, never in params.yaml."
    )


@contextlib.contextmanager
def s3_errors(location: S3Location) -> Iterator[None]:
    """Turn botocore's exceptions into PublishErrors that say which bucket and what to fix."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    try:
        yield
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise CredentialsError(
            _credentials_message(location, f"no usable credentials: {exc}")
        ) from None
    except ClientError as exc:
        code = _error_code(exc)
        if code in AUTH_ERROR_CODES:
            reason = (
                code if code.isalpha() else f"HTTP {code}: unknown key, bad secret or no permission"
            )
            raise CredentialsError(_credentials_message(location, reason)) from None
        if code == "NoSuchBucket":
            raise PublishError(
                f"bucket '{location.bucket}' does not exist at {location.endpoint_description()}"
            ) from None
        raise PublishError(f"S3 error on bucket '{location.bucket}': {exc}") from None
    except S3UploadFailedError as exc:
        if any(code in str(exc) for code in AUTH_ERROR_CODES - {"403"}):
            raise CredentialsError(_credentials_message(location, str(exc))) from None
        raise PublishError(f"upload to bucket '{location.bucket}' failed: {exc}") from None
    except EndpointConnectionError as exc:
        raise PublishError(f"cannot reach {location.endpoint_description()}: {exc}") from None
    except BotoCoreError as exc:
        raise PublishError(f"S3 error on bucket '{location.bucket}': {exc}") from None


def head_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if _error_code(exc) in NOT_FOUND_CODES:
            return None
        raise


def read_json_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if _error_code(exc) in NOT_FOUND_CODES:
            return None
        raise
    return json.loads(body)


def object_matches(head: Mapping[str, Any] | None, size: int, sha256: str) -> bool:
    return (
        head is not None
        and head.get("ContentLength") == size
        and head.get("Metadata", {}).get("sha256") == sha256
    )


def check_bucket(client: Any, location: S3Location) -> None:
    """Fail early on a wrong bucket or credentials. A listing rather than head_bucket: HEAD
    answers carry no body, so a refusal would only say '403', not which credential check failed."""
    from botocore.exceptions import ClientError

    try:
        client.list_objects_v2(Bucket=location.bucket, Prefix=location.key(), MaxKeys=1)
    except ClientError as exc:
        if _error_code(exc) in NOT_FOUND_CODES | {"NoSuchBucket"}:
            raise PublishError(
                f"bucket '{location.bucket}' does not exist at {location.endpoint_description()}"
            ) from None
        raise


def _progress_bar(total: int, description: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description)


# --------------------------------------------------------------------------- upload


@dataclass
class UploadResult:
    version: str
    location: S3Location | None
    manifest: dict[str, Any]
    uploaded_files: int = 0
    skipped_files: int = 0
    uploaded_bytes: int = 0

    @property
    def uploaded(self) -> bool:
        return self.location is not None

    @property
    def total_bytes(self) -> int:
        return sum(entry["size"] for entry in self.manifest["files"])

    def summary(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "bucket": self.location.bucket if self.location else None,
            "prefix": self.location.prefix if self.location else None,
            "url": self.location.url(self.version) + "/" if self.location else None,
            "uploaded": self.uploaded,
            "uploaded_files": self.uploaded_files,
            "skipped_files": self.skipped_files,
            "uploaded_bytes": self.uploaded_bytes,
            "total_bytes": self.total_bytes,
            "files": len(self.manifest["files"]),
        }


def _file_index(manifest: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    return {
        f"{entry['group']}/{entry['path']}": (entry["size"], entry["sha256"])
        for entry in manifest.get("files", [])
    }


def differing_files(published: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[str]:
    old, new = _file_index(published), _file_index(candidate)
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def _object_key(location: S3Location, version: str, file: ArtifactFile) -> str:
    return location.key(version, file.group, file.path)


def _verify_uploaded(client: Any, location: S3Location, key: str, size: int, sha256: str) -> None:
    if not object_matches(head_object(client, location.bucket, key), size, sha256):
        raise IntegrityError(
            f"verification failed for s3://{location.bucket}/{key}: size or sha256 metadata differ "
            "from the local file after upload"
        )


def _claim_version(
    client: Any, location: S3Location, manifest: dict[str, Any], overwrite: bool
) -> dict[str, Any]:
    """Return the manifest to publish: the already published one when this is a rerun of the same
    version, the new one otherwise; refuse to replace a different published version."""
    version = manifest["version"]
    manifest_key = location.key(version, MANIFEST_NAME)
    published = read_json_object(client, location.bucket, manifest_key)
    if published is None:
        return manifest
    changed = differing_files(published, manifest)
    if not changed:
        return published
    if not overwrite:
        listed = ", ".join(changed[:20]) + (
            f" and {len(changed) - 20} more" if len(changed) > 20 else ""
        )
        raise VersionConflictError(
            f"version '{version}' is already published at {location.url(version)}/ with different "
            f"files: {listed}. Choose another upload.version, or set upload.overwrite: true."
        )
    # Unpublish first, so that nobody pulls a version that is half old, half new.
    client.delete_object(Bucket=location.bucket, Key=manifest_key)
    return manifest


def _delete_stale_objects(client: Any, location: S3Location, version: str, keep: set[str]) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=location.bucket, Prefix=location.key(version) + "/"):
        for item in page.get("Contents", []):
            if item["Key"] not in keep:
                client.delete_object(Bucket=location.bucket, Key=item["Key"])


def _upload_files(
    client: Any,
    location: S3Location,
    version: str,
    files: Sequence[ArtifactFile],
    params: UploadParams,
    result: UploadResult,
) -> None:
    pending = []
    for file in files:
        key = _object_key(location, version, file)
        if object_matches(head_object(client, location.bucket, key), file.size, file.sha256):
            result.skipped_files += 1
        else:
            pending.append((file, key))
    config = transfer_config(params.multipart_threshold_mb)
    total = sum(file.size for file, _ in pending)
    with _progress_bar(total, f"upload {version}") as progress:
        for file, key in pending:
            client.upload_file(
                str(file.local_path),
                location.bucket,
                key,
                ExtraArgs={"Metadata": {"sha256": file.sha256}},
                Config=config,
                Callback=progress.update,
            )
            _verify_uploaded(client, location, key, file.size, file.sha256)
            result.uploaded_files += 1
            result.uploaded_bytes += file.size


def _put_verified_json(
    client: Any, location: S3Location, key: str, data: Mapping[str, Any]
) -> bool:
    """Put a small JSON object unless an identical one is there; return whether it was put."""
    body = manifest_bytes(data)
    digest = hashlib.sha256(body).hexdigest()
    if object_matches(head_object(client, location.bucket, key), len(body), digest):
        return False
    client.put_object(
        Bucket=location.bucket,
        Key=key,
        Body=body,
        ContentType="application/json",
        Metadata={"sha256": digest},
    )
    _verify_uploaded(client, location, key, len(body), digest)
    return True


def upload_release(
    client: Any,
    location: S3Location,
    files: Sequence[ArtifactFile],
    manifest: dict[str, Any],
    params: UploadParams,
) -> UploadResult:
    version = manifest["version"]
    with s3_errors(location):
        check_bucket(client, location)
        manifest = _claim_version(client, location, manifest, params.overwrite)
        result = UploadResult(version, location, manifest)
        _upload_files(client, location, version, files, params, result)
        manifest_key = location.key(version, MANIFEST_NAME)
        if params.overwrite:
            keep = {_object_key(location, version, file) for file in files} | {manifest_key}
            _delete_stale_objects(client, location, version, keep)
        if _put_verified_json(client, location, manifest_key, manifest):
            result.uploaded_files += 1
        else:
            result.skipped_files += 1
        # Only now, with every object of the version verified, does `latest` move.
        latest = {
            "version": version,
            "created_at": manifest["created_at"],
            "manifest": manifest_key,
        }
        _put_verified_json(client, location, location.key(LATEST_NAME), latest)
    return result


def publish(
    inputs: Mapping[str, Path],
    params: UploadParams,
    *,
    params_digest: str,
    repo_dir: Path = Path("."),
    client: Any = None,
) -> UploadResult:
    """Hash the artifacts, build the manifest and, when a bucket is configured, upload them."""
    version = derive_version(params.version, params_digest, repo_dir)
    files = collect_artifacts(inputs)
    metrics = read_manifest_metrics(inputs.get("metrics"))
    manifest = build_manifest(files, version, git_revision(repo_dir), params_digest, metrics)
    location = params.location()
    if location is None:
        return UploadResult(version, None, manifest)
    client = client or make_s3_client(location, params.max_attempts)
    return upload_release(client, location, files, manifest, params)


# --------------------------------------------------------------------------- pull


@dataclass
class PulledFile:
    path: str  # relative to the destination directory
    size: int


@dataclass
class PullResult:
    version: str
    destination: Path
    files: list[PulledFile] = field(default_factory=list)


def resolve_version(client: Any, location: S3Location, version: str) -> str:
    if version != "latest":
        return validate_version(version)
    latest = read_json_object(client, location.bucket, location.key(LATEST_NAME))
    if latest is None:
        raise PublishError(f"nothing is published under {location.url()}/ (no {LATEST_NAME})")
    return latest["version"]


def read_manifest(client: Any, location: S3Location, version: str) -> dict[str, Any]:
    manifest = read_json_object(client, location.bucket, location.key(version, MANIFEST_NAME))
    if manifest is None:
        raise PublishError(
            f"version '{version}' is not published: no {location.url(version, MANIFEST_NAME)} "
            "(see `vlmrl versions`)"
        )
    return manifest


def _select_entries(manifest: Mapping[str, Any], groups: Sequence[str]) -> list[dict[str, Any]]:
    selected = [entry for entry in manifest["files"] if entry["group"] in groups]
    empty = [group for group in groups if not any(e["group"] == group for e in selected)]
    if len(groups) == 1 and empty:
        raise PublishError(f"version '{manifest['version']}' has no {groups[0]} files")
    return selected


def _check_destination(destination: Path, force: bool) -> None:
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise PublishError(f"{destination} exists and is not a directory")
    if destination.is_dir() and any(destination.iterdir()) and not force:
        raise PublishError(f"{destination} exists and is not empty; pass --force to replace it")


def _download_verified(
    client: Any,
    location: S3Location,
    key: str,
    entry: Mapping[str, Any],
    target: Path,
    config: Any,
    progress: Any,
) -> None:
    from botocore.exceptions import ClientError

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        client.download_file(
            location.bucket, key, str(target), Config=config, Callback=progress.update
        )
    except ClientError as exc:
        if _error_code(exc) in NOT_FOUND_CODES:
            raise IntegrityError(
                f"missing object s3://{location.bucket}/{key} (listed in the manifest)"
            ) from None
        raise
    size, digest = target.stat().st_size, sha256_of_file(target)
    if size != entry["size"] or digest != entry["sha256"]:
        raise IntegrityError(
            f"checksum mismatch for s3://{location.bucket}/{key}: manifest says "
            f"{entry['size']} bytes sha256 {entry['sha256']}, got {size} bytes sha256 {digest}"
        )


def pull(
    client: Any,
    location: S3Location,
    version: str,
    groups: Sequence[str],
    destination: Path,
    *,
    force: bool = False,
    multipart_threshold_mb: float = 64,
) -> PullResult:
    """Download the selected groups of a version, verify every sha256, then rename into place.
    One group lands flat in DESTINATION; several land in DESTINATION/GROUP/ with manifest.json."""
    destination = destination.absolute()
    _check_destination(destination, force)
    with s3_errors(location):
        version = resolve_version(client, location, version)
        manifest = read_manifest(client, location, version)
        entries = _select_entries(manifest, groups)
        with atomic_dir(destination) as staging:
            result = _download_entries(
                client, location, manifest, entries, groups, staging, multipart_threshold_mb
            )
    result.destination = destination
    return result


def _download_entries(
    client: Any,
    location: S3Location,
    manifest: Mapping[str, Any],
    entries: Sequence[Mapping[str, Any]],
    groups: Sequence[str],
    staging: Path,
    multipart_threshold_mb: float,
) -> PullResult:
    flat = len(groups) == 1
    result = PullResult(manifest["version"], staging)
    config = transfer_config(multipart_threshold_mb)
    with _progress_bar(sum(e["size"] for e in entries), f"pull {manifest['version']}") as progress:
        for entry in entries:
            relative = entry["path"] if flat else f"{entry['group']}/{entry['path']}"
            key = location.key(manifest["version"], entry["group"], entry["path"])
            _download_verified(client, location, key, entry, staging / relative, config, progress)
            result.files.append(PulledFile(relative, entry["size"]))
    if not flat:
        (staging / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    return result


# --------------------------------------------------------------------------- versions


@dataclass
class VersionInfo:
    version: str
    created_at: str
    git_revision: str | None
    headline_metrics: dict[str, float]
    is_latest: bool = False


def headline_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One number per eval section: the first well-known key, else its first numeric value."""
    headline = {}
    for metrics_name in MANIFEST_METRIC_SECTIONS:
        values = metrics.get(metrics_name)
        if not isinstance(values, Mapping):
            continue
        numeric = {
            k: v
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        key = next((k for k in HEADLINE_METRIC_KEYS if k in numeric), next(iter(numeric), None))
        if key is not None:
            headline[f"{metrics_name}.{key}"] = numeric[key]
    return headline


def _version_prefixes(client: Any, location: S3Location) -> list[str]:
    root = location.key() + "/" if location.key() else ""
    paginator = client.get_paginator("list_objects_v2")
    found = []
    for page in paginator.paginate(Bucket=location.bucket, Prefix=root, Delimiter="/"):
        found += [
            item["Prefix"][len(root) :].rstrip("/") for item in page.get("CommonPrefixes", [])
        ]
    return found


def list_versions(client: Any, location: S3Location) -> list[VersionInfo]:
    """Published versions (those with a manifest.json), oldest first."""
    with s3_errors(location):
        latest = read_json_object(client, location.bucket, location.key(LATEST_NAME)) or {}
        versions = []
        for name in _version_prefixes(client, location):
            manifest = read_json_object(client, location.bucket, location.key(name, MANIFEST_NAME))
            if manifest is None:
                continue
            versions.append(
                VersionInfo(
                    version=name,
                    created_at=manifest.get("created_at", ""),
                    git_revision=manifest.get("git_revision"),
                    headline_metrics=headline_metrics(manifest.get("metrics", {})),
                    is_latest=name == latest.get("version"),
                )
            )
    return sorted(versions, key=lambda info: (info.created_at, info.version))


# --------------------------------------------------------------------------- CLI


def format_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = [header, ["-" * width for width in widths], *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)).rstrip()
        for line in lines
    )


def _params_upload_section(params_path: Path) -> dict[str, Any]:
    """CLI defaults, when run inside a checkout; elsewhere every location flag is explicit."""
    if not params_path.is_file():
        return {}
    try:
        return section(load_params(params_path), "upload")
    except ParamsError:
        return {}


def _add_location_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bucket", help="default: upload.bucket in ./params.yaml")
    parser.add_argument("--prefix", help="default: upload.prefix in ./params.yaml")
    parser.add_argument(
        "--endpoint-url", help="S3-compatible endpoint; default: upload.endpoint_url"
    )
    parser.add_argument("--region", help="default: upload.region, else us-east-1")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help=argparse.SUPPRESS)


def _location_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[S3Location, UploadParams]:
    section = _params_upload_section(args.params)
    overrides = {
        "bucket": args.bucket,
        "prefix": args.prefix,
        "endpoint_url": args.endpoint_url,
        "region": args.region,
    }
    section.update({name: value for name, value in overrides.items() if value is not None})
    try:
        params = UploadParams.from_mapping(section)
    except (PublishError, TypeError) as exc:
        parser.error(str(exc))
    location = params.location()
    if location is None:
        parser.error(f"--bucket is required (no upload.bucket in {args.params})")
    return location, params


def _run_cli(action: Any) -> int:
    try:
        return action()
    except PublishError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def cli_pull(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vlmrl pull", description="Fetch a published version.")
    parser.add_argument("--version", default="latest", help="a version name, or latest (default)")
    parser.add_argument("--what", choices=[*GROUPS, "all"], default="all")
    parser.add_argument(
        "--to", type=Path, required=True, metavar="DIR", help="destination directory"
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty destination")
    _add_location_arguments(parser)
    args = parser.parse_args(argv)
    location, params = _location_from_args(parser, args)
    groups = list(GROUPS) if args.what == "all" else [args.what]

    def action() -> int:
        client = make_s3_client(location, params.max_attempts)
        result = pull(
            client,
            location,
            args.version,
            groups,
            args.to,
            force=args.force,
            multipart_threshold_mb=params.multipart_threshold_mb,
        )
        rows = [[file.path, format_size(file.size)] for file in result.files]
        print(f"pulled {location.url(result.version)}/ ({args.what}) into {result.destination}")
        print(format_table(["file", "size"], rows))
        return 0

    return _run_cli(action)


def cli_versions(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vlmrl versions", description="List published versions.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_location_arguments(parser)
    args = parser.parse_args(argv)
    location, params = _location_from_args(parser, args)

    def action() -> int:
        versions = list_versions(make_s3_client(location, params.max_attempts), location)
        if args.json:
            print(json.dumps([vars(info) for info in versions], indent=2))
            return 0
        if not versions:
            print(f"no published versions under {location.url()}/")
            return 0
        rows = [
            [
                ("* " if info.is_latest else "  ") + info.version,
                info.created_at,
                (info.git_revision or "-")[:12],
                "  ".join(f"{name}={value:.4g}" for name, value in info.headline_metrics.items())
                or "-",
            ]
            for info in versions
        ]
        print(f"versions under {location.url()}/ (* = latest)")
        print(format_table(["version", "created_at", "git", "metrics"], rows))
        return 0

    return _run_cli(action)
