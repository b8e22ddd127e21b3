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

    def written(event: str, args: tuple) -> list:
        """The paths an event writes (both ends of a rename or copy)."""
        if event == "open":
            path, mode, flags = args
            mode = mode if isinstance(mode, str) else ""
            writes = any(c in mode for c in "wax+") or (flags or 0) & WRITE_FLAGS
            return [path] if writes and path is not None and not isinstance(path, int) else []
        if event == "os.mkdir":
            return [] if os.path.exists(os.fsdecode(args[0])) else [args[0]]
        if event in ("os.rename", "os.replace", "shutil.copyfile", "os.link", "os.symlink"):
            return [args[0], args[1]]
        return [args[0]] if event in PATH_EVENTS else []

    def hook(event: str, args: tuple) -> None:
        paths = [os.fsdecode(path) for path in written(event, args)
                 if not isinstance(path, int)]
        if any(os.path.realpath(path).startswith(data) for path in paths):
            log.write(f"{event} {' -> '.join(paths)}\n")

    sys.addaudithook(hook)


if os.environ.get("VLMRL_WRITE_AUDIT") and os.environ.get("RANK", "").isdigit():
    _install(os.environ["VLMRL_WRITE_AUDIT"], os.environ["RANK"])
