"""`.ci/install-chromium`, the part of `.ci/setup --dev` that installs the browser: run as set-up
runs it, with a fake apt-get (and `id`) first on PATH. Under CI a failed install must fail set-up,
since the browser test would otherwise skip and leave CI green; elsewhere it only warns."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_CHROMIUM = ROOT / ".ci" / "install-chromium"


def fake_command(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A PATH entry where `id -u` says root and apt-get logs its calls and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "id", 'if [[ "$1" == -u ]]; then echo 0; else exec /usr/bin/id "$@"; fi')
    fake_command(bin_dir, "apt-get", f'echo "$*" >> {tmp_path / "apt-get.log"}; exit 100')
    (tmp_path / "apt-get.log").touch()  # empty: no call yet
    return bin_dir


def run_install(fake_bin: Path, chromium: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    env |= {"PATH": f"{fake_bin}:{env['PATH']}", "VLMRL_CHROMIUM": str(chromium)}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["bash", str(INSTALL_CHROMIUM)], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def apt_get_calls(fake_bin: Path) -> list[str]:
    """The fake apt-get's calls, one per line of the log the fixture starts empty."""
    return (fake_bin.parent / "apt-get.log").read_text().splitlines()


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_under_ci_a_failed_install_fails_with_a_clear_message(fake_bin, tmp_path, ci):
    completed = run_install(fake_bin, tmp_path / "no-chromium", ci)
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == (
        f"error: apt-get could not install chromium chromium-driver; with CI={ci} the browser "
        "test must run, so set-up fails")
    assert apt_get_calls(fake_bin) == ["update -qq"]


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_outside_ci_a_failed_install_only_warns(fake_bin, tmp_path, ci):
    completed = run_install(fake_bin, tmp_path / "no-chromium", ci)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.strip().splitlines()[-1] == (
        "warning: apt-get could not install chromium chromium-driver: the browser test will be "
        "skipped")
    assert apt_get_calls(fake_bin) == ["update -qq"]


def test_under_ci_an_install_that_leaves_no_binary_fails(fake_bin, tmp_path):
    fake_command(fake_bin, "apt-get", f'echo "$*" >> {tmp_path / "apt-get.log"}')
    chromium = tmp_path / "no-chromium"
    completed = run_install(fake_bin, chromium, "true")
    assert completed.returncode == 1
    assert f"apt-get installed chromium, but {chromium} is still missing" in completed.stderr
    assert apt_get_calls(fake_bin) == ["update -qq", "install -y -qq chromium chromium-driver"]


def test_under_ci_no_root_fails_and_names_the_command(fake_bin, tmp_path):
    fake_command(fake_bin, "id", "echo 1000")
    completed = run_install(fake_bin, tmp_path / "no-chromium", "true")
    assert completed.returncode == 1
    assert "installing it needs root (apt-get install chromium)" in completed.stderr
    assert apt_get_calls(fake_bin) == []


def test_chromium_already_there_installs_nothing(fake_bin, tmp_path):
    chromium = tmp_path / "chromium"
    fake_command(chromium.parent, chromium.name, "exit 0")
    completed = run_install(fake_bin, chromium, "true")
    assert (completed.returncode, completed.stderr) == (0, "")
    assert apt_get_calls(fake_bin) == []


def test_dev_setup_runs_the_install_outside_any_error_swallowing():
    lines = [line.strip() for line in (ROOT / ".ci/setup").read_text().splitlines()]
    calls = [line for line in lines if ".ci/install-chromium" in line and not line.startswith("#")]
    assert calls and all(line.startswith("bash .ci/install-chromium") for line in calls)
    assert not any("||" in line for line in calls)


INSTALL_VEGA = ROOT / ".ci" / "install-vega"


def run_install_vega(fake_bin: Path, tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """.ci/install-vega with an empty cache and an npm that cannot reach its registry."""
    fake_command(fake_bin, "npm", "echo 'npm error network' >&2; exit 1")
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    env |= {"PATH": f"{fake_bin}:{env['PATH']}", "VLMRL_CACHE": str(tmp_path / "cache")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["bash", str(INSTALL_VEGA)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_offline_plots_page_that_cannot_be_built_fails_set_up_under_ci(fake_bin, tmp_path):
    completed = run_install_vega(fake_bin, tmp_path, "true")
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == (
        "error: npm pack vega@5.20.2 failed; with CI=true the offline plots page must be built, "
        "so set-up fails")
    outside = run_install_vega(fake_bin, tmp_path, None)
    assert outside.returncode == 0
    assert outside.stderr.strip().splitlines()[-1] == (
        "warning: npm pack vega@5.20.2 failed: `dvc plots show` will load Vega from its CDN")


def test_setup_runs_the_plots_page_install_outside_any_error_swallowing():
    lines = [line.strip() for line in (ROOT / ".ci/setup").read_text().splitlines()]
    calls = [line for line in lines if ".ci/install-vega" in line and not line.startswith("#")]
    assert calls and not any("||" in line for line in calls)
