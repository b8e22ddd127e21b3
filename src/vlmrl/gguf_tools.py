"""llama-cpp-python ships llama.cpp's runtime but neither its Python converter nor a quantize
binary, and the PyPI `gguf` package lags behind the converter (it fails on it). The converter is
therefore taken from the sdist of the very llama-cpp-python version installed, whose vendored
llama.cpp matches the runtime that loads the files, and run as a subprocess with that sdist's
gguf-py; quantization goes through `llama_model_quantize`, which the wheel does ship. Every
llama.cpp failure is turned into an error that names the file, never a bare crash."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vlmrl.embedded import cache_root
from vlmrl.outputs import atomic_dir

SOURCE_ENV = "VLMRL_LLAMA_CPP_SRC"
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0")
# What the converter needs from llama.cpp's tree; the rest (C++ sources, test models) is 200 MB.
CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/", "models/templates/", "LICENSE")
GGUF_MAGIC = b"GGUF"


class GGUFError(RuntimeError):
    """Converting, quantizing or loading a GGUF file failed; the message names the file."""


# ------------------------------------------------------------ the converter


def installed_llama_cpp_version() -> str:
    try:
        import llama_cpp
    except ImportError as error:
        raise GGUFError("llama-cpp-python is not installed (pip install -e '.[gguf]')") from error
    return llama_cpp.__version__


def is_converter_source(path: Path) -> bool:
    return ((path / CONVERTER).is_file() and (path / "gguf-py" / "gguf").is_dir()
            and (path / "conversion").is_dir())


def converter_source(version: str | None = None) -> Path:
    """A llama.cpp source directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/:
    $VLMRL_LLAMA_CPP_SRC, else the installed version's sdist extracted once into the cache,
    else that sdist downloaded with pip first."""
    override = os.environ.get(SOURCE_ENV)
    if override:
        path = Path(override).expanduser()
        if not is_converter_source(path):
            raise GGUFError(f"${SOURCE_ENV}={override} is not a llama.cpp source directory "
                            f"(needs {CONVERTER}, conversion/ and gguf-py/)")
        return path
    version = version or installed_llama_cpp_version()
    target = cache_root() / f"llama.cpp-{version}"
    if is_converter_source(target):
        return target
    sdist = cache_root() / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        sdist = download_sdist(version, sdist.parent)
    extract_converter(sdist, target)
    return target


def download_sdist(version: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(directory.glob(f"llama_cpp_python-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        raise GGUFError(
            f"llama.cpp's converter is needed and none was found: set ${SOURCE_ENV} to a "
            f"llama.cpp checkout, or put llama_cpp_python-{version}.tar.gz in {directory}; "
            f"downloading it failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    return found[0]


def extract_converter(sdist: Path, target: Path) -> None:
    """Extracts the converter's parts of the sdist's vendor/llama.cpp into `target`, atomically."""
    try:
        with tarfile.open(sdist) as archive, atomic_dir(target) as staging:
            members = list(_converter_members(archive))
            if not any(member.name == CONVERTER for member in members):
                raise GGUFError(f"{sdist}: no vendor/llama.cpp/{CONVERTER} in this sdist")
            archive.extractall(staging, members=members, filter="data")
    except (tarfile.TarError, OSError) as error:
        raise GGUFError(f"{sdist}: cannot extract llama.cpp's converter ({error})") from error


def _converter_members(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for member in archive.getmembers():
        parts = member.name.split("/", 3)
        if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
            continue
        relative = parts[3]
        if any(relative == part or (part.endswith("/") and relative.startswith(part))
               for part in CONVERTER_PARTS):
            member.name = relative
            yield member


def converter_env(source: Path) -> dict[str, str]:
    """The sdist's gguf-py must win over an installed PyPI `gguf`."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    paths = [str(source / "gguf-py"), str(source)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def convert_hf_to_gguf(model_dir: Path, outfile: Path, outtype: str, *, mmproj: bool = False,
                       source: Path | None = None) -> Path:
    """Runs convert_hf_to_gguf.py on a Hugging Face model directory; `mmproj` converts the
    vision projector instead of the language model."""
    if outtype not in CONVERTER_OUTTYPES:
        raise GGUFError(f"convert_hf_to_gguf.py has no outtype {outtype!r}; "
                        f"use one of {CONVERTER_OUTTYPES}")
    source = source or converter_source()
    command = [sys.executable, str(source / CONVERTER), str(model_dir), "--outtype", outtype,
               "--outfile", str(outfile)]
    if mmproj:
        command.append("--mmproj")
    result = subprocess.run(command, capture_output=True, text=True, env=converter_env(source))
    if result.returncode != 0 or not outfile.is_file():
        raise GGUFError(f"{outfile.name}: converting {model_dir} failed "
                        f"(exit {result.returncode}){_missing_module_hint(result.stderr)}:\n"
                        f"{result.stderr[-3000:]}")
    return outfile


def _missing_module_hint(log: str) -> str:
    match = re.search(r"No module named '([\w.]+)'", log)
    if not match:
        return ""
    package = match.group(1).split(".")[0]
    return f"; the converter needs the Python package `{package}` (pip install {package})"


# ------------------------------------------------------------ quantization


def llama_ftype(kind: str) -> int:
    import llama_cpp

    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if not isinstance(value, int):
        known = sorted(name.removeprefix("LLAMA_FTYPE_MOSTLY_") for name in dir(llama_cpp)
                       if name.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise GGUFError(f"llama.cpp has no quantization type {kind!r}; known: {known}")
    return value


def expected_tensor_type(kind: str) -> str:
    """The ggml tensor type a file type must contain: Q4_K_M and Q4_K_S mix Q4_K with other
    K-types; f16 -> F16, q8_0 -> Q8_0."""
    return re.sub(r"^(Q\d_K)_[SML]$", r"\1", kind.upper())


def quantize_gguf(source_file: Path, outfile: Path, kind: str, threads: int | None = None) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_ftype(kind)
    params.nthread = threads or os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(source_file).encode(), str(outfile).encode(),
                                          ctypes.byref(params))
    if code != 0 or not outfile.is_file():
        raise GGUFError(f"{outfile.name}: llama_model_quantize {source_file.name} -> {kind} "
                        f"failed (code {code})")
    return outfile


# ------------------------------------------------------------ reading files

_READ_SCRIPT = """
import json, sys
from collections import Counter
from gguf import GGUFReader
out = {}
for path in sys.argv[1:]:
    try:
        reader = GGUFReader(path)
        field = reader.get_field("general.architecture")
        arch = field.contents() if field is not None else None
        out[path] = {"architecture": arch, "tensors": len(reader.tensors),
                     "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors))}
    except Exception as error:
        out[path] = {"error": f"{type(error).__name__}: {error}"}
print(json.dumps(out))
"""


def check_gguf_header(path: Path) -> None:
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file not found")
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r}, {path.stat().st_size} "
                        "bytes); the file is corrupted or was written by something else")


def read_gguf_summaries(paths: Sequence[Path], source: Path | None = None) -> dict[Path, dict]:
    """Architecture and tensor-type counts per file, read by gguf-py's GGUFReader (in a
    subprocess: it is the sdist's gguf-py, not an importable package here)."""
    for path in paths:
        check_gguf_header(path)
    source = source or converter_source()
    result = subprocess.run([sys.executable, "-c", _READ_SCRIPT, *map(str, paths)],
                            capture_output=True, text=True, env=converter_env(source))
    if result.returncode != 0:
        raise GGUFError(f"reading {', '.join(p.name for p in paths)} with GGUFReader failed:\n"
                        f"{result.stderr[-2000:]}")
    summaries = {Path(name): value for name, value in json.loads(result.stdout).items()}
    for path, summary in summaries.items():
        if "error" in summary:
            raise GGUFError(f"{path}: corrupted GGUF file ({summary['error']})")
    return summaries


# ------------------------------------------------------------ running files


@contextlib.contextmanager
def open_gguf(path: Path, *, n_ctx: int = 1024, logits_all: bool = False,
              chat_handler: Any = None) -> Iterator[Any]:
    """A llama_cpp.Llama on the file, always closed afterwards."""
    from llama_cpp import Llama

    check_gguf_header(path)
    try:
        llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=logits_all, verbose=False,
                    n_threads=os.cpu_count() or 1, seed=0, chat_handler=chat_handler)
    except ValueError as error:
        raise GGUFError(f"{path}: llama.cpp cannot load this GGUF file, it is corrupted or "
                        f"incomplete ({error})") from error
    try:
        yield llm
    finally:
        llm.close()


def last_position_logits(llm, token_ids: Sequence[int]):
    """Float32 logits after the last token (the Llama needs logits_all=True)."""
    import numpy as np

    llm.reset()
    llm.eval(list(token_ids))
    return np.array(llm.scores[len(token_ids) - 1], dtype=np.float32)


def greedy_tokens(llm, token_ids: Sequence[int], count: int) -> list[int]:
    """`count` greedy tokens after the prompt, whatever they are (EOS included)."""
    tokens = []
    for token in llm.generate(list(token_ids), temp=0.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == count:
            break
    return tokens


def quiet_mtmd_logs() -> None:
    """mtmd logs every image slice to stderr regardless of `verbose`; route it through
    llama-cpp-python's own log callback, which honours verbose=False."""
    from llama_cpp import _logger, mtmd_cpp

    mtmd_cpp.mtmd_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_helper_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def image_chat(model_file: Path, mmproj_file: Path, image, question: str,
               max_tokens: int = 4) -> dict[str, Any]:
    """One image+text chat turn through llama-cpp-python's mtmd handler (Qwen3-VL's projector
    and the chat template stored in the GGUF)."""
    from llama_cpp.llama_chat_format import MTMDChatHandler

    check_gguf_header(mmproj_file)
    quiet_mtmd_logs()
    handler = MTMDChatHandler(clip_model_path=str(mmproj_file), verbose=False)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
        {"type": "text", "text": question}]}]
    with open_gguf(model_file, n_ctx=4096, chat_handler=handler) as llm:
        try:
            response = llm.create_chat_completion(messages=messages, max_tokens=max_tokens,
                                                  temperature=0.0, seed=0)
        except ValueError as error:
            raise GGUFError(f"{mmproj_file}: the image prompt failed with {model_file.name} "
                            f"({error})") from error
    return {"text": response["choices"][0]["message"]["content"],
            "usage": dict(response["usage"])}


def image_data_url(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
