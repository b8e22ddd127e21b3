"""Shared fixtures: a real git + DVC copy of the project in a temporary directory, so stages run
through `dvc repro` exactly as users run them, without touching the checkout. The hooks of
leftover_processes fail a run that leaves a server behind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from leftover_processes import pytest_configure, pytest_sessionfinish  # noqa: F401 - hooks
from project_repo import dvc_env, make_project_repo, run, update_params  # noqa: F401
from project_repo import stage_command as _stage_command
from s3_server import MotoServer, start_moto_server

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TESTMINI = SHARED / "mathvista" / "testmini.json"
HAS_CUDA = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()

# Without a GPU, Triton kernels run under Triton's interpreter (tests/test_nf4_decode.py). It is
# chosen when Triton is imported (its own library functions are made then), so it is set here,
# before any test imports Triton.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server on 127.0.0.1 (tests/s3_server.py), started for the first test that asks
    and shared by the rest of the run; each test makes its own bucket."""
    server = start_moto_server(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


def dvc_repro(repo: Path, *targets: str, check: bool = True, extra: tuple[str, ...] = ()):
    return run(["dvc", "repro", *extra, *targets], repo, check=check)


def kill_repro_when(repo: Path, marker: Path, env: dict[str, str] | None = None,
                    target: str = "train_gspo") -> None:
    """Starts `dvc repro target` and kills its whole process group with SIGKILL once `marker`
    exists (half a second later, so the files written with it land)."""
    import os
    import signal
    import subprocess
    import time

    process = subprocess.Popen(["dvc", "repro", target], cwd=repo, env=env or dvc_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + 400
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert marker.exists(), f"{marker} was not written before the kill"


# The stage tests check mechanics, not learning: a 2-step cold-start SFT and 4 GSPO steps of 4
# prompts' worth of rows keep the shared pipeline short (the default runs the full SFT and GSPO).
# Stage tests check mechanics (clipping, non-zero lora_B, reruns), not learning: after a 2-step
# SFT the format and correctness rewards tie within every group, so no gradient flows; the length
# penalty (unweighted by default) makes completions of one group differ.
TEST_PARAMS = {"sft.args.max_steps": 2, "train.grpo.max_steps": 4, "data.eval_size": 8,
               "train.grpo.per_device_train_batch_size": 4, "train.grpo.num_generations": 4,
               "rewards.weights.length_penalty": 1.0}


@pytest.fixture(scope="session")
def pipeline_repo(tmp_path_factory) -> Path:
    """One project repo per test session, shared by the stage tests; each test reproduces the
    stages it needs (DVC skips what is already done) and must not change params in it."""
    return make_project_repo(tmp_path_factory.mktemp("pipeline") / "repo", TEST_PARAMS)


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    return make_project_repo(tmp_path / "repo", TEST_PARAMS)


@pytest.fixture(scope="session")
def train_set(tmp_path_factory):
    """A tiny prepared train split (8 synthetic problems of 64 px and 4 reading ones) for tests
    that build a trainer in process."""
    from datasets import load_from_disk

    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
    from vlmrl.params import DataParams

    root = tmp_path_factory.mktemp("train-set")
    settings = DataParams(synthetic_size=8, synthetic_read_size=4, eval_size=2, image_size=64,
                          seed=1)
    to_dataset(prepare(load_raw_records(settings), settings).train).save_to_disk(
        str(root / "train"))
    return load_from_disk(str(root / "train"))


def stage_command(name: str, root: Path = ROOT) -> list[str]:
    """dvc.yaml's command for stage `name` as argv (vlmrl's tests/project_repo.py)."""
    return _stage_command(name, root)


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module: the benchmarks are scripts, not a package, and import
    their siblings (doc_blocks, gspo_step) as a script run from benchmarks/ would."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def benchmark_fixture(name: str):
    """A module-scoped fixture whose value is benchmarks/<name>.py (`load_benchmark`); bind it to
    the fixture's name in the test module: `tables = benchmark_fixture("gspo_tables")`."""

    def loaded() -> ModuleType:
        return load_benchmark(name)

    return pytest.fixture(scope="module")(loaded)


def stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    """Terminates a server a test started, killing it if it outlives `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """`nf4_decode`'s kernels under Triton's interpreter (the CPU, where this file turns it on;
    the code lookup by selects, as the interpreter runs no PTX), on a pretend GPU of 4 SMs."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a GPU is present): tests/gpu cover the kernel")
    from vlmrl.training.rollout import nf4_decode

    monkeypatch.setattr(nf4_decode, "_sm_count", lambda device: 4)
    return nf4_decode
