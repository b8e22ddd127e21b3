"""`vlmrl pull`, `vlmrl versions` and `vlmrl create-bucket`: argument parsing, defaults from
./params.yaml, and tables. Imports nothing heavy, so the commands start fast on a machine that only
consumes releases.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmrl.params import ParamsError, UploadParams, load_params
from vlmrl.publish.errors import PublishError
from vlmrl.publish.manifest import GROUPS
from vlmrl.publish.pull import VersionInfo, list_versions, pull
from vlmrl.publish.s3 import S3Location, create_bucket, make_s3_client, s3_errors, s3_location


def format_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def printable(value: object) -> str:
    """Text from the bucket, with control characters (terminal escapes) shown as '?'."""
    return "".join(char if char.isprintable() else "?" for char in str(value))


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[printable(cell) for cell in row] for row in rows]
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
        return load_params(params_path).section("upload")
    except ParamsError:
        return {}


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description)


def _add_location_arguments(parser: argparse.ArgumentParser, prefix: bool = True) -> None:
    parser.add_argument("--bucket", help="S3 bucket (default: upload.bucket in ./params.yaml)")
    if prefix:
        parser.add_argument(
            "--prefix", help="key prefix of the releases (default: upload.prefix in ./params.yaml)"
        )
    parser.add_argument(
        "--endpoint-url",
        help="S3-compatible endpoint, e.g. MinIO or R2 (default: upload.endpoint_url, else AWS)",
    )
    parser.add_argument("--region", help="S3 region (default: upload.region, else us-east-1)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help=argparse.SUPPRESS)


def _location_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[S3Location, UploadParams]:
    section = _params_upload_section(args.params)
    overrides = {
        "bucket": args.bucket,
        "prefix": getattr(args, "prefix", None),
        "endpoint_url": args.endpoint_url,
        "region": args.region,
    }
    section.update({name: value for name, value in overrides.items() if value is not None})
    try:
        params = UploadParams.from_params(section)
    except ParamsError as exc:
        parser.error(str(exc))
    location = s3_location(params)
    if location is None:
        parser.error(f"--bucket is required (no upload.bucket in {args.params})")
    return location, params


def _run_cli(action: Any) -> int:
    try:
        return action()
    except PublishError as exc:
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 1


def cli_pull(argv: list[str]) -> int:
    """`vlmrl pull`: download a published version (or some of its files) into `--to`, each file
    checked against the manifest before the folder appears; a refusal is one `error:` line.

    Args:
        argv: the command line after `vlmrl pull`.

    Returns:
        The exit status: 0 when pulled, 1 after a publish error.
    """
    parser = _parser(
        "vlmrl pull",
        "Download a published version into DIR; every file is checked against the manifest's "
        "size and sha256 before DIR appears.",
    )
    parser.add_argument(
        "--version", default="latest", help="a published version name, or latest (default: latest)"
    )
    parser.add_argument(
        "--what",
        choices=[*GROUPS, "all"],
        default="all",
        help="which group to fetch; all puts each group in DIR/GROUP/ with manifest.json "
        "(default: all)",
    )
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="NAME",
        help="only this file of the --what group: a file name, a path, or a quant name such as "
        "Q4_K_M; repeatable (default: every file of the group)",
    )
    parser.add_argument(
        "--to", type=Path, required=True, metavar="DIR", help="destination directory (required)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty DIR (default: off)"
    )
    _add_location_arguments(parser)
    args = parser.parse_args(argv)
    if args.file and args.what == "all":
        parser.error("--file picks files of one group: pass --what GROUP too")
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
            files=args.file,
            max_attempts=params.max_attempts,
        )
        rows = [[file.path, format_size(file.size)] for file in result.files]
        print(f"pulled {location.url(result.version)}/ ({args.what}) into {result.destination}")
        print(format_table(["file", "size"], rows))
        return 0

    return _run_cli(action)


def _metrics_cell(info: VersionInfo) -> str:
    if info.problem:
        return f"invalid: {info.problem}"
    return "  ".join(f"{name}={value:.4g}" for name, value in info.headline_metrics.items()) or "-"


def cli_versions(argv: list[str]) -> int:
    """`vlmrl versions`: list the published versions with their headline metrics, marking the
    latest (`--json` for the list as JSON).

    Args:
        argv: the command line after `vlmrl versions`.

    Returns:
        The exit status: 0 when listed, 1 after a publish error.
    """
    parser = _parser(
        "vlmrl versions", "List the published versions, their metrics, and which one is latest."
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of a table (default: off)"
    )
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
                _metrics_cell(info),
            ]
            for info in versions
        ]
        print(f"versions under {location.url()}/ (* = latest)")
        print(format_table(["version", "created_at", "git", "metrics"], rows))
        return 0

    return _run_cli(action)


def cli_create_bucket(argv: list[str]) -> int:
    """`vlmrl create-bucket`: create the bucket that `upload.*` (or the options) name, in its
    region; one that exists already is left as it is.

    Args:
        argv: the command line after `vlmrl create-bucket`.

    Returns:
        The exit status: 0 when the bucket exists afterwards, 1 after a publish error.
    """
    parser = _parser(
        "vlmrl create-bucket",
        "Create the bucket the upload stage publishes to, in its region; a bucket that already "
        "exists is left as it is. (upload.create_bucket: true makes the stage do this itself.)",
    )
    _add_location_arguments(parser, prefix=False)
    args = parser.parse_args(argv)
    location, params = _location_from_args(parser, args)

    def action() -> int:
        client = make_s3_client(location, params.max_attempts)
        with s3_errors(location):
            created = create_bucket(client, location)
        where = f"bucket '{location.bucket}' at {location.endpoint_description()}"
        print(f"created {where}" if created else f"{where} already exists; nothing to do")
        return 0

    return _run_cli(action)
