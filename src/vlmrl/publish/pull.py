"""Fetch a published release back from S3, verified, and list the published versions.

DVC's remote shares every stage's outputs with people who have the git repo; this is for
consumers who only have a bucket, which pull trusts for nothing: the version name, `latest.json`
and the manifest are validated (vlmrl.publish.schema) before any byte is written, every path is
joined under the staging folder only after checking it stays inside, every object is streamed
never past its manifest size and checked against its sha256, and only a complete, verified
download replaces `--to`. On any failure `--to` is left as it was, the staging folder is removed,
and so are the parent folders the pull created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from vlmrl.outputs import atomic_dir
from vlmrl.publish.errors import PublishError
from vlmrl.publish.manifest import LATEST_NAME, MANIFEST_METRIC_SECTIONS, MANIFEST_NAME
from vlmrl.publish.s3 import (
    S3Location,
    download_verified,
    progress_bar,
    read_latest,
    read_manifest,
    s3_errors,
)
from vlmrl.publish.schema import LATEST, Manifest, ManifestEntry, safe_join, version_problem

MISSING_BUCKET_HINT = (
    "check --bucket and --endpoint-url (defaults: upload.bucket, upload.endpoint_url)"
)
HEADLINE_METRIC_KEYS = ("accuracy", "exact_match", "pass_rate", "mean_reward", "reward")


@dataclass
class PulledFile:
    path: str  # relative to the destination directory
    size: int


@dataclass
class PullResult:
    """What a pull wrote: the version it resolved (`latest` named), the destination folder and
    the files in it."""

    version: str
    destination: Path
    files: list[PulledFile] = field(default_factory=list)


def check_requested_version(version: str) -> str:
    """`--version`: `latest`, or a name by the rule upload names versions with."""
    problem = None if version == LATEST else version_problem(version)
    if problem:
        raise PublishError(f"invalid version {version!r}: {problem}")
    return version


def resolve_version(client: Any, location: S3Location, version: str) -> str:
    if check_requested_version(version) != LATEST:
        return version
    latest = read_latest(client, location)
    if latest is None:
        raise PublishError(f"nothing is published under {location.url()}/ (no {LATEST_NAME})")
    return latest.version


def fetch_manifest(client: Any, location: S3Location, version: str) -> tuple[Manifest, bytes]:
    stored = read_manifest(client, location, version)
    if stored is None:
        raise PublishError(
            f"version '{version}' is not published: no {location.url(version, MANIFEST_NAME)} "
            "(see `vlmrl versions`)"
        )
    return stored


def _matches(entry: ManifestEntry, wanted: str) -> bool:
    """A file name or path, or a quant name: the last `-` part of the file's stem (Q4_K_M)."""
    path = PurePosixPath(entry.path)
    quant = path.stem.rsplit("-", 1)[-1]
    return wanted in (entry.path, path.name) or quant.lower() == wanted.lower()


def select_entries(
    manifest: Manifest, groups: Sequence[str], wanted: Sequence[str] = ()
) -> list[ManifestEntry]:
    """The entries of `groups`; with `wanted` (one group only) just the files it names."""
    selected = [entry for entry in manifest.files if entry.group in groups]
    if len(groups) == 1 and not selected:
        raise PublishError(f"version '{manifest.version}' has no {groups[0]} files")
    if not wanted:
        return selected
    if len(groups) != 1:
        raise PublishError("--file picks files of one group: pass --what GROUP too")
    chosen: list[ManifestEntry] = []
    for name in wanted:
        matches = [entry for entry in selected if _matches(entry, name)]
        if len(matches) != 1:
            found = "no" if not matches else f"{len(matches)}"
            listed = ", ".join(entry.path for entry in selected)
            raise PublishError(
                f"version '{manifest.version}' has {found} {groups[0]} files matching {name!r}; "
                f"pass one of: {listed}"
            )
        chosen += [entry for entry in matches if entry not in chosen]
    return chosen


def _check_destination(destination: Path, force: bool) -> None:
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise PublishError(f"{destination} exists and is not a directory")
    if destination.is_dir() and any(destination.iterdir()) and not force:
        raise PublishError(f"{destination} exists and is not empty; pass --force to replace it")


@contextlib.contextmanager
def _removing_created_parents(directory: Path) -> Iterator[None]:
    """On failure, remove the (then empty) parent folders that did not exist before."""
    missing = [parent for parent in directory.parents if not parent.exists()]
    try:
        yield
    except BaseException:
        for parent in missing:  # deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _layout(entries: Sequence[ManifestEntry], flat: bool) -> list[tuple[ManifestEntry, str]]:
    return [(entry, entry.path if flat else entry.name) for entry in entries]


def pull(
    client: Any,
    location: S3Location,
    version: str,
    groups: Sequence[str],
    destination: Path,
    *,
    force: bool = False,
    files: Sequence[str] = (),
    max_attempts: int = 5,
) -> PullResult:
    """Download the selected groups (or `files` of one group) of a version, verify every sha256,
    then rename into place. One group lands flat in DESTINATION; several land in
    DESTINATION/GROUP/ with manifest.json."""
    destination = destination.absolute()
    check_requested_version(version)
    _check_destination(destination, force)
    with s3_errors(location, MISSING_BUCKET_HINT):
        version = resolve_version(client, location, version)
        manifest, body = fetch_manifest(client, location, version)
        layout = _layout(select_entries(manifest, groups, files), flat=len(groups) == 1)
        for _entry, relative in layout:  # every path checked before the first byte is written
            safe_join(destination, relative)
        with _removing_created_parents(destination), atomic_dir(destination) as staging:
            result = _download_entries(client, location, manifest, layout, staging, max_attempts)
            if len(groups) > 1:
                (staging / MANIFEST_NAME).write_bytes(body)
    result.destination = destination
    return result


def _download_entries(
    client: Any,
    location: S3Location,
    manifest: Manifest,
    layout: Sequence[tuple[ManifestEntry, str]],
    staging: Path,
    max_attempts: int,
) -> PullResult:
    result = PullResult(manifest.version, staging)
    total = sum(entry.size for entry, _ in layout)
    with progress_bar(total, f"pull {manifest.version}") as progress:
        for entry, relative in layout:
            target = safe_join(staging, relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            key = location.key(manifest.version, entry.group, entry.path)
            download_verified(
                client, location.bucket, key, entry, target, progress, attempts=max_attempts
            )
            result.files.append(PulledFile(relative, entry.size))
    return result


# --------------------------------------------------------------------------- versions


@dataclass
class VersionInfo:
    """One published version as `vlmrl versions` lists it: when and from which commit it was
    made, its headline metrics, whether `latest` names it, and why it is not a valid release
    where it is not."""

    version: str
    created_at: str
    git_revision: str | None
    headline_metrics: dict[str, float]
    is_latest: bool = False
    problem: str | None = None  # why this folder of the bucket is not a valid release


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


def _version_info(client: Any, location: S3Location, name: str) -> VersionInfo | None:
    """The version stored under folder `name`; None for a folder with no manifest (an upload in
    progress or interrupted); a VersionInfo with `problem` set for an invalid one."""
    problem = version_problem(name)
    if problem:
        return VersionInfo(name, "", None, {}, problem=f"invalid version name: {problem}")
    try:
        stored = read_manifest(client, location, name)
    except PublishError as invalid:
        return VersionInfo(name, "", None, {}, problem=str(invalid))
    if stored is None:
        return None
    manifest = stored[0]
    return VersionInfo(
        version=name,
        created_at=manifest.created_at.isoformat(),
        git_revision=manifest.git_revision,
        headline_metrics=headline_metrics(manifest.metrics),
    )


def list_versions(client: Any, location: S3Location) -> list[VersionInfo]:
    """Published versions (those with a manifest.json), oldest first; invalid ones are listed
    with their problem."""
    with s3_errors(location, MISSING_BUCKET_HINT):
        try:
            latest = read_latest(client, location)
        except PublishError:
            latest = None
        names = _version_prefixes(client, location)
        found = [_version_info(client, location, name) for name in names]
    versions = [info for info in found if info is not None]
    for info in versions:
        info.is_latest = latest is not None and info.version == latest.version
    return sorted(versions, key=lambda info: (info.created_at, info.version))
