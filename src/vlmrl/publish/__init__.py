"""Publish a run's artifacts to S3 as a versioned, verifiable release, and fetch releases back.

DVC's remote shares every stage's outputs with people who have the git repo; this package is for
consumers who only have a bucket. `manifest` says what a release holds, `s3` talks to the store,
`upload` publishes, `pull` fetches and lists, `cli` is `vlmrl pull` / `versions` /
`create-bucket`, and `model_card` renders the merged model's README. Credentials come only from
the standard AWS chain, so nothing secret is in params or logs.
"""

from vlmrl.publish.cli import cli_create_bucket, cli_pull, cli_versions
from vlmrl.publish.errors import (
    CredentialsError,
    IntegrityError,
    MissingInputError,
    PublishError,
    VersionConflictError,
)
from vlmrl.publish.manifest import (
    GROUPS,
    ArtifactFile,
    build_manifest,
    collect_artifacts,
    derive_version,
    git_revision,
    params_hash,
    validate_version,
)
from vlmrl.publish.pull import PullResult, VersionInfo, headline_metrics, list_versions, pull
from vlmrl.publish.s3 import S3Location, make_s3_client
from vlmrl.publish.upload import UploadParams, UploadResult, publish, upload_release

__all__ = [
    "GROUPS",
    "ArtifactFile",
    "CredentialsError",
    "IntegrityError",
    "MissingInputError",
    "PublishError",
    "PullResult",
    "S3Location",
    "UploadParams",
    "UploadResult",
    "VersionConflictError",
    "VersionInfo",
    "build_manifest",
    "cli_create_bucket",
    "cli_pull",
    "cli_versions",
    "collect_artifacts",
    "derive_version",
    "git_revision",
    "headline_metrics",
    "list_versions",
    "make_s3_client",
    "params_hash",
    "publish",
    "pull",
    "upload_release",
    "validate_version",
]
