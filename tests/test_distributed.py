"""course_lib.chapters.ch08 (distributed, ddp_launch, ddp_worker): real 2-process torchrun runs on gloo, and helpers.

Four real launches (each starts torchrun and two ranks, 10-30 s on a 2-core machine): a run that
works and whose outputs check out, a rank that raises (named, nothing left behind), a rank that
hangs (stopped by the timeout, nothing left behind), a rank that dies while exiting after its work
(said so). One worker in a subprocess checks its teardown: no process-group thread outlives it; another
runs `train` alone (plain DDP, the function the chapter prints) and with the instruments, which must only
watch: the same parameters. The rest is fast: the command lines, the one-process reference and the
sampler orders it relies on, the formatting. tools/stress_ddp.py runs the notebook's launch 100 times
with a core kept busy.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from course_lib.chapters.ch08 import ddp_launch as L
from course_lib.chapters.ch08 import distributed as D
from course_lib.chapters.ch08.ddp_launch import DDPRun, DDPRunError, DDPTimeout, launch, torchrun_command
from course_lib.chapters.ch08.distributed import (
    AutocastForward,
    format_timing_reference,
    max_rel_diff,
    reference_train,
    training_state_bytes,
)
from course_lib.data import load_dataset
from course_lib.models import MLP

pytestmark = pytest.mark.slow  # real process groups under torchrun: left out by make test-fast

# --------------------------------------------------------------------------- real runs


def new_in_temp(folder: Path) -> list[str]:
    """What appeared in a (redirected) system temporary folder. torch's own compile cache,
    torchinductor_<user>, is not a run's leftover: DDP's constructor makes it once per user (empty), and
    every later run shares it."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


@contextlib.contextmanager
def as_the_chapter_launches(root: Path):
    """launch() without `out`, as chapter 08 calls it: runs/08_distributed/ under `root` instead of the
    course's, and the system's temporary folder (tempfile and $TMPDIR, for torchrun and the ranks) an
    empty folder of its own. Yields that folder."""
    temp = root / "system-temp"
    temp.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L, "RUNS", root / "runs" / "08_distributed")
        mp.setattr(tempfile, "tempdir", str(temp))
        mp.setenv("TMPDIR", str(temp))
        yield temp


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> DDPRun:
    root, printed = tmp_path_factory.mktemp("course"), io.StringIO()
    with as_the_chapter_launches(root) as temp, contextlib.redirect_stdout(printed):
        run = launch(["--backend", "gloo", "--fsdp"], name="ddp", progress=True, timeout=240)
    run.test_notes = {"root": root, "left_in_temp": new_in_temp(temp), "printed": printed.getvalue()}
    return run


def test_a_launch_writes_under_runs_and_leaves_nothing_in_the_system_temp_folder(good_run):
    """Chapter 08 used to leave two folders in the system's temp folder per Run All; now its runs go to
    runs/08_distributed/<name>/ in the course (git-ignored), replaced by the next launch of that name."""
    notes = good_run.test_notes
    assert good_run.out == notes["root"] / "runs" / "08_distributed" / "ddp"
    assert (good_run.out / "summary.json").exists() and notes["left_in_temp"] == []


def test_progress_shows_where_a_launch_is_while_it_runs(good_run):
    lines = good_run.test_notes["printed"].splitlines()
    assert lines[0] == "torchrun: 2 processes, outputs in runs/08_distributed/ddp/ (each rank imports torch first)"
    assert lines[-1].endswith(" s  every rank finished") and all(len(line) <= 100 for line in lines)
    assert any("[rank 0]" in line for line in lines[1:-1])  # rank 0's newest line, while the run went on


def test_a_run_folder_is_emptied_and_only_a_plain_name_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "RUNS", tmp_path / "runs" / "08_distributed")
    (L.run_folder("ddp") / "failed_rank1.json").write_text("{}")  # an earlier run's file would mislead this one
    assert list(L.run_folder("ddp").iterdir()) == []
    for bad in ("", ".", "..", "../x", "a/b"):
        with pytest.raises(ValueError, match="one folder name"):
            L.run_folder(bad)


def test_a_two_process_run_leaves_identical_parameters_and_nothing_running(good_run):
    p0, p1 = good_run.load("params_rank0.pt"), good_run.load("params_rank1.pt")
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    s = good_run.summary
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["precision"] == "bf16" and not s["scaler"]
    assert s["checksums_before"][0] != s["checksums_before"][1]  # different seeds on purpose ...
    assert s["checksums_after"][0] == s["checksums_after"][1] == s["checksums_before"][0]  # ... rank 0's broadcast
    assert good_run.leftovers() == [] and good_run.port_free()
    assert sorted(good_run.logs) == [0, 1]
    assert all(len(line) <= 100 for log in good_run.logs.values() for line in log["stdout"].splitlines())
    assert not any("outlived destroy_process_group" in log["stderr"] for log in good_run.logs.values())


def test_ddp_gradient_is_the_large_batch_gradient(good_run):
    cfg = good_run.summary["config"]
    g0, g1 = good_run.load("grads_rank0.pt"), good_run.load("grads_rank1.pt")
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    seen = [json.loads((good_run.out / f"indices_rank{r}.json").read_text()) for r in range(2)]
    first = seen[0][0][: cfg["batch"]] + seen[1][0][: cfg["batch"]]
    x, y = load_dataset(train_size=cfg["train_size"], verbose=False).train.tensors
    model = MLP(hidden=cfg["hidden"], depth=1)
    model.load_state_dict(good_run.load("init.pt"))
    F.cross_entropy(model(x[first]), y[first]).backward()
    assert max_rel_diff(g0, {n: p.grad for n, p in model.named_parameters()}) < 1e-5


def test_the_samplers_split_every_epoch_and_reshuffle(good_run):
    seen = [json.loads((good_run.out / f"indices_rank{r}.json").read_text()) for r in range(2)]
    n = good_run.summary["config"]["train_size"]
    for epoch in range(2):
        assert not set(seen[0][epoch]) & set(seen[1][epoch])
        assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(n))
    assert seen[0][0] != seen[0][1]


def test_no_sync_means_one_allreduce_per_optimizer_step_and_rank0_alone_logs_and_checkpoints(good_run):
    s = good_run.summary
    assert s["steps"] == 32 and s["allreduce_calls"] == s["steps"]  # accum 2: the first backward is under no_sync
    assert "] step  32/32" in good_run.logs[0]["stdout"] and "] step " not in good_run.logs[1]["stdout"]
    ckpt = torch.load(good_run.out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert set(ckpt) == {"model", "optimizer", "scaler"} and all(k.startswith("module.") for k in ckpt["model"])
    p0 = good_run.load("params_rank0.pt")
    assert all(torch.equal(ckpt["model"]["module." + k], p0[k]) for k in p0)
    assert "checkpoint.pt was written by rank 0 alone" not in good_run.logs[1]["stdout"]
    assert not list(good_run.out.glob("*.tmp"))


def test_fsdp2_shards_every_parameter_and_matches_ddp(good_run):
    fsdp = good_run.summary["fsdp"]
    for r in fsdp.values():
        assert 2 * r["held"] == r["total"]
        assert all(local[0] * 2 == full[0] for local, full in r["shapes"].values())
    assert fsdp["fp32"]["max_rel_diff_vs_ddp"] < 1e-5 and fsdp["fp32"]["grad_dtype"] == "float32"
    assert fsdp["bf16"]["logits_dtype"] == "bfloat16" and fsdp["bf16"]["max_rel_diff_vs_ddp"] < 0.05


@pytest.mark.timing
def test_a_rank_that_raises_is_named_and_nothing_is_left(tmp_path):
    # The time bound is the launch's own timeout, 240 s, for a launch that took 6-15 s with both cores busy
    # (tools/under_load.py): room for a far busier machine. It catches a failure that is reported only when
    # the timeout stops the run (the other rank left waiting in its all-reduce), which ends as a DDPTimeout.
    t0 = time.monotonic()
    with as_the_chapter_launches(tmp_path) as temp, pytest.raises(DDPRunError) as info:
        launch(["--backend", "gloo", "--fail-rank", "1", "--fail-at", "3"], name="failing", timeout=240)
    assert new_in_temp(temp) == [] and info.value.run.out == tmp_path / "runs" / "08_distributed" / "failing"
    assert not isinstance(info.value, DDPTimeout) and time.monotonic() - t0 < 240
    message = str(info.value)
    assert message.startswith("rank 1 failed first: RuntimeError: injected failure on rank 1"), message
    run = info.value.run
    assert run.leftovers() == [] and run.port_free()
    assert not L._pids_with_token("no-such-token")


@pytest.mark.timing
def test_a_hung_rank_is_stopped_by_the_timeout_and_nothing_is_left(tmp_path):
    # Bounded by construction, whatever the load: the 20 s timeout, then stopping, whose every wait has a
    # limit of its own (ddp_launch._stop: 10 s after SIGTERM, 5 s after SIGKILL, then _reap's 10 s): 45 s,
    # and 15 s for the Python between them. It catches a launch that waits out the group's 600 s timeout.
    t0 = time.monotonic()
    with pytest.raises(DDPTimeout) as info:
        launch(
            ["--backend", "gloo", "--hang-rank", "1", "--fail-at", "2", "--pg-timeout", "600"], out=tmp_path, timeout=20
        )
    assert time.monotonic() - t0 < 20 + 40  # the timeout, then at most the grace periods of stopping
    assert "no result after 20 s" in str(info.value) and "rank 1" in str(info.value)
    run = info.value.run
    assert run.returncode is None and run.leftovers() == []
    if run.port() is not None:  # rank 0 got far enough to print it
        assert run.port_free()


def test_a_rank_that_dies_while_exiting_after_its_work_is_said_to_have_done_so(tmp_path):
    with pytest.raises(DDPRunError) as info:
        launch(
            ["--backend", "gloo", "--train-size", "64", "--epochs", "1", "--crash-at-exit", "0"],
            out=tmp_path,
            timeout=240,
        )
    message = str(info.value)
    assert message.startswith(
        "rank 0 finished its work but crashed while exiting: exit code -6 (signal 6, SIGABRT), "
        "last said '[rank 0] injected crash at exit'"
    ), message
    assert "run the launch again" in message and info.value.run.leftovers() == []


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed from /proc (Linux)")
def test_the_worker_leaves_no_process_group_thread_running_at_exit(tmp_path):
    """The cause of the intermittent SIGABRT at exit: DDP (importing torch.distributed.nn late) and FSDP2's mesh
    (kept by DTensor's caches) held the group, so gloo's threads outlived destroy_process_group."""
    code = (
        "import sys; from course_lib.chapters.ch08 import ddp_worker as w; w.main(sys.argv[1:]); "
        "print('left:', w._group_threads())"
    )
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }  # a 1-rank group: the store on a free port
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(tmp_path),
            "--backend",
            "gloo",
            "--fsdp",
            "--train-size",
            "64",
            "--epochs",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "] done" in proc.stdout and "left: []" in proc.stdout, proc.stdout[-500:] + proc.stderr[-3000:]


def test_train_shows_ddp_whole_in_one_short_function():
    """Chapter 08 prints ddp_worker.train in a cell: every piece of DDP in it, in order, and nothing else."""
    import inspect

    from course_lib.chapters.ch08.ddp_worker import train

    source = inspect.getsource(train)
    assert len(source.splitlines()) <= 60, "the chapter prints train whole: keep it short"
    steps = [
        "LOCAL_RANK",
        "set_device(",
        "init_process_group(",
        "try:",
        "DDP(model",
        "DistributedSampler(",
        "GradScaler(device.type, enabled=dtype == torch.float16)",
        "set_epoch(epoch)",
        "amp_step(ddp",
        "if rank == 0:",
        "torch.save(",
        "dist.barrier()",
        "finally:",
        "destroy_process_group()",
    ]
    at = [source.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))
    assert not any(word in source for word in ("print(", "checksum", "json", "fsdp", "all_gather"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed from /proc (Linux)")
def test_the_instruments_only_watch_train_alone_trains_the_same_parameters(tmp_path):
    """train with the default Hooks() (plain DDP) and with main's Instruments, in a 1-rank group each: the same
    checkpoint, and without the instruments nothing else is written or printed."""
    plain, watched = tmp_path / "plain", tmp_path / "watched"
    code = (
        "import sys; from course_lib.chapters.ch08 import ddp_worker as w; a, b, *rest = sys.argv[1:]; "
        "w.train(w.parse_args([a, *rest])); print('plain done'); w.main([b, *rest])"
    )
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    plain.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(plain),
            str(watched),
            "--backend",
            "gloo",
            "--train-size",
            "96",
            "--epochs",
            "2",
            "--log-every",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("plain done\n") and "] done: 6 optimizer steps" in proc.stdout, proc.stdout
    assert sorted(p.name for p in plain.iterdir()) == ["checkpoint.pt"]
    a, b = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (plain, watched))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    momenta = [(a["optimizer"]["state"][i], b["optimizer"]["state"][i]) for i in a["optimizer"]["state"]]
    assert momenta and all(torch.equal(m["momentum_buffer"], n["momentum_buffer"]) for m, n in momenta)


# --------------------------------------------------------------------------- command lines and environment


def test_torchrun_command_for_one_machine_and_for_many():
    one = torchrun_command(2, log_dir="/tmp/x")
    assert one[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in one
    assert one[-4:] == ["--log-dir", "/tmp/x", "--redirects", "3"]
    many = torchrun_command("gpu", nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="job")
    assert "--standalone" not in many
    assert many[3:] == [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29400",
        "--rdzv-id",
        "job",
        "--nproc-per-node",
        "gpu",
    ]
    with pytest.raises(ValueError, match="rdzv_id"):
        torchrun_command(8, nnodes=2, rdzv_endpoint="node0:29400")


def test_the_environment_shares_the_cores_and_marks_every_process(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = L._environment(2, "tok")
    assert env[L.TOKEN_VAR] == "tok" and int(env["OMP_NUM_THREADS"]) >= 1


def test_the_first_failure_comes_from_torchruns_summary_when_no_rank_recorded_one(tmp_path):
    run = DDPRun(
        ["torchrun"],
        tmp_path,
        returncode=1,
        launcher_log=(
            "[1]:\n  time      : 2026\n  host      : h\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 5)\n"
        ),
    )
    assert L._first_failure(run) == "rank 1 exited with code -9 (signal 9, SIGKILL)"
    (tmp_path / "failed_rank0.json").write_text(json.dumps({"rank": 0, "time": 2.0, "error": "B: later"}))
    (tmp_path / "failed_rank3.json").write_text(json.dumps({"rank": 3, "time": 1.0, "error": "A:\n  first"}))
    assert L._first_failure(run) == "rank 3 failed first: A: first (then rank 0, because it left)"


def test_a_rank_that_crashed_after_done_is_named_as_such_and_the_one_torchrun_stopped_too(tmp_path):
    summary = (
        "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 7)\n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
        "  exitcode  : -6 (pid: 6)\n"
    )
    logs = {r: {"stdout": f"[rank {r}] done: 32 optimizer steps\n", "stderr": ""} for r in (0, 1)}
    logs[0]["stderr"] = (
        "terminate called without an active exception\nFatal Python error: Aborted\n\n"
        "Extension modules: numpy\n"
    )  # faulthandler's dump follows what the rank said
    message = L._first_failure(DDPRun(["torchrun"], tmp_path, returncode=1, logs=logs, launcher_log=summary))
    assert message.startswith(
        "rank 0 finished its work but crashed while exiting: exit code -6 (signal 6, SIGABRT), last said 'terminate "
        "called without an active exception'; rank 1 was then stopped by torchrun (exit code -15 (signal 15, "
        "SIGTERM)); its work was done (every rank's: "
    ), message
    assert "run the launch again" in message and "tools/stress_ddp.py" in message
    logs[1]["stdout"] = "[rank 1] step 3\n"  # rank 1 had not finished: no claim that the outputs are complete
    message = L._first_failure(DDPRun(["torchrun"], tmp_path, returncode=1, logs=logs, launcher_log=summary))
    assert "its work was done; what failed is the process's shutdown" in message


def test_show_prints_every_rank_with_lines_cut_at_100_characters(tmp_path, capsys):
    run = DDPRun(
        ["python", "-m", "torch.distributed.run"],
        tmp_path,
        logs={0: {"stdout": "a" * 150 + "\nok", "stderr": ""}, 1: {"stdout": "x\n" * 50, "stderr": "err"}},
    )
    run.show(max_lines=10)
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in out)
    assert "--- rank 1 stdout (50 lines) ---" in out and "[...]" in out and "--- rank 1 stderr (1 lines) ---" in out


# --------------------------------------------------------------------------- the one-process reference


def test_sampler_orders_are_distributed_samplers_orders():
    orders = D.sampler_orders(10, 4, 2, seed=3)
    for rank in range(4):
        s = DistributedSampler(range(10), num_replicas=4, rank=rank, shuffle=True, seed=3)
        assert orders[rank][0] == list(s)
        s.set_epoch(1)
        assert orders[rank][1] == list(s)
    repeated = D.sampler_orders(10, 4, 2, seed=3, set_epoch=False)
    assert all(r[0] == r[1] for r in repeated)


def test_global_batches_take_each_ranks_micro_batches_in_step_order():
    steps = D._global_batches(16, 2, batch_size=2, epochs=1, seed=0, set_epoch=True, accum_steps=2)
    orders = D.sampler_orders(16, 2, 1, seed=0)
    assert len(steps) == 2 and steps[0] == orders[0][0][:4] + orders[1][0][:4]
    assert sorted(i for s in steps for i in s) == list(range(16))


def _emulated_ddp(model, x, y, world, batch, epochs, lr, seed):
    """What DDP computes: each rank's mean loss on its micro-batch, gradients averaged, SGD with momentum."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    orders = D.sampler_orders(len(x), world, epochs, seed)
    for epoch in range(epochs):
        for start in range(0, len(orders[0][epoch]), batch):
            grads = []
            for rank in range(world):
                idx = orders[rank][epoch][start : start + batch]
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *g in zip(model.parameters(), *grads):
                p.grad = sum(g) / world
            opt.step()
    return model


def test_reference_train_is_what_ddp_computes_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    x, y = torch.randn(44, 6), torch.randint(0, 3, (44,))  # 22 per rank: a last, smaller batch of 4
    ref, losses = reference_train(model, x, y, world_size=2, batch_size=6, epochs=2, lr=0.1, seed=5)
    emulated = _emulated_ddp(model, x, y, 2, 6, 2, 0.1, 5)
    start = dict(model.named_parameters())
    assert len(losses) == 8
    assert max_rel_diff(dict(ref.named_parameters()), dict(emulated.named_parameters()), start=start) < 1e-5
    wrong, _ = reference_train(model, x, y, world_size=2, batch_size=6, epochs=2, lr=0.1, seed=5, set_epoch=False)
    assert max_rel_diff(dict(wrong.named_parameters()), dict(emulated.named_parameters()), start=start) > 1e-2


def test_max_rel_diff_against_size_or_against_movement():
    a, b, s = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 4.0])}, {"w": torch.tensor([1.0, 3.0])}
    assert max_rel_diff(a, b) == pytest.approx(0.5) and max_rel_diff(a, b, start=s) == pytest.approx(2.0)
    assert max_rel_diff(b, b) == 0.0
    two = {"u": torch.tensor([0.0, 1.0]), "v": torch.tensor([10.0])}  # the largest difference over the largest value
    assert max_rel_diff({"u": torch.tensor([0.0, 2.0]), "v": torch.tensor([10.0])}, two) == pytest.approx(0.1)


def test_adamw_keeps_sixteen_bytes_per_fp32_parameter():
    model = nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    state = training_state_bytes(model, opt)
    assert sum(state.values()) / 110 == 16 and state["optimizer state"] == 8 * 110


def test_the_gpu_reference_is_readable_with_one_gpu_and_with_several():
    run = {
        "world_size": 1,
        "backend": "nccl",
        "precision": "fp16",
        "scaler": True,
        "losses": [2.0, 1.5],
        "scales_by_rank": [[65536.0, 32768.0]],
        "steps": 2,
        "seconds": 1.0,
    }
    text = format_timing_reference({"nccl_runs": [run], "dp_vs_ddp": []})
    assert "GradScaler on, final scale 32768 (same on all ranks: True)" in text and "not measured" in text
    rows = [
        {"mode": m, "gpus": g, "median_ms": t, "q1_ms": t - 1, "q3_ms": t + 1, "images_per_s": 1e3}
        for m, g, t in (("1 GPU", 1, 10.0), ("DataParallel", 2, 14.0), ("DDP", 2, 11.0))
    ]
    text = format_timing_reference({"nccl_runs": [], "dp_vs_ddp": rows})
    assert "DataParallel" in text and all(len(line) <= 100 for line in text.splitlines())


def test_dataparallel_replicas_keep_the_autocast_dtype_only_when_forward_sets_it():
    # DataParallel runs each replica in a new thread under autocast(device, enabled=...) without a
    # dtype (torch/nn/parallel/parallel_apply.py); the dtype is per thread. The same on a CPU:
    import threading

    torch.manual_seed(0)
    lin, x, seen = torch.nn.Linear(8, 8), torch.randn(4, 8), {}

    def replica(name, module):
        with torch.autocast("cpu", enabled=True):  # what parallel_apply does in its worker thread
            seen[name] = module(x).dtype

    with torch.autocast("cpu", dtype=torch.float16):  # the caller's region asks for fp16
        for name, module in (("bare", lin), ("wrapped", AutocastForward(lin, torch.float16))):
            t = threading.Thread(target=replica, args=(name, module))
            t.start()
            t.join()
    assert seen == {"bare": torch.bfloat16, "wrapped": torch.float16}  # bare: the thread's default dtype
    assert AutocastForward(lin, None)(x).dtype == torch.float32  # None: autocast off
