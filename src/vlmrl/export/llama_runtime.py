"""The llama.cpp runtime that export's checks and `vlmrl serve` run GGUF files with
(llama-cpp-python): a file opened and always closed, its logits and greedy tokens, one image chat
through the mtmd handler, a file's model name read with its vocabulary alone, and llama.cpp's
logs cut to its errors. A file llama.cpp cannot load is an error naming it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from vlmrl.export.gguf import GGUFError, check_gguf_header, llama_ftype, read_gguf_info


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


# ggml.h's log levels. llama-cpp-python 0.3.36's own callback maps them by an older enum, one off:
# with verbose=False it prints llama.cpp's warnings and drops its errors.
GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5


def quiet_llama_logs() -> None:
    """Only errors from llama.cpp and mtmd reach stderr, whatever `verbose` a Llama gets: mtmd
    logs every image slice, quantize lists each tensor, and loading a Qwen vocabulary warns about
    its control tokens."""
    import llama_cpp
    from llama_cpp import mtmd_cpp

    callback = _errors_only_callback()
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_log_set(callback, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_helper_log_set(callback, ctypes.c_void_p(0))


class _LlamaErrors:
    """Where quiet_llama_logs sends llama.cpp's error lines: stderr, or a list while `collect`
    runs, for an error message of our own to quote."""

    def __init__(self) -> None:
        self.level = GGML_LOG_LEVEL_ERROR
        self.collected: list[str] | None = None

    def log(self, level: int, text: str) -> None:
        self.level = self.level if level == GGML_LOG_LEVEL_CONT else level
        if self.level != GGML_LOG_LEVEL_ERROR:
            return
        if self.collected is not None:
            self.collected.append(text)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[str]]:
        self.collected = []
        try:
            yield self.collected
        finally:
            self.collected = None


_LLAMA_ERRORS = _LlamaErrors()


@functools.cache
def _errors_only_callback() -> Any:
    """The ggml log callback of quiet_llama_logs; cached, as llama.cpp keeps calling it."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, _user_data: Any) -> None:
        _LLAMA_ERRORS.log(level, text.decode("utf-8", errors="replace"))

    return callback


def gguf_general_name(path: Path) -> str | None:
    """The file's `general.name`, as llama.cpp reads it with the vocabulary alone: 0.3 s for
    Qwen's, where read_gguf_info takes 7 s and needs the converter's source, which a machine that
    only serves the files lacks."""
    import llama_cpp

    check_gguf_header(path)
    quiet_llama_logs()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with _LLAMA_ERRORS.collect() as errors:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        reason = re.sub(r"^(\w+: )+", "", errors[0].strip()) if errors else "no reason given"
        raise GGUFError(f"{path}: llama.cpp cannot read this GGUF file ({reason})")
    try:
        return _model_meta_string(llama_cpp, model, b"general.name")
    finally:
        llama_cpp.llama_model_free(model)


def _model_meta_string(llama_cpp: ModuleType, model: Any, key: bytes) -> str | None:
    size = 256
    while True:
        value = ctypes.create_string_buffer(size)
        length = llama_cpp.llama_model_meta_val_str(model, key, value, size)
        if length < 0:
            return None
        if length < size:
            return value.value.decode("utf-8", errors="replace")
        size = length + 1


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
