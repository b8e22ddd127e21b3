"""Several machines in one training run: the stage's launcher on every machine meets the main
machine's (node 0's) before any of them starts `accelerate launch`, and watches the others until
its own processes end, so that a machine that fails, is killed or never comes stops every machine
with one line naming it, instead of leaving the others waiting in a collective.

torch's rendezvous does not do this: its static rendezvous only times out, without saying which
machine is missing, and a machine that dies mid-run leaves NCCL's collectives on the others
waiting for their timeout. So each node's launcher keeps one TCP connection to node 0's launcher,
on the main node's port + 1 (torch's own rendezvous has the port itself), with lines of text:

    node r -> node 0   join <rank> <count> <commit> <digest>   (who it is and what it runs)
    node 0 -> node r   go | skip | stop <reason>               (once every node has joined)
    both ways          alive                                   (every few seconds)
    both ways          exit <code>                             (its own processes have ended)
    node 0 -> node r   stop <reason>                           (another node failed)

`skip` answers the others when node 0 has nothing to run (DVC has the stage up to date there).
A connection that closes, or stays silent for the rendezvous timeout, without an `exit` is a
node lost. No torch here: the launcher only decides, waits and watches."""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vlmrl.errors import UserError

GO, SKIP = "go", "skip"
# A node whose processes failed tells the others this soon that it did; a local failure caused
# by a lost node (a collective that broke) waits this long for the news of that loss.
CAUSE_GRACE_SECONDS = 3.0
CONNECT_RETRY_SECONDS = 1.0


class NodeError(UserError):
    """A machine of a multi-machine run failed, left or never joined; the message names it."""


@dataclass(frozen=True)
class Nodes:
    """The machines of one run, as this machine sees them.

    Args:
        count: machines in the run.
        rank: this machine's (0: the main machine, whose process 0 writes the outputs).
        address: the main machine's address, as every machine reaches it.
        port: torch's rendezvous port on it; the launchers meet on the next one.
        timeout: seconds a machine may take to join, or stay silent, before the run stops.
    """

    count: int
    rank: int
    address: str
    port: int
    timeout: float

    @property
    def watch_port(self) -> int:
        return self.port + 1

    def name(self, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        return f"node {rank} of {self.count}" + (" (the main node)" if rank == 0 else "")


@dataclass(frozen=True)
class Identity:
    """What a node runs: its git commit and a digest of its params file and stage command."""

    commit: str
    digest: str


def identity(script: Path | str, argv: Sequence[str], params_file: Path) -> Identity:
    """This machine's `Identity`; the script by name only (each clone has its own path)."""
    digest = hashlib.sha256()
    digest.update(params_file.read_bytes() if params_file.is_file() else b"")
    digest.update("\0".join([Path(script).name, *argv]).encode())
    return Identity(git_commit(), digest.hexdigest()[:16])


def git_commit() -> str:
    """HEAD's commit in the current directory, or `none` outside a git checkout."""
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                               timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else "none"


class Peer:
    """One launcher's connection to another: node 0 holds one per other node, the others one
    each, to node 0. Sends are safe from several threads; a send to a closed peer is dropped
    (its reader reports the loss)."""

    def __init__(self, rank: int, connection: socket.socket) -> None:
        self.rank = rank
        self.connection = connection
        self.lines = connection.makefile("r", encoding="utf-8", newline="\n")
        self._lock = threading.Lock()
        self.silent = False  # the last read timed out: the connection is open, nothing came

    def send(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.connection.sendall(f"{line}\n".encode())

    def read(self, timeout: float | None) -> str | None:
        """The next line, or None where the connection closed or stayed silent `timeout` s."""
        self.connection.settimeout(timeout)
        try:
            line = self.lines.readline()
        except TimeoutError:
            self.silent = True
            return None
        except (OSError, ValueError):
            return None
        return line.rstrip("\n") if line else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.close()


# ------------------------------------------------------------------ meeting


def meet(nodes: Nodes, me: Identity, answer: str = GO) -> tuple[list[Peer], str]:
    """Every node's launcher meets node 0's; returns this node's connections and node 0's answer
    (`go`, or `skip` where node 0 has nothing to run). Raises NodeError naming the node that
    did not join in time or runs something else."""
    if nodes.rank == 0:
        return gather(nodes, me, answer), answer
    return join(nodes, me)


def gather(nodes: Nodes, me: Identity, answer: str) -> list[Peer]:
    """Node 0: waits for the others (a `join` each), checks they run what it runs, and answers
    all of them once the last one joined."""
    deadline = time.monotonic() + nodes.timeout
    peers: dict[int, Peer] = {}
    print(f"{nodes.name()}: waiting up to {nodes.timeout:g} s for node(s) "
          f"{ranks_text(range(1, nodes.count))} on port {nodes.watch_port}", flush=True)
    try:
        with socket.create_server(("", nodes.watch_port), backlog=nodes.count) as server:
            while len(peers) < nodes.count - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NodeError(missing_message(nodes, peers))
                server.settimeout(remaining)
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                peer = admit(connection, nodes, me, peers, deadline)
                if peer is not None:
                    peers[peer.rank] = peer
                    print(f"{nodes.name()}: node {peer.rank} joined", flush=True)
    except NodeError as error:
        for peer in peers.values():
            peer.send(f"stop {error}")
            peer.close()
        raise
    except OSError as error:
        raise NodeError(f"{nodes.name()} cannot listen on port {nodes.watch_port} for the "
                        f"other nodes: {error}") from None
    for peer in peers.values():
        peer.send(answer)
    return list(peers.values())


def admit(connection: socket.socket, nodes: Nodes, me: Identity, peers: dict[int, Peer],
          deadline: float) -> Peer | None:
    """A connection's `join`, checked: None for one that is not a node (it sent something
    else); NodeError for a node that runs something else than node 0."""
    peer = Peer(-1, connection)
    words = (peer.read(max(0.1, min(30.0, deadline - time.monotonic()))) or "").split()
    if len(words) != 5 or words[0] != "join" or not (words[1] + words[2]).isdigit():
        peer.close()
        return None
    rank, count, commit, digest = int(words[1]), int(words[2]), words[3], words[4]
    peer.rank = rank
    problem = join_problem(nodes, me, rank, count, Identity(commit, digest), peers)
    if problem:
        peer.send(f"stop {problem}")
        peer.close()
        raise NodeError(problem)
    return peer


def join_problem(nodes: Nodes, me: Identity, rank: int, count: int, them: Identity,
                 peers: dict[int, Peer]) -> str | None:
    """Why node `rank` may not join node 0's run, or None."""
    if count != nodes.count:
        return (f"node {rank} was started for {count} machines, node 0 for {nodes.count}: every "
                "node needs the same machine count (NNODES)")
    if not 0 < rank < nodes.count:
        return f"a node joined as node {rank}, which is not one of 1 to {nodes.count - 1}"
    if rank in peers:
        return f"two machines joined as node {rank}: each needs its own NODE_RANK"
    if them.commit != me.commit:
        return (f"node {rank} is at commit {them.commit[:12]}, node 0 at {me.commit[:12]}: "
                "every node must check out the same commit")
    if them.digest != me.digest:
        return (f"node {rank} runs other params or stage arguments than node 0: every node "
                "must run the same stage with the same params.yaml")
    return None


def missing_message(nodes: Nodes, peers: dict[int, Peer]) -> str:
    missing = [rank for rank in range(1, nodes.count) if rank not in peers]
    return (f"node {ranks_text(missing)} of {nodes.count} did not join within "
            f"{nodes.timeout:g} s: start it with its NODE_RANK, and check that it reaches "
            f"{nodes.address} on ports {nodes.port} and {nodes.watch_port}")


def ranks_text(ranks: Sequence[int] | range) -> str:
    return ", ".join(map(str, ranks))


def join(nodes: Nodes, me: Identity) -> tuple[list[Peer], str]:
    """Another node: connects to node 0 (retrying until the timeout, since node 0 may start
    later), says who it is and waits for node 0's answer, which comes once every node joined."""
    deadline = time.monotonic() + nodes.timeout
    connection = None
    while connection is None:
        try:
            connection = socket.create_connection((nodes.address, nodes.watch_port),
                                                  timeout=CONNECT_RETRY_SECONDS * 5)
        except OSError:
            if time.monotonic() > deadline:
                raise NodeError(f"node 0 of {nodes.count} (the main node, {nodes.address} port "
                                f"{nodes.watch_port}) did not answer {nodes.name()} within "
                                f"{nodes.timeout:g} s: start it, and check MASTER_ADDR and that "
                                f"ports {nodes.port} and {nodes.watch_port} are open") from None
            time.sleep(CONNECT_RETRY_SECONDS)
    peer = Peer(0, connection)
    peer.send(f"join {nodes.rank} {nodes.count} {me.commit} {me.digest}")
    print(f"{nodes.name()}: reached node 0 at {nodes.address}:{nodes.watch_port}; waiting "
          "for every node to join", flush=True)
    # node 0 gives up on missing nodes within its own timeout of this moment, and says so
    answer = peer.read(nodes.timeout + 30)
    if answer in (GO, SKIP):
        return [peer], answer
    peer.close()
    if answer and answer.startswith("stop "):
        raise NodeError(answer.removeprefix("stop "))
    raise NodeError(f"node 0 of {nodes.count} (the main node) left before the run started")


# ------------------------------------------------------------------ watching


def watch(nodes: Nodes, peers: Sequence[Peer], process: subprocess.Popen) -> int:
    """Runs beside this node's `accelerate launch` (`process`) until it ends: returns its exit
    code, or kills it and raises NodeError naming the node that failed or left. Node 0 returns
    only once every other node has ended its processes too, so that its success means the
    whole run's; it tells the others when one of them failed."""
    events: queue.Queue[tuple[str, int, object]] = queue.Queue()
    started = time.monotonic()
    stopping = threading.Event()
    for peer in peers:
        threading.Thread(target=listen, args=(peer, nodes.timeout, events), daemon=True).start()
    threading.Thread(target=lambda: events.put(("local", nodes.rank, process.wait())),
                     daemon=True).start()
    threading.Thread(target=beat, args=(peers, nodes.timeout, stopping), daemon=True).start()
    try:
        return follow(nodes, peers, process, events, started)
    finally:
        stopping.set()
        for peer in peers:
            peer.close()


def follow(nodes: Nodes, peers: Sequence[Peer], process: subprocess.Popen,
           events: queue.Queue, started: float) -> int:
    """The watch's events, in order, until this node's outcome is known."""
    finished: set[int] = set()
    code: int | None = None
    while code is None or (nodes.rank == 0 and len(finished) < len(peers)):
        try:
            kind, rank, value = events.get(timeout=None if code is None else nodes.timeout)
        except queue.Empty:
            waiting = sorted({peer.rank for peer in peers} - finished)
            stop_run(nodes, peers, process, f"node {ranks_text(waiting)} of {nodes.count} did "
                                            f"not end within {nodes.timeout:g} s of node 0")
        if kind == "local":
            code = int(value)
            if code != 0:
                return local_failure(nodes, peers, process, events, code, finished, started)
            send_all(peers, "exit 0")
        elif cause := peer_news(nodes, kind, rank, value, finished, started):
            stop_run(nodes, peers, process, cause)
    return code


def peer_news(nodes: Nodes, kind: str, rank: int, value: object, finished: set[int],
              started: float) -> str | None:
    """What a peer's event means: None where it is no failure, else the one line naming it."""
    if kind == "exit" and value == 0:
        finished.add(rank)
        return None
    if kind == "exit":
        return f"{nodes.name(rank)} failed (exit code {value}); its log has the error"
    if kind == "stop":
        return str(value)
    if rank in finished:
        return None
    how = "its connection closed" if value == "closed" else (
        f"it sent nothing for {nodes.timeout:g} s")
    return f"{nodes.name(rank)} left the run after {time.monotonic() - started:.0f} s ({how})"


def local_failure(nodes: Nodes, peers: Sequence[Peer], process: subprocess.Popen,
                  events: queue.Queue, code: int, finished: set[int], started: float) -> int:
    """This node's processes failed: where a node was lost just before (its loss broke their
    collectives), that loss is the cause; else the others are told and the code returned."""
    deadline = time.monotonic() + CAUSE_GRACE_SECONDS
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            kind, rank, value = events.get(timeout=remaining)
        except queue.Empty:
            break
        cause = peer_news(nodes, kind, rank, value, finished, started)
        if cause and kind != "exit":  # a peer that failed on its own tells its own story
            stop_run(nodes, peers, process, cause)
    send_all(peers, f"exit {code}")
    return code


def stop_run(nodes: Nodes, peers: Sequence[Peer], process: subprocess.Popen, cause: str) -> None:
    """Kills this node's processes, tells the others and raises the cause."""
    kill_tree(process)
    send_all(peers, f"stop {cause}")
    raise NodeError(cause)


def kill_tree(process: subprocess.Popen) -> None:
    """`accelerate launch` and its workers, killed at once and gone before this returns, so
    that nothing they print comes after the line that says why (the workers would die with
    their launcher anyway, a moment later)."""
    tree = descendants(process.pid) if process.poll() is None else []
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if process.poll() is None:
        process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, tree)) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has ended: its output is all written)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`, from Linux's /proc (none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while being read
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def send_all(peers: Sequence[Peer], line: str) -> None:
    for peer in peers:
        peer.send(line)


def listen(peer: Peer, timeout: float, events: queue.Queue) -> None:
    """A peer's lines as events, until it closes or stays silent for `timeout` s."""
    while True:
        line = peer.read(timeout)
        if line is None:
            events.put(("lost", peer.rank, "silent" if peer.silent else "closed"))
            return
        word, _, rest = line.partition(" ")
        if word == "exit" and rest.lstrip("-").isdigit():
            events.put(("exit", peer.rank, int(rest)))
        elif word == "stop":
            events.put(("stop", peer.rank, rest))


def beat(peers: Sequence[Peer], timeout: float, stopping: threading.Event) -> None:
    """`alive` to every peer a few times per timeout, so that silence means a lost node."""
    while not stopping.wait(min(5.0, timeout / 4)):
        send_all(peers, "alive")
