"""Put on PYTHONPATH by tests/test_distributed.py: every Python process that a launched stage
starts imports it, and a launched worker (torchrun sets RANK) with VLMRL_WRITE_AUDIT set logs each
write it makes under ./data (open for writing, mkdir of a new folder, rename, remove) to
`rank<RANK>-<pid>.txt` in that folder. Python's audit hooks see Python-level calls only: what a
library writes from C or Rust (safetensors, pyarrow) is not seen."""

import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree",
               "os.truncate", "os.symlink", "os.link", "os.chmod", "shutil.copyfile"}


def _install(log_dir: str, rank: str) -> None:
    data = os.path.realpath("data") + os.sep
    # open for the process's lifetime: the hook writes to it until the interpreter exits
    log = open(os.path.join(log_dir, f"rank{rank}-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115

    def written(event: str, args: tuple) -> str | None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return None
            mode = mode if isinstance(mode, str) else ""
            return path if any(c in mode for c in "wax+") or (flags or 0) & WRITE_FLAGS else None
        if event == "os.mkdir":
            return None if os.path.exists(os.fsdecode(args[0])) else args[0]
        if event in PATH_EVENTS:
            return args[1] if event == "shutil.copyfile" else args[0]
        return None

    def hook(event: str, args: tuple) -> None:
        path = written(event, args)
        if (path is not None and not isinstance(path, int)
                and os.path.realpath(os.fsdecode(path)).startswith(data)):
            log.write(f"{event} {os.fsdecode(path)}\n")

    sys.addaudithook(hook)


if os.environ.get("VLMRL_WRITE_AUDIT") and os.environ.get("RANK", "").isdigit():
    _install(os.environ["VLMRL_WRITE_AUDIT"], os.environ["RANK"])
