"""The S3 side of publishing and pulling: where a release lives, the boto3 client, and botocore's
exceptions turned into PublishErrors that name the bucket and what to fix. boto3 is imported
only when a store is actually used.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vlmrl.publish.errors import CredentialsError, PublishError

MIB = 1024 * 1024
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
        code = error_code(exc)
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
        if error_code(exc) in NOT_FOUND_CODES:
            return None
        raise


def read_json_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if error_code(exc) in NOT_FOUND_CODES:
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
        if error_code(exc) in NOT_FOUND_CODES | {"NoSuchBucket"}:
            raise PublishError(
                f"bucket '{location.bucket}' does not exist at {location.endpoint_description()}"
            ) from None
        raise


def progress_bar(total: int, description: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description)

