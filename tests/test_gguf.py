"""Reading GGUF files (vlmrl.export.gguf): gguf-py's GGUFReader for export's checks, llama.cpp for
the model name `vlmrl serve` gives clients. On a file the converter wrote both give what the
file holds; on a damaged copy, every failure is a GGUFError naming the file, and a garbled array
length stops at the end of the file instead of looping over empty reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vlmrl.export.gguf import GGUFError, convert_hf_to_gguf, gguf_py, read_gguf_info
from vlmrl.export.llama_runtime import gguf_general_name
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.portable import gguf_metadata

MODEL = "embedded:tiny-qwen3"


@pytest.fixture(scope="module")
def text_gguf(tmp_path_factory) -> Path:
    """The embedded text model's f16 GGUF, named as export names it (general.name)."""
    folder = tmp_path_factory.mktemp("gguf")
    metadata = folder / "metadata.json"
    metadata.write_text(json.dumps(gguf_metadata(MODEL)))
    return convert_hf_to_gguf(ensure_embedded_model(MODEL), folder / "model-f16.gguf", "f16",
                              metadata=metadata)


def test_reader_and_llama_cpp_read_what_the_converter_wrote(text_gguf: Path) -> None:
    info = read_gguf_info(text_gguf)
    assert (info.version, info.architecture, info.name) == (3, "qwen3", "tiny-qwen3-gspo")
    assert set(info.tensor_types) == {"F16", "F32"} and info.tensors == sum(
        info.tensor_types.values())
    assert 0.9 * text_gguf.stat().st_size < info.data_bytes < text_gguf.stat().st_size
    assert gguf_general_name(text_gguf) == "tiny-qwen3-gspo"


def damaged(source: Path, folder: Path) -> dict[str, Path]:
    data = source.read_bytes()
    header_end = data.index(b"token_embd.weight")  # inside the tensor infos
    variants = {
        "empty": b"",
        "bad-magic": b"GGML" + data[4:],
        "garbled-version": data[:4] + b"\xff" * 60 + data[64:],
        "cut-in-header": data[:header_end],
        "cut-in-tensor-data": data[:-100],
    }
    paths = {name: folder / f"{name}.gguf" for name in variants}
    for name, blob in variants.items():
        paths[name].write_bytes(blob)
    return paths


REASONS = {"empty": "not a GGUF file", "bad-magic": "not a GGUF file (bad magic b'GGML'",
           "garbled-version": "corrupted GGUF file (Sorry, file appears to be version 4294967295",
           "cut-in-header": "corrupted GGUF file (",
           "cut-in-tensor-data": "corrupted GGUF file (tensor '"}


def test_damaged_files_give_errors_naming_them(text_gguf: Path, tmp_path: Path) -> None:
    for name, path in damaged(text_gguf, tmp_path).items():
        with pytest.raises(GGUFError) as read:
            read_gguf_info(path)
        assert str(read.value).startswith(f"{path}: {REASONS[name]}"), str(read.value)
        with pytest.raises(GGUFError, match=f"^{path}: "):
            gguf_general_name(path)
    with pytest.raises(GGUFError, match=r"ends at byte \d+, the file has \d+; truncated\?"):
        read_gguf_info(tmp_path / "cut-in-tensor-data.gguf")


def test_a_garbled_array_length_stops_at_the_end_of_the_file(tmp_path: Path) -> None:
    """gguf-py reads an array element by element; past the end of a memory map each read is
    empty, not an error, so without a bounds check a length of 2**30 - 1 loops for hours."""
    import numpy as np

    gguf = gguf_py()
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_array("test.values", [1, 2, 3])
    writer.add_tensor("weight", np.ones((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_info(path).tensor_types == {"F32": 1}
    data = bytearray(path.read_bytes())
    length_at = data.index(b"test.values") + len(b"test.values") + 4 + 4  # value type, item type
    assert int.from_bytes(data[length_at:length_at + 8], "little") == 3
    data[length_at:length_at + 8] = (2**30 - 1).to_bytes(8, "little")
    path.write_bytes(bytes(data))

    started = time.monotonic()
    with pytest.raises(GGUFError, match=f"^{path}: corrupted GGUF file \\(the header runs past "
                                        "the end of the file at byte"):
        read_gguf_info(path)
    assert time.monotonic() - started < 10
