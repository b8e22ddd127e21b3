"""llama-cpp-python ships llama.cpp's runtime but neither its Python converter nor a quantize
binary, and the PyPI `gguf` package lags behind the converter (it fails on it). The converter is
therefore taken from the sdist of the very llama-cpp-python version installed, whose vendored
llama.cpp matches the runtime that loads the files, and run as a subprocess with that sdist's
gguf-py; quantization goes through `llama_model_quantize`, which the wheel does ship. Every
llama.cpp failure is turned into an error that names the file, never a bare crash."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import re
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.cache import cache_root
from vlmrl.errors import UserError
from vlmrl.outputs import atomic_dir
from vlmrl.params import CONVERTER_OUTTYPES

SOURCE_ENV = "VLMRL_LLAMA_CPP_SRC"
CONVERTER = "convert_hf_to_gguf.py"
# What the converter needs from llama.cpp's tree; the rest (C++ sources, test models) is 200 MB.
CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/", "models/templates/", "LICENSE")
GGUF_MAGIC = b"GGUF"


class GGUFError(UserError, RuntimeError):
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
    result = subprocess.run(command, check=False, capture_output=True, text=True)
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
                       source: Path | None = None, metadata: Path | None = None) -> Path:
    """Runs convert_hf_to_gguf.py on a Hugging Face model directory; `mmproj` converts the
    vision projector instead of the language model; `metadata` is a JSON file of general.*
    keys (the converter's --metadata), else it names the file after the directory."""
    if outtype not in CONVERTER_OUTTYPES:
        raise GGUFError(f"convert_hf_to_gguf.py has no outtype {outtype!r}; "
                        f"use one of {CONVERTER_OUTTYPES}")
    source = source or converter_source()
    command = [sys.executable, str(source / CONVERTER), str(model_dir), "--outtype", outtype,
               "--outfile", str(outfile)]
    if mmproj:
        command.append("--mmproj")
    if metadata is not None:
        command += ["--metadata", str(metadata)]
    result = subprocess.run(command, check=False, capture_output=True, text=True,
                            env=converter_env(source))
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

    quiet_llama_logs()
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

# gguf-py's GGUFReader builds numpy views for every token and merge string: a minute for a
# 152k-token vocabulary. This reader skips them and takes type names and row sizes from the
# ggml library that llama-cpp-python loads, the same code that will read the tensors.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    architecture: str | None
    tensor_types: dict[str, int]
    tensors: int
    data_bytes: int


class _Cursor:
    def __init__(self, buffer, path: Path) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def take(self, size: int) -> int:
        start = self.offset
        self.offset += size
        if self.offset > len(self.buffer):
            raise GGUFError(f"{self.path}: corrupted GGUF file (header runs past the end of the "
                            f"file at byte {len(self.buffer)}; truncated?)")
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.unpack("<Q")
        return bytes(self.buffer[self.take(size):self.offset]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """Reads scalars and strings; arrays are skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self.skip_array()
            return None
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: corrupted GGUF file (unknown value type {kind} at "
                            f"byte {self.offset})")
        return self.unpack(_SCALAR_FORMATS[kind])

    def skip_array(self) -> None:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind == _STRING:
            for _ in range(count):
                self.take(self.unpack("<Q"))
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_array()
        elif kind in _SCALAR_FORMATS:
            self.take(struct.calcsize(_SCALAR_FORMATS[kind]) * count)
        else:
            raise GGUFError(f"{self.path}: corrupted GGUF file (unknown array type {kind})")


def _ggml_functions():
    from llama_cpp._ggml import libggml  # llama-cpp-python's handle on its ggml library

    type_name, row_size = libggml.ggml_type_name, libggml.ggml_row_size
    type_name.restype, type_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    row_size.restype, row_size.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]
    return type_name, row_size


def ggml_type_name(type_id: int) -> str | None:
    import llama_cpp

    count = getattr(llama_cpp, "GGML_TYPE_COUNT", None) or 64
    if not 0 <= type_id < count:
        return None
    name = _ggml_functions()[0](type_id)
    return None if not name or name == b"DEPRECATED" else name.decode("ascii").upper()


def read_gguf_info(path: Path) -> GGUFInfo:
    """Header, tensor types and a bounds check of every tensor's data; a truncated or garbled
    file raises GGUFError naming it."""
    check_gguf_header(path)
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cursor = _Cursor(buf, path)
        cursor.take(4)
        version, tensor_count, kv_count = (cursor.unpack("<I"), cursor.unpack("<Q"),
                                           cursor.unpack("<Q"))
        if version not in (2, 3):
            raise GGUFError(f"{path}: corrupted GGUF file (version {version})")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("<I"))
        tensors = [_tensor_info(cursor, path) for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment") or _DEFAULT_ALIGNMENT
        data_start = -(-cursor.offset // alignment) * alignment
        data_bytes = _check_tensor_bounds(tensors, data_start, len(buf), path)
    types: dict[str, int] = {}
    for _name, type_name, _offset, _bytes in tensors:
        types[type_name] = types.get(type_name, 0) + 1
    return GGUFInfo(path=path, version=version, architecture=metadata.get("general.architecture"),
                    tensor_types=types, tensors=tensor_count, data_bytes=data_bytes)


def _tensor_info(cursor: _Cursor, path: Path) -> tuple[str, str, int, int]:
    name = cursor.string()
    dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
    type_id, offset = cursor.unpack("<I"), cursor.unpack("<Q")
    type_name = ggml_type_name(type_id)
    if type_name is None or not dims:
        raise GGUFError(f"{path}: corrupted GGUF file (tensor {name!r} has type {type_id}, "
                        f"shape {dims})")
    rows = math.prod(dims[1:])
    return name, type_name, offset, int(_ggml_functions()[1](type_id, dims[0])) * rows


def _check_tensor_bounds(tensors: Sequence[tuple[str, str, int, int]], data_start: int,
                         file_size: int, path: Path) -> int:
    end = data_start
    for name, _type, offset, size in tensors:
        tensor_end = data_start + offset + size
        if tensor_end > file_size:
            raise GGUFError(f"{path}: corrupted GGUF file (tensor {name!r} ends at byte "
                            f"{tensor_end}, the file has {file_size}; truncated?)")
        end = max(end, tensor_end)
    return end - data_start


def check_gguf_header(path: Path) -> None:
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file not found")
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r}, {path.stat().st_size} "
                        "bytes); the file is corrupted or was written by something else")


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


def quiet_llama_logs() -> None:
    """Only errors from llama.cpp reach stderr. Until a Llama(verbose=False) exists, llama-cpp-
    python prints every log line (quantize lists each tensor), and mtmd logs every image slice
    whatever `verbose` says; both go through llama-cpp-python's level-filtered callback."""
    from llama_cpp import _logger, mtmd_cpp

    _logger.set_verbose(False)
    mtmd_cpp.mtmd_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_helper_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def image_chat(model_file: Path, mmproj_file: Path, image, question: str,
               max_tokens: int = 4) -> dict[str, Any]:
    """One image+text chat turn through llama-cpp-python's mtmd handler (Qwen3-VL's projector
    and the chat template stored in the GGUF)."""
    from llama_cpp.llama_chat_format import MTMDChatHandler

    read_gguf_info(mmproj_file)  # names what is wrong with a damaged projector; mtmd only fails
    quiet_llama_logs()
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
