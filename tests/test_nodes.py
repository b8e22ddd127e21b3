"""The launchers of a multi-machine run meeting and watching each other
(vlmrl.distributed.nodes), on 127.0.0.1 with real sockets and real child processes standing in
for `accelerate launch`: every node joins and ends together; a node that never joins, runs
another commit, fails, is killed or goes silent stops the others with one line naming it; node
0 with nothing to run tells the others."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from s3_server import free_port

from vlmrl.distributed.nodes import GO, SKIP, Identity, NodeError, Nodes, meet, watch

ME = Identity("a" * 40, "0123456789abcdef")
ROOT = Path(__file__).resolve().parents[1]


def free_pair() -> int:
    """A port whose successor is free too (torch's rendezvous port and the launchers')."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def nodes(rank: int, port: int, count: int = 2, timeout: float = 10) -> Nodes:
    return Nodes(count, rank, "127.0.0.1", port, timeout)


def child(seconds: float, code: int = 0) -> subprocess.Popen:
    """What `accelerate launch` would be: a process that ends after `seconds` with `code`."""
    return subprocess.Popen([sys.executable, "-c",
                             f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def in_thread(work: Callable[[], object]) -> dict:
    """Runs `work` in a thread; the dict gets its result or error once `join` is called."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except NodeError as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["join"] = thread.join
    return outcome


def node_run(place: Nodes, seconds: float, code: int = 0, me: Identity = ME,
             answer: str = GO) -> Callable[[], object]:
    def work() -> object:
        peers, told = meet(place, me, answer)
        if told == SKIP:
            return SKIP
        return watch(place, peers, child(seconds, code))
    return work


def connect(port: int) -> socket.socket:
    """A connection to node 0's launcher, once it listens."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port + 1), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def finish(*outcomes: dict, timeout: float = 60) -> None:
    for outcome in outcomes:
        outcome["join"](timeout)


def test_two_nodes_meet_run_and_end_together(capsys):
    port = free_pair()
    main = in_thread(node_run(nodes(0, port), 1.0))
    other = in_thread(node_run(nodes(1, port), 0.5))
    finish(main, other)
    assert main.get("result") == 0 and other.get("result") == 0, (main, other)
    printed = capsys.readouterr().out
    assert "node 0 of 2 (the main node): waiting up to 10 s for node(s) 1 on port" in printed
    assert "node 0 of 2 (the main node): node 1 joined" in printed


def test_a_node_that_never_joins_is_named_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(NodeError) as raised:
        meet(nodes(0, free_pair(), count=3, timeout=2), ME)
    assert time.monotonic() - started < 6
    assert str(raised.value).startswith("node 1, 2 of 3 did not join within 2 s: start it with "
                                        "its NODE_RANK, and check that it reaches 127.0.0.1 on "
                                        "ports ")


def test_a_missing_main_node_is_named_by_the_others():
    port = free_pair()
    with pytest.raises(NodeError, match=rf"^node 0 of 2 \(the main node, 127\.0\.0\.1 port "
                                        rf"{port + 1}\) did not answer node 1 of 2 within 2 s"):
        meet(nodes(1, port, timeout=2), ME)


def test_a_node_at_another_commit_stops_both():
    port = free_pair()
    main = in_thread(node_run(nodes(0, port), 1.0))
    other = in_thread(node_run(nodes(1, port), 1.0, me=Identity("b" * 40, ME.digest)))
    finish(main, other)
    expected = ("node 1 is at commit bbbbbbbbbbbb, node 0 at aaaaaaaaaaaa: every node must "
                "check out the same commit")
    assert main.get("error") == expected and other.get("error") == expected


def test_node_0_with_nothing_to_run_tells_the_others():
    port = free_pair()
    main = in_thread(node_run(nodes(0, port), 1.0, answer=SKIP))
    other = in_thread(node_run(nodes(1, port), 1.0))
    finish(main, other)
    assert main.get("result") == SKIP and other.get("result") == SKIP


def test_a_failing_main_node_stops_the_others():
    port = free_pair()
    main = in_thread(node_run(nodes(0, port), 0.5, code=3))
    other = in_thread(node_run(nodes(1, port), 30))
    finish(main, other)
    assert main.get("result") == 3
    assert other.get("error") == ("node 0 of 2 (the main node) failed (exit code 3); its log "
                                  "has the error")


NODE_SCRIPT = """
import sys, subprocess
from vlmrl.distributed.nodes import Identity, Nodes, meet, watch
place = Nodes(2, 1, "127.0.0.1", int(sys.argv[1]), 10.0)
peers, _ = meet(place, Identity("a" * 40, "0123456789abcdef"))
print("joined", flush=True)
watch(place, peers, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
"""


def test_a_killed_node_stops_the_main_node_at_once(tmp_path: Path):
    """Node 1 in a process of its own, killed with its child mid-run as a machine dies: node 0
    names it within seconds, and its own child is gone."""
    port = free_pair()
    local = child(60)
    main: dict = {}

    def work() -> None:
        peers, _ = meet(nodes(0, port), ME)
        main["watching"] = time.monotonic()
        try:
            watch(nodes(0, port), peers, local)
        except NodeError as error:
            main["error"], main["stopped"] = str(error), time.monotonic()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    node1 = subprocess.Popen([sys.executable, "-c", NODE_SCRIPT, str(port)], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "joined\n" in iter(node1.stdout.readline, "")  # reads up to that line
        time.sleep(1)
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
        thread.join(30)
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
    assert main["error"].startswith("node 1 of 2 left the run after "), main
    assert main["error"].endswith(" s (its connection closed)")
    assert main["stopped"] - main["watching"] < 10
    assert local.poll() == -signal.SIGKILL


def test_a_silent_node_is_lost_after_the_timeout():
    """A node whose launcher hangs (it sends no heartbeat) counts as lost once it has been
    silent for the rendezvous timeout."""
    port = free_pair()
    main = in_thread(node_run(nodes(0, port, timeout=2), 60))
    with connect(port) as fake:
        fake.sendall(f"join 1 2 {ME.commit} {ME.digest}\n".encode())
        assert fake.makefile().readline() == "go\n"
        finish(main)
    assert main.get("error", "").startswith("node 1 of 2 left the run after ")
    assert main["error"].endswith("(it sent nothing for 2 s)")


def test_a_stranger_on_the_port_is_ignored():
    port = free_pair()
    main = in_thread(node_run(nodes(0, port), 0.5))
    with connect(port) as stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
    other = in_thread(node_run(nodes(1, port), 0.5))
    finish(main, other)
    assert main.get("result") == 0 and other.get("result") == 0, (main, other)
