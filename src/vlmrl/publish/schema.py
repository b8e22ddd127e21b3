"""What pull and upload accept from a bucket. A bucket is shared storage: whoever can write to it
must not gain a write on the machine that pulls from it, so `manifest.json` and `latest.json` are
parsed into these models before anything is acted upon: known groups only, sha256 as 64 lowercase
hex digits, sizes as bounded integers, file paths that are plain relative POSIX paths, each file
once, version names by the rule that upload names versions with. A violation is one line naming
the field and the value. Unchecked, a crafted manifest path or version name joined with the
staging folder could write outside `--to`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    model_validator,
)

from vlmrl.publish.errors import IntegrityError, PublishError

Group = Literal["adapter", "merged", "gguf", "metrics"]
GROUPS: tuple[str, ...] = get_args(Group)
LATEST = "latest"  # names the newest version in `vlmrl pull --version`; never a version itself
MANIFEST_SCHEMA = 1
SAFE_VERSION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+")
MAX_VERSION_LENGTH = 128
MAX_PATH_LENGTH = 1024
MAX_FILE_BYTES = 2**40  # 1 TiB: far above any model file, far below what would fill a disk unseen
MAX_FILES = 100_000
MAX_JSON_BYTES = 64 * 1024 * 1024  # manifest.json and latest.json are read whole
DRIVE_LETTER = re.compile(r"^[A-Za-z]:")


def version_problem(version: str) -> str | None:
    """Why `version` cannot name a release (as a bucket folder and on the command line), or None."""
    if not version:
        return "is empty"
    if version == LATEST:
        return f"'{LATEST}' is reserved for the newest version"
    if len(version) > MAX_VERSION_LENGTH:
        return f"is longer than {MAX_VERSION_LENGTH} characters"
    if not set(version) <= SAFE_VERSION_CHARS:
        return "use letters, digits and . _ - + only"
    if version[0] in ".-" or version[-1] in ".-" or ".." in version:
        return "must not start or end with . or -, nor contain '..'"
    return None


def path_problem(path: str) -> str | None:
    """Why `path` is not a plain relative POSIX file path inside its folder, or None."""
    checks = (
        (not path, "is empty"),
        (len(path) > MAX_PATH_LENGTH, f"is longer than {MAX_PATH_LENGTH} characters"),
        ("\x00" in path, "contains NUL"),
        (any(ord(char) < 32 or ord(char) == 127 for char in path), "contains a control character"),
        ("\\" in path, "contains a backslash"),
        (path.startswith("/"), "is absolute"),
        (bool(DRIVE_LETTER.match(path)), "starts with a drive letter"),
        ("" in path.split("/"), "has an empty part (// or a trailing /)"),
        (".." in path.split("/"), "has a '..' part"),
        ("." in path.split("/"), "has a '.' part"),
    )
    return next((problem for failed, problem in checks if failed), None)


def _valid(problem_of: Any) -> Any:
    def check(value: str) -> str:
        problem = problem_of(value)
        if problem:
            raise ValueError(problem)
        return value

    return AfterValidator(check)


VersionName = Annotated[str, _valid(version_problem)]
ReleasePath = Annotated[str, _valid(path_problem)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
GitRevision = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{7,64}$")]
FileSize = Annotated[StrictInt, Field(ge=0, le=MAX_FILE_BYTES)]


class _Stored(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class ManifestEntry(_Stored):
    group: Group
    path: ReleasePath  # relative to the group's folder
    size: FileSize
    sha256: Sha256

    @property
    def name(self) -> str:
        return f"{self.group}/{self.path}"


class Manifest(_Stored):
    manifest_schema: Literal[1] = Field(alias="schema")
    version: VersionName
    created_at: AwareDatetime
    git_revision: GitRevision | None
    params_hash: Sha256
    metrics: dict[str, Any]  # shown by `vlmrl versions`, never acted upon
    files: Annotated[list[ManifestEntry], Field(min_length=1, max_length=MAX_FILES)]
    # What the release was built from (vlmrl.publish.provenance); None: a run outside DVC.
    built_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _each_path_once(self) -> Manifest:
        """No file twice, and no file where another one needs a folder."""
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.files):
            if entry.name in seen:
                raise ValueError(
                    f"files[{index}].path {entry.path!r} ({entry.group}) is listed twice "
                    f"(files[{seen[entry.name]}])"
                )
            seen[entry.name] = index
        for index, entry in enumerate(self.files):
            folders = PurePosixPath(entry.name).parents
            clash = next((str(f) for f in folders if str(f) in seen), None)
            if clash is not None:
                raise ValueError(
                    f"files[{index}].path {entry.path!r} ({entry.group}) needs a folder where "
                    f"files[{seen[clash]}] is a file"
                )
        return self


class Latest(_Stored):
    version: VersionName
    created_at: AwareDatetime
    manifest: Annotated[str, StringConstraints(max_length=MAX_PATH_LENGTH)]  # informational


def _where(location: Sequence[int | str]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 240 else text[:237] + "..."


def describe(error: ValidationError, source: str) -> str:
    """One line naming the field, the value and the rule it breaks, for the first problem."""
    problems = error.errors(include_url=False)
    first = problems[0]
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    if first["type"] == "json_invalid":
        return f"{source} is not valid JSON: {first['msg']}"
    message = str(first["msg"]).removeprefix("Value error, ")
    where = _where(first["loc"])
    if not where:
        return f"{source}: {message}{more}"
    if first["type"] == "missing":
        return f"{source}: {where} is missing{more}"
    return f"{source}: {where} = {_shown(first['input'])}: {message}{more}"


def parse_manifest(body: bytes, source: str) -> Manifest:
    try:
        return Manifest.model_validate_json(body)
    except ValidationError as error:
        raise PublishError(describe(error, source)) from None


def parse_latest(body: bytes, source: str) -> Latest:
    try:
        return Latest.model_validate_json(body)
    except ValidationError as error:
        raise PublishError(describe(error, source)) from None


def manifest_created_at(manifest: Mapping[str, Any]) -> datetime:
    return datetime.fromisoformat(manifest["created_at"])


def safe_join(root: Path, relative: str) -> Path:
    """`root / relative`, refused unless it still lies inside `root` once resolved."""
    problem = path_problem(relative)
    if problem:
        raise IntegrityError(f"path {relative!r} {problem}")
    target = root / PurePosixPath(relative)
    resolved_root = root.resolve()
    resolved = target.resolve()
    if resolved == resolved_root or not resolved.is_relative_to(resolved_root):
        raise IntegrityError(f"path {relative!r} resolves to {resolved}, outside {root}")
    return target
