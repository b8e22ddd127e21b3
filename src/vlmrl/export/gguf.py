"""llama-cpp-python ships llama.cpp's runtime but neither its Python converter nor a quantize
binary, and the PyPI `gguf` package lags behind the converter (it fails on it). The converter is
therefore taken from the sdist of the very llama-cpp-python version installed, whose vendored
llama.cpp matches the runtime that loads the files, and run as a subprocess with that sdist's
gguf-py; quantization goes through `llama_model_quantize`, which the wheel does ship, and export
reads the files back with that gguf-py's GGUFReader. Every llama.cpp or gguf-py failure is turned
into an error that names the file, never a bare crash."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
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


# ------------------------------------------------------------ reading files

# What gguf-py's GGUFReader raises on a file it cannot read (a duplicate key is a KeyError).
_READ_ERRORS = (ValueError, KeyError, IndexError, OverflowError)


@dataclass(frozen=True)
class GGUFInfo:
    """What export checks in a GGUF file: its header and the ggml type of its tensors."""

    path: Path
    version: int
    architecture: str | None
    name: str | None  # general.name
    tensor_types: dict[str, int]
    tensors: int
    data_bytes: int


def gguf_py(source: Path | None = None) -> ModuleType:
    """The `gguf` package (gguf-py) of the converter's llama.cpp source, imported in-process.

    The vendored copy, not PyPI's `gguf`: it is the package that wrote the files (the converter
    runs with it) and matches the llama.cpp that quantizes and loads them, so it knows every ggml
    type they hold, while PyPI's lags behind llama.cpp and is no dependency of the project.

    Args:
        source: a llama.cpp source directory; default `converter_source()`.
    """
    root = ((source or converter_source()) / "gguf-py").resolve()
    loaded = sys.modules.get("gguf")
    if loaded is None:
        sys.path.insert(0, str(root))
        try:
            import gguf as loaded
        finally:
            sys.path.remove(str(root))
    if not Path(loaded.__file__ or "").resolve().is_relative_to(root):
        raise GGUFError(f"the Python package `gguf` is already imported from {loaded.__file__}; "
                        f"reading GGUF files needs the converter's own, in {root}")
    return loaded


@functools.cache
def _checked_reader_class(gguf: ModuleType) -> type:
    """gguf-py's GGUFReader, with every read checked against the end of the file, and twice as
    fast.

    GGUFReader slices a memory map, and a slice past the end is merely shorter: a truncated file
    then fails on an index or a reshape, and a garbled array length loops up to 2**30 times over
    empty reads; `_get` and `_build_tensors` turn both into a ValueError saying where the file
    ends. It also reads each token of the vocabulary as a slice of `data`, 15 s for Qwen's 152k
    tokens when `data` is an np.memmap; as a plain array view of the same map, 7 s.
    """

    import numpy as np

    class CheckedReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._array

        @data.setter
        def data(self, memmap: np.memmap) -> None:
            self._array = memmap.view(np.ndarray)

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > self.data.nbytes:
                raise ValueError(f"the header runs past the end of the file at byte "
                                 f"{self.data.nbytes}; truncated?")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                end = start_offs + _tensor_end(gguf, field)
                if end > self.data.nbytes:
                    raise ValueError(f"tensor {field.name!r} ends at byte {end}, the file has "
                                     f"{self.data.nbytes}; truncated?")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _tensor_end(gguf: ModuleType, field: Any) -> int:
    """Where a tensor's data ends, relative to the data section, from its header entry (gguf-py's
    ReaderField of a tensor: name length, name, dimension count, dimensions, type, offset)."""
    _length, _name, _dims_count, dims, type_id, offset = field.parts
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(type_id[0]))]
    return int(offset[0]) + math.prod(int(dim) for dim in dims) * block_bytes // block


def read_gguf_info(path: Path, source: Path | None = None) -> GGUFInfo:
    """Header, tensor types and a bounds check of every tensor's data, read by gguf-py's
    GGUFReader; a truncated or garbled file raises GGUFError naming it.

    Args:
        source: the llama.cpp source whose gguf-py reads the file; default `converter_source()`.
    """
    check_gguf_header(path)
    gguf = gguf_py(source)
    try:
        reader = _checked_reader_class(gguf)(path)
    except _READ_ERRORS as error:
        reason = error.args[0] if isinstance(error, KeyError) else error
        raise GGUFError(f"{path}: corrupted GGUF file ({reason})") from error
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
    return GGUFInfo(path=path, version=int(_field(reader, "GGUF.version")),
                    architecture=_field(reader, "general.architecture"),
                    name=_field(reader, "general.name"), tensor_types=dict(types),
                    tensors=len(reader.tensors), data_bytes=end - reader.data_offset)


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def check_gguf_header(path: Path) -> None:
    """Refuses a missing file or one without the GGUF magic before llama.cpp opens it."""
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file not found")
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r}, {path.stat().st_size} "
                        "bytes); the file is corrupted or was written by something else")
