"""What a release is made of: the local artifact files with their sha256 sums, the version name,
and the manifest that lists them. Pure file and git work; nothing here talks to S3.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vlmrl.publish.errors import MissingInputError, PublishError
from vlmrl.publish.schema import (
    GROUPS,
    MANIFEST_SCHEMA,
    SAFE_VERSION_CHARS,
    Manifest,
    parse_manifest,
    version_problem,
)

PRODUCING_STAGES = {
    "adapter": "train_gspo",
    "merged": "export",
    "gguf": "export",
    "metrics": "the eval stages (baseline_eval, post_eval, verify_lora)",
}
MANIFEST_METRIC_SECTIONS = ("post_eval", "baseline_eval", "verify_lora")
# The stage writes its own summary into the metrics dir; it is an output, never an input.
UPLOAD_METRICS_NAME = "upload.json"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest.json"
HASH_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------- local artifacts


@dataclass(frozen=True)
class ArtifactFile:
    """One file of a release: its group (`GROUPS`), its path in the group, where it is on this
    machine, and the size and SHA256 the manifest records for it."""

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
        # the headline metrics and the train and SFT logs (JSON lists, for dvc plots)
        return sorted(p for p in root.glob("*.json") if p.is_file() and p.name != UPLOAD_METRICS_NAME)
    found = [Path(directory) / name for directory, _, names in os.walk(root) for name in names]
    return sorted(p for p in found if p.is_file())


def collect_group(group: str, root: Path) -> list[ArtifactFile]:
    stage = PRODUCING_STAGES[group]
    if not root.is_dir():
        raise MissingInputError(f"missing input directory {root} ({group}); it is made by {stage}")
    paths = _group_file_paths(group, root)
    if not paths:
        raise MissingInputError(f"input directory {root} ({group}) has no files; rerun {stage}")
    return [local_artifact(group, p.relative_to(root).as_posix(), p) for p in paths]


def local_artifact(group: str, path: str, local_path: Path) -> ArtifactFile:
    return ArtifactFile(
        group, path, local_path, local_path.stat().st_size, sha256_of_file(local_path)
    )


def replace_file(files: Sequence[ArtifactFile], replacement: ArtifactFile) -> list[ArtifactFile]:
    """`files` with `replacement` instead of the file of the same group and path, or added."""
    kept = [f for f in files if (f.group, f.path) != (replacement.group, replacement.path)]
    return sorted([*kept, replacement], key=lambda f: (GROUPS.index(f.group), f.path))


def collect_artifacts(inputs: Mapping[str, Path]) -> list[ArtifactFile]:
    """Every file of the release's groups, with its size and SHA256, in `GROUPS` order.

    Args:
        inputs: each group's local folder (`adapter`, `merged`, `gguf`, `metrics`); a group may
            be left out, a name outside `GROUPS` is refused.
    """
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
    """The SHA256 of `params` (params.yaml as a mapping) in canonical JSON: the same params give
    the same digest on any machine, whatever their key order."""
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
    """The commit checked out in `repo_dir`, or None outside a git checkout (or without git)."""
    return _git(["rev-parse", "HEAD"], repo_dir)


def _is_dirty(repo_dir: Path) -> bool:
    return bool(_git(["status", "--porcelain", "--untracked-files=no"], repo_dir))


def _sanitize_version(raw: str) -> str:
    return "".join(char if char in SAFE_VERSION_CHARS else "-" for char in raw).strip("-.")


def validate_version(version: str, what: str = "upload version") -> str:
    """The one rule for version names: upload names versions by it, pull checks `--version` and
    `latest.json` by it (through the schema's VersionName)."""
    problem = version_problem(version)
    if problem:
        raise PublishError(f"invalid {what} {version!r}: {problem}")
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
    built_from: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The release's manifest. `built_from`: what the run was built from
    (vlmrl.publish.provenance), recorded where DVC ran it."""
    return {
        "schema": MANIFEST_SCHEMA,
        "version": version,
        # Microseconds, so that two uploads in one second still order `latest`.
        "created_at": datetime.now(UTC).isoformat(timespec="microseconds"),
        "git_revision": git_rev,
        "params_hash": params_digest,
        "metrics": dict(metrics),
        "files": [file.manifest_entry() for file in files],
        **({"built_from": dict(built_from)} if built_from is not None else {}),
    }


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def check_publishable(manifest: Mapping[str, Any]) -> Manifest:
    """Upload publishes only what pull accepts (pull refuses, say, a file name with a backslash)."""
    return parse_manifest(manifest_bytes(manifest), "the manifest to publish")
