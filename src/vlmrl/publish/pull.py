"""Fetch a published release back from S3, verified, and list the published versions.

DVC's remote shares every stage's outputs with people who have the git repo; this is for
consumers who only have a bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.outputs import atomic_dir
from vlmrl.publish.errors import IntegrityError, PublishError
from vlmrl.publish.manifest import (
    LATEST_NAME,
    MANIFEST_METRIC_SECTIONS,
    MANIFEST_NAME,
    manifest_bytes,
    sha256_of_file,
    validate_version,
)
from vlmrl.publish.s3 import (
    NOT_FOUND_CODES,
    S3Location,
    error_code,
    progress_bar,
    read_json_object,
    s3_errors,
    transfer_config,
)

HEADLINE_METRIC_KEYS = ("accuracy", "exact_match", "pass_rate", "mean_reward", "reward")


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
        if error_code(exc) in NOT_FOUND_CODES:
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
    with progress_bar(sum(e["size"] for e in entries), f"pull {manifest['version']}") as progress:
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
