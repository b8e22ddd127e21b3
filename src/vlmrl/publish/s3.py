"""The S3 side of publishing and pulling: where a release lives, the boto3 client, and botocore's
exceptions turned into PublishErrors that name the bucket and what to fix, and reads that trust
nothing: JSON objects are read up to a bound and parsed by the schema, files are streamed never
past their manifest size and checked against its sha256. boto3 is imported only when a store is
actually used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vlmrl.params import UploadParams
from vlmrl.publish.errors import CredentialsError, IntegrityError, PublishError
from vlmrl.publish.manifest import LATEST_NAME, MANIFEST_NAME
from vlmrl.publish.schema import (
    MAX_JSON_BYTES,
    Latest,
    Manifest,
    ManifestEntry,
    parse_latest,
    parse_manifest,
)

MIB = 1024 * 1024
STREAM_CHUNK = MIB
MIN_PART_SIZE = 5 * MIB  # S3 rejects multipart parts smaller than this (except the last).
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


@dataclass(frozen=True)
class S3Location:
    """Where releases live: a bucket, the prefix the versions sit under, and the endpoint (an
    S3-compatible store's URL, or None for AWS) and region."""

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


def make_s3_client(location: S3Location, max_attempts: int = 5) -> Any:
    """A boto3 S3 client for `location`, with credentials from the standard AWS chain only.

    Args:
        location: the bucket's endpoint and region; an `endpoint_url` (MinIO, R2, moto) gets
            path-style addressing and checksums only where the request requires them.
        max_attempts: attempts per request under botocore's standard retry mode.
    """
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


def error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _credentials_message(location: S3Location, reason: str) -> str:
    return (
        f"S3 refused access to bucket '{location.bucket}' at {location.endpoint_description()} "
        f"({reason}). Credentials were taken from the standard AWS credential chain "
        "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, or an instance role); "
        "fix them there, never in params.yaml."
    )


def missing_bucket_message(location: S3Location, hint: str = "") -> str:
    message = f"bucket '{location.bucket}' does not exist at {location.endpoint_description()}"
    return f"{message}: {hint}" if hint else message


@contextlib.contextmanager
def s3_errors(location: S3Location, missing_bucket_hint: str = "") -> Iterator[None]:
    """Turn botocore's exceptions into PublishErrors that say which bucket and what to fix;
    `missing_bucket_hint` ends the message when the bucket does not exist."""
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
        code = error_code(exc)
        if code in AUTH_ERROR_CODES:
            reason = (
                code if code.isalpha() else f"HTTP {code}: unknown key, bad secret or no permission"
            )
            raise CredentialsError(_credentials_message(location, reason)) from None
        if code == "NoSuchBucket":
            raise PublishError(missing_bucket_message(location, missing_bucket_hint)) from None
        if code == "BucketAlreadyExists":
            raise PublishError(
                f"bucket name '{location.bucket}' is taken by another account at "
                f"{location.endpoint_description()}: bucket names are global, choose another"
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
    """The HeadObject response (size, ETag, metadata), or None when there is no such object."""
    return _unless_missing(client.head_object, bucket, key)


def get_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The GetObject response (its body still unread), or None when there is no such object."""
    return _unless_missing(client.get_object, bucket, key)


def _unless_missing(
    request: Callable[..., dict[str, Any]], bucket: str, key: str
) -> dict[str, Any] | None:
    """`request(Bucket=bucket, Key=key)`, or None where S3 answers that the object is missing."""
    from botocore.exceptions import ClientError

    try:
        return request(Bucket=bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in NOT_FOUND_CODES:
            return None
        raise


def copy_bounded(
    chunks: Iterable[bytes], limit: int, write: Callable[[bytes], Any], source: str
) -> tuple[int, str]:
    """Pass `chunks` to `write` and return (bytes, sha256); stop at the first chunk that takes the
    total past `limit`, before writing it."""
    digest = hashlib.sha256()
    received = 0
    for chunk in chunks:
        received += len(chunk)
        if received > limit:
            raise IntegrityError(
                f"{source} is larger than {limit} bytes; stopped after reading {received}"
            )
        digest.update(chunk)
        write(chunk)
    return received, digest.hexdigest()


def read_small_object(
    client: Any, location: S3Location, key: str, limit: int = MAX_JSON_BYTES
) -> bytes | None:
    response = get_object(client, location.bucket, key)
    if response is None:
        return None
    parts: list[bytes] = []
    source = f"s3://{location.bucket}/{key}"
    with contextlib.closing(response["Body"]) as body:
        copy_bounded(body.iter_chunks(STREAM_CHUNK), limit, parts.append, source)
    return b"".join(parts)


def read_latest(client: Any, location: S3Location) -> Latest | None:
    body = read_small_object(client, location, location.key(LATEST_NAME))
    return None if body is None else parse_latest(body, location.url(LATEST_NAME))


def read_manifest(
    client: Any, location: S3Location, version: str
) -> tuple[Manifest, bytes] | None:
    """The version's manifest, validated and checked to name the version it is stored under, with
    the bytes it was parsed from; None when the version has no manifest."""
    key = location.key(version, MANIFEST_NAME)
    body = read_small_object(client, location, key)
    if body is None:
        return None
    manifest = parse_manifest(body, location.url(version, MANIFEST_NAME))
    if manifest.version != version:
        raise IntegrityError(
            f"{location.url(version, MANIFEST_NAME)}: version = {manifest.version!r}: the manifest "
            f"is stored under version {version!r}"
        )
    return manifest, body


def _stream_errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    return ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError


def download_verified(
    client: Any,
    bucket: str,
    key: str,
    entry: ManifestEntry,
    target: Path,
    progress: Any,
    attempts: int = 5,
) -> None:
    """Stream the object into `target` (which must not exist), never past the manifest's size,
    and check its size and sha256; a dropped connection restarts the file, `attempts` times."""
    failure: Exception | None = None
    for _attempt in range(attempts):
        try:
            _download_once(client, bucket, key, entry, target, progress)
            return
        except _stream_errors() as exc:
            target.unlink(missing_ok=True)
            failure = exc
    raise PublishError(f"download of s3://{bucket}/{key} failed {attempts} times: {failure}")


def _download_once(
    client: Any, bucket: str, key: str, entry: ManifestEntry, target: Path, progress: Any
) -> None:
    url = f"s3://{bucket}/{key}"
    response = get_object(client, bucket, key)
    if response is None:
        raise IntegrityError(f"missing object {url} (listed in the manifest)")
    with contextlib.closing(response["Body"]) as body:
        announced = response.get("ContentLength")
        if isinstance(announced, int) and announced > entry.size:
            raise IntegrityError(
                f"{url} is larger than its manifest size: the store has {announced} bytes, the "
                f"manifest says {entry.size}"
            )
        with target.open("xb") as handle:
            write = functools.partial(_write_counted, handle, progress)
            source = f"{url} (manifest size {entry.size})"
            size, digest = copy_bounded(body.iter_chunks(STREAM_CHUNK), entry.size, write, source)
    if (size, digest) != (entry.size, entry.sha256):
        raise IntegrityError(
            f"checksum mismatch for {url}: manifest says {entry.size} bytes sha256 "
            f"{entry.sha256}, got {size} bytes sha256 {digest}"
        )


def _write_counted(handle: BinaryIO, progress: Any, chunk: bytes) -> None:
    handle.write(chunk)
    progress.update(len(chunk))


def object_matches(head: Mapping[str, Any] | None, size: int, sha256: str) -> bool:
    return (
        head is not None
        and head.get("ContentLength") == size
        and head.get("Metadata", {}).get("sha256") == sha256
    )


def bucket_exists(client: Any, location: S3Location) -> bool:
    """Fails early on wrong credentials. A listing rather than head_bucket: HEAD answers carry
    no body, so a refusal would only say '403', not which credential check failed."""
    from botocore.exceptions import ClientError

    try:
        client.list_objects_v2(Bucket=location.bucket, Prefix=location.key(), MaxKeys=1)
    except ClientError as exc:
        if error_code(exc) in NOT_FOUND_CODES | {"NoSuchBucket"}:
            return False
        raise
    return True


def check_bucket(client: Any, location: S3Location, missing_bucket_hint: str = "") -> None:
    if not bucket_exists(client, location):
        raise PublishError(missing_bucket_message(location, missing_bucket_hint))


def create_bucket(client: Any, location: S3Location) -> bool:
    """Create the bucket in the location's region; False when it already exists (and is ours)."""
    from botocore.exceptions import ClientError

    if bucket_exists(client, location):
        return False
    region = {} if location.region == "us-east-1" else {
        "CreateBucketConfiguration": {"LocationConstraint": location.region}}
    try:
        client.create_bucket(Bucket=location.bucket, **region)
    except ClientError as exc:
        if error_code(exc) == "BucketAlreadyOwnedByYou":  # created meanwhile by another run
            return False
        raise
    return True


def progress_bar(total: int, description: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description)


def s3_location(params: UploadParams) -> S3Location | None:
    """Where `params` publish to; None without a bucket (the stage then writes the manifest
    locally and uploads nothing)."""
    if not params.bucket:
        return None
    return S3Location(params.bucket, params.prefix, params.endpoint_url or None, params.region)
