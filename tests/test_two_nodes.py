"""course_lib.chapters.ch12.two_nodes and chapter 08's launch(nnodes=...): two torchrun agents, really launched.

One real launch (two agents with --nnodes 2 meeting at a c10d rendezvous on loopback, 5-15 s on 2 cores)
checked from every side: node ranks, one world of two, the all-reduce, logs keyed by global rank, command
lines without this machine's paths, nothing left running. One launch whose rank sleeps past the timeout:
every process stopped. The rest runs without torchrun: the agents' logs mapped to global ranks, and a failing
agent stopping the other.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

import pytest

from course_lib.chapters.ch08 import ddp_launch as L
from course_lib.chapters.ch08.ddp_launch import DDPTimeout
from course_lib.chapters.ch12 import two_nodes as T
from course_lib.chapters.ch12.two_nodes import format_two_nodes, launch_two_nodes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except OSError:
        return False
    return True


def rdzv_id(command: str | list[str]) -> str:
    """The launch's token: launch() uses it as the rendezvous id and marks every process of the launch with it."""
    words = command.split() if isinstance(command, str) else command
    return words[words.index("--rdzv-id") + 1]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    """One launch as the chapter makes it (no `out`): into runs/12_sharding/two_nodes/ of a course in a temp folder."""
    root, printed = tmp_path_factory.mktemp("course"), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(L, "RUNS", root / "runs" / "08_distributed")  # launch() shows paths relative to root
        mp.setattr(T, "COURSE", root)
        mp.setattr(T, "RUNS", root / "runs" / "12_sharding")
        result = launch_two_nodes(progress=True, timeout=120)
    token = rdzv_id(result["commands"][0])
    out = root / "runs" / "12_sharding" / "two_nodes"
    return {"result": result, "out": out, "printed": printed.getvalue(), "left": L._pids_with_token(token)}


@pytest.mark.slow
def test_two_agents_form_one_world_of_two_ranks_with_node_ranks_0_and_1(two):
    ranks = two["result"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(r["node"] for r in ranks) == [0, 1] and all(r["nodes"] == 2 for r in ranks)
    assert all(r["world"] == 2 and r["local_rank"] == 0 for r in ranks)
    assert all(r["all_reduce"] == r["expected"] == 3.0 for r in ranks)  # 1 + 2: both nodes took part


@pytest.mark.slow
def test_each_ranks_log_is_filed_under_its_global_rank(two):
    logs = two["result"]["logs"]
    assert sorted(logs) == [0, 1]
    for rank, lines in logs.items():
        node = two["result"]["ranks"][rank]["node"]
        assert lines[0].startswith(f"[rank {rank}] node {node} of 2, local rank 0, world 2, pid ")
        assert lines[-1] == f"[rank {rank}] done"


@pytest.mark.slow
def test_nothing_of_the_launch_is_left_running(two):
    assert two["left"] == []  # no agent, no worker: nothing carries the launch's token
    assert not any(alive(r["pid"]) for r in two["result"]["ranks"])


@pytest.mark.slow
def test_the_agents_commands_are_the_same_but_for_the_log_folder_and_name_no_path_of_this_machine(two):
    first, second = two["result"]["commands"]
    assert first.replace("node0", "node1") == second
    assert first.startswith("python -m torch.distributed.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:")
    assert "--log-dir runs/12_sharding/two_nodes/logs/node0 --redirects 3" in first
    assert first.endswith(
        " --nproc-per-node 1 --log-dir runs/12_sharding/two_nodes/logs/node0 --redirects 3 -m "
        "course_lib.chapters.ch12.two_nodes runs/12_sharding/two_nodes"
    )
    assert str(two["out"]) not in first and sys.executable not in first
    assert two["result"]["endpoint"] in first
    assert (two["out"] / "logs" / "node0" / "torchrun.log").exists()  # each agent: its own folder and log
    assert (two["out"] / "logs" / "node1" / "torchrun.log").exists()


@pytest.mark.slow
def test_what_the_launch_and_the_table_print_fits_in_100_characters(two):
    printed = two["printed"].splitlines() + format_two_nodes(two["result"]).splitlines()
    assert (
        printed[0]
        == "torchrun: 2 nodes x 1 rank, outputs in runs/12_sharding/two_nodes/ (each rank imports torch first)"
    )
    assert printed and all(len(line) <= 100 for line in printed), max(printed, key=len)
    table = format_two_nodes(two["result"]).splitlines()[-3:]
    assert table[0].split()[:2] == ["global", "rank"] and [row.split()[:2] for row in table[1:]] == [
        [str(r["rank"]), str(r["node"])] for r in two["result"]["ranks"]
    ]


@pytest.mark.slow
@pytest.mark.timing
def test_a_rank_that_sleeps_past_the_timeout_is_stopped_with_both_agents(tmp_path):
    # Bounded by construction: the 8 s timeout, then ddp_launch._stop's limits (10 s after SIGTERM, 5 s
    # after SIGKILL, _reap's 10 s). Whether rank 1 was asleep or the agents still met, nothing may remain.
    t0 = time.monotonic()
    with pytest.raises(DDPTimeout) as info:
        launch_two_nodes(progress=False, timeout=8, out=tmp_path, args=["--sleep-rank", "1", "--sleep", "600"])
    assert time.monotonic() - t0 < 8 + 40
    run = info.value.run
    assert run.returncode is None and "no result after 8 s" in str(info.value)
    assert len(run.commands) == 2 and L._pids_with_token(rdzv_id(run.command)) == []
    assert run.leftovers() == []  # the workers that got far enough to say their pid


# --------------------------------------------------------------------------- without torchrun


def test_node_logs_are_keyed_by_the_global_rank_each_agent_says_the_rendezvous_gave(tmp_path):
    """The agent started first need not become node 0: the rendezvous orders the agents its own way."""
    for node, (local_ranks, global_ranks) in enumerate([("[0, 1]", "[2, 3]"), ("[0, 1]", "[0, 1]")]):
        folder = tmp_path / f"node{node}"
        for local in (0, 1):
            (folder / "run_x" / "attempt_0" / str(local)).mkdir(parents=True)
            (folder / "run_x" / "attempt_0" / str(local) / "stdout.log").write_text(f"agent {node} local {local}\n")
            (folder / "run_x" / "attempt_0" / str(local) / "stderr.log").write_text("")
        (folder / "torchrun.log").write_text(
            f"I ... api.py:553]   group_rank={1 - node}\n  local_ranks={local_ranks}\n  role_ranks=[9]\n"
            f"  global_ranks={global_ranks}\n"
        )
    logs = L._read_node_logs([tmp_path / "node0", tmp_path / "node1"], nproc=2)
    assert {r: log["stdout"] for r, log in logs.items()} == {
        0: "agent 1 local 0\n",
        1: "agent 1 local 1\n",
        2: "agent 0 local 0\n",
        3: "agent 0 local 1\n",
    }
    (tmp_path / "node0" / "torchrun.log").write_text("")  # an agent that did not say: node k, in order
    assert L._read_node_logs([tmp_path / "node0"], nproc=2)[1]["stdout"] == "agent 0 local 1\n"


def test_an_agent_that_fails_stops_the_others_and_its_exit_code_is_the_launchs(tmp_path):
    token = "test-" + os.urandom(4).hex()
    env = {**os.environ, L.TOKEN_VAR: token}
    commands = [
        [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"],
        [sys.executable, "-c", "import time; time.sleep(120)"],  # the other node, waiting for the first
    ]
    logs = [tmp_path / "a" / "torchrun.log", tmp_path / "b" / "torchrun.log"]
    code = L._agents(commands, logs, tmp_path, env, time.monotonic() + 60, lambda: {}, print)
    assert code == 3  # not None (the deadline): the failure ended the wait, and the sleeper was stopped
    assert L._pids_with_token(token) == [] and all(p.exists() for p in logs)


def test_command_lines_lose_the_interpreter_and_the_output_folders_absolute_path(tmp_path):
    inside = T.COURSE / "runs" / "12_sharding" / "two_nodes"
    line = f"{sys.executable} -m x --log-dir {inside}/logs/node0 {inside}"
    assert T._course_relative(line, inside) == (
        "python -m x --log-dir runs/12_sharding/two_nodes/logs/node0 runs/12_sharding/two_nodes"
    )
    assert T._course_relative(f"{sys.executable} {tmp_path}/logs", tmp_path) == "python <out>/logs"
