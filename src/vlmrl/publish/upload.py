"""Publish a run's artifacts to S3 as a versioned, verifiable release.

It puts the LoRA adapter, the merged model, the GGUF files and the metrics under
`s3://BUCKET/PREFIX/VERSION/` next to a `manifest.json` of sha256 sums. A version is advertised
through `PREFIX/latest.json` only after every object of it (manifest included) has been verified,
so a reader never sees a half-uploaded release; a rerun skips what is already there and finishes
an interrupted upload; a published version is never silently replaced. Objects go up with
`ChecksumAlgorithm=SHA256`, so the store itself refuses a body corrupted on the way (param
`upload.checksum` turns it off for stores that do not support it), and `latest` only moves
forward, to a manifest created later than the one it names, unless `upload.promote` asks.
A missing bucket is an error that says how to create it (`vlmrl create-bucket`, or
`upload.create_bucket: true` to create it here), and a version named `-dirty` (the working tree
differed from its commit) is published with a warning first.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vlmrl.models.portable import machine_values_in
from vlmrl.params import UploadParams
from vlmrl.publish.errors import IntegrityError, PublishError, VersionConflictError
from vlmrl.publish.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    ArtifactFile,
    build_manifest,
    check_publishable,
    collect_artifacts,
    derive_version,
    git_revision,
    local_artifact,
    manifest_bytes,
    read_manifest_metrics,
    replace_file,
    validate_version,
)
from vlmrl.publish.provenance import built_from
from vlmrl.publish.s3 import (
    S3Location,
    check_bucket,
    create_bucket,
    head_object,
    make_s3_client,
    object_matches,
    progress_bar,
    read_latest,
    read_manifest,
    s3_errors,
    s3_location,
    transfer_config,
)
from vlmrl.publish.schema import manifest_created_at

MODEL_CARD_NAME = "README.md"  # in the merged group, where the Hugging Face tools look for it
DIRTY_SUFFIX = "-dirty"
CREATE_BUCKET_HINT = (
    "create it with `vlmrl create-bucket` (bucket, endpoint and region from params.yaml), or set "
    "upload.create_bucket: true to let the upload stage create it"
)


@dataclass
class UploadResult:
    """Counts are of the release's files (the manifest's entries): uploaded + skipped = files.
    manifest.json itself is reported apart, in `manifest_uploaded`."""

    version: str
    location: S3Location | None
    manifest: dict[str, Any]
    uploaded_files: int = 0
    skipped_files: int = 0  # already in the bucket with the same size and sha256
    uploaded_bytes: int = 0
    manifest_uploaded: bool = False  # False: the identical manifest was already there
    bucket_created: bool = False
    latest: str | None = None  # the version `latest` names after the upload
    already_published: bool = False  # the version was published from the same inputs: no-op

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
            "manifest_uploaded": self.manifest_uploaded,
            "latest": self.latest,
            "already_published": self.already_published,
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
    try:
        stored = read_manifest(client, location, version)
    except PublishError as invalid:
        if not overwrite:
            raise VersionConflictError(
                f"version '{version}' is already published with an invalid manifest ({invalid}). "
                "Choose another upload.version, or set upload.overwrite: true."
            ) from None
        client.delete_object(Bucket=location.bucket, Key=manifest_key)
        return manifest
    if stored is None:
        return manifest
    published = json.loads(stored[1])
    changed = differing_files(published, manifest)
    if not changed or same_inputs(published, manifest):
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


def same_inputs(published: Mapping[str, Any], candidate: Mapping[str, Any]) -> bool:
    """Whether both manifests say they were built from the same code, data and params (a rerun
    of an unchanged pipeline, whose files may differ in the last bits)."""
    return (published.get("built_from") is not None
            and published.get("built_from") == candidate.get("built_from")
            and published.get("params_hash") == candidate.get("params_hash"))


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
    with progress_bar(total, f"upload {version}") as progress:
        for file, key in pending:
            client.upload_file(
                str(file.local_path),
                location.bucket,
                key,
                ExtraArgs={"Metadata": {"sha256": file.sha256}, **_checksum_args(params)},
                Config=config,
                Callback=progress.update,
            )
            _verify_uploaded(client, location, key, file.size, file.sha256)
            result.uploaded_files += 1
            result.uploaded_bytes += file.size


def _checksum_args(params: UploadParams) -> dict[str, str]:
    """Asks boto3 to send the body's SHA256, so that the store refuses a corrupted body."""
    return {"ChecksumAlgorithm": "SHA256"} if params.checksum else {}


def _put_verified_json(
    client: Any, location: S3Location, key: str, data: Mapping[str, Any], params: UploadParams
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
        **_checksum_args(params),
    )
    _verify_uploaded(client, location, key, len(body), digest)
    return True


def latest_after(
    client: Any, location: S3Location, manifest: Mapping[str, Any], promote: bool
) -> str:
    """The version `latest` should name once this manifest is published: this one, unless
    `latest` names a version whose manifest was created later (and `promote` is off)."""
    if promote:
        return manifest["version"]
    try:
        current = read_latest(client, location)
    except PublishError as invalid:
        raise PublishError(
            f"{invalid}; set upload.promote: true (or pass --promote) to replace it"
        ) from None
    if current is None or current.version == manifest["version"]:
        return manifest["version"]
    try:
        stored = read_manifest(client, location, current.version)
    except PublishError:  # latest names a release nobody can pull: move it to this one
        return manifest["version"]
    if stored is None or manifest_created_at(manifest) >= stored[0].created_at:
        return manifest["version"]
    return current.version


def upload_release(
    client: Any,
    location: S3Location,
    files: Sequence[ArtifactFile],
    manifest: dict[str, Any],
    params: UploadParams,
) -> UploadResult:
    """Publish `files` and their manifest as `manifest["version"]` under `location`: claim the
    version, upload what the store does not hold yet (each object checked after it lands), then
    the manifest, then move `latest.json` where `latest_after` says. A version already published
    from the same inputs is left untouched.

    Args:
        client: a boto3 S3 client (`make_s3_client`).
        location: the bucket and prefix the release goes under.
        files: the release's files (`collect_artifacts`).
        manifest: the manifest `build_manifest` made of `files`.
        params: the upload section: bucket creation, overwrite, promote, checksums, part size.
    """
    version = manifest["version"]
    with s3_errors(location, CREATE_BUCKET_HINT):
        if params.create_bucket:
            created = create_bucket(client, location)
        else:
            check_bucket(client, location, CREATE_BUCKET_HINT)
            created = False
        candidate = manifest
        manifest = _claim_version(client, location, manifest, params.overwrite)
        latest = latest_after(client, location, manifest, params.promote)
        result = UploadResult(version, location, manifest, latest=latest, bucket_created=created)
        if manifest is not candidate and differing_files(manifest, candidate):
            # Published from the same inputs: the release stays as it is, bit for bit.
            result.already_published = True
            result.skipped_files = len(manifest["files"])
            return result
        _upload_files(client, location, version, files, params, result)
        manifest_key = location.key(version, MANIFEST_NAME)
        if params.overwrite:
            keep = {_object_key(location, version, file) for file in files} | {manifest_key}
            _delete_stale_objects(client, location, version, keep)
        result.manifest_uploaded = _put_verified_json(
            client, location, manifest_key, manifest, params
        )
        if latest == version:
            # Only now, with every object of the version verified, does `latest` move.
            pointer = {
                "version": version,
                "created_at": manifest["created_at"],
                "manifest": manifest_key,
            }
            _put_verified_json(client, location, location.key(LATEST_NAME), pointer, params)
    return result


def check_portable(files: Sequence[ArtifactFile]) -> None:
    """Refuses a release whose text files carry a value of this machine (home or cache path,
    host name, run settings such as local_files_only)."""
    found = machine_values_in((file.local_path for file in files), text_only=True)
    if found:
        raise PublishError("the release names this machine, which means nothing where it is "
                           "pulled; rerun the stage that wrote the file:\n  "
                           + "\n  ".join(found[:20]))


def dirty_version_warning(version: str) -> str | None:
    if not version.endswith(DIRTY_SUFFIX):
        return None
    return (
        f"warning: publishing version '{version}': the working tree differed from its commit "
        "(a `dvc repro` that rewrote dvc.lock counts), so the version names no exact commit; for "
        "one that does, commit and rerun `dvc repro upload`, or set upload.version"
    )


def check_upload_params(params: UploadParams) -> None:
    """What a wrong upload setting would fail on only after the cards are rendered and the
    artifacts hashed: a version name pull could not take, an endpoint that is no URL."""
    if params.version:
        validate_version(params.version, "params.yaml upload.version")
    url = urlsplit(params.endpoint_url)
    if params.endpoint_url and (url.scheme not in ("http", "https") or not url.netloc):
        raise PublishError(f"params.yaml upload.endpoint_url: {params.endpoint_url!r} is not an "
                           "http(s) URL (e.g. http://127.0.0.1:9000); empty: AWS")


def publish(
    inputs: Mapping[str, Path],
    params: UploadParams,
    *,
    params_digest: str,
    repo_dir: Path = Path("."),
    client: Any = None,
    model_card: Path | None = None,
    cards: Mapping[str, Path] | None = None,
) -> UploadResult:
    """Hash the artifacts, build the manifest and, when a bucket is configured, upload them.
    `cards` (group -> file) are published as each group's README.md, replacing one the folder
    holds; `model_card` is the merged group's. A text file that names this machine (a local
    path, `local_files_only`: `vlmrl.models.portable`) stops the upload before anything is sent."""
    check_upload_params(params)
    version = derive_version(params.version, params_digest, repo_dir)
    files = collect_artifacts(inputs)
    cards = {**({"merged": model_card} if model_card is not None else {}), **(cards or {})}
    for group, card in cards.items():
        files = replace_file(files, local_artifact(group, MODEL_CARD_NAME, card))
    check_portable(files)
    metrics = read_manifest_metrics(inputs.get("metrics"))
    manifest = build_manifest(files, version, git_revision(repo_dir), params_digest, metrics,
                              built_from(repo_dir))
    check_publishable(manifest)
    location = s3_location(params)
    if location is None:
        return UploadResult(version, None, manifest)
    warning = dirty_version_warning(version)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    client = client or make_s3_client(location, params.max_attempts)
    return upload_release(client, location, files, manifest, params)
