"""Chapter 06's library: the profiler wrapper, the trace reader, the diagnosis, the pictures, the CLI."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import matplotlib
import pytest
import torch

from course_lib.chapters.ch06 import measured_steps as M
from course_lib.chapters.ch06 import profiling as P
from course_lib.chapters.ch06 import traces as T
from course_lib.models import MLP
from course_lib.timing import Timing
from course_lib.train import TrainConfig, Trainer

matplotlib.use("Agg")


def tiny_trainer(**opt) -> tuple[Trainer, list]:
    torch.manual_seed(0)
    model = MLP(in_features=16, hidden=8, depth=2)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), **opt), TrainConfig(precision="fp32", device="cpu", progress=False)
    )
    return trainer, [(torch.randn(4, 16), torch.randint(0, 10, (4,)))]


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    trainer, batch = tiny_trainer()
    run = P.profile_steps(
        lambda: trainer.train_step(batch),
        wait=1,
        warmup=1,
        active=3,
        trace_dir=tmp_path_factory.mktemp("traces"),
        record_shapes=True,
        profile_memory=True,
    )
    return run, T.load_trace(run.traces[-1])


def test_the_schedule_is_the_installed_torchs():
    text = P.format_schedule(12, wait=2, warmup=1, active=3)
    assert text.splitlines()[1] == "  did   -  -  w  r  r  S  -  -  w  r  r  S"
    assert "(2 traces written" in text
    assert "(1 traces written" in P.format_schedule(12, wait=2, warmup=1, active=3, repeat=1)


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_profile_steps_runs_each_cycle_and_writes_one_chrome_trace_per_cycle(tmp_path):
    trainer, batch = tiny_trainer()
    run = P.profile_steps(lambda: trainer.train_step(batch), wait=1, warmup=1, active=2, repeat=2, trace_dir=tmp_path)
    assert len(run.step_ms) == 8 and all(t > 0 for t in run.step_ms)
    assert [os.path.basename(t) for t in run.traces] == ["step_4.pt.trace.json", "step_8.pt.trace.json"]
    assert all(json.loads(open(t).read())["traceEvents"] for t in run.traces)
    rows = {r["name"]: r for r in P.key_average_rows(run)}
    assert rows["Optimizer.step#AdamW.step"]["calls"] == pytest.approx(1.0)  # per profiled step
    table = P.format_key_averages(list(rows.values()), limit=8)
    assert all(len(line) <= 100 for line in table.splitlines()) and "self CPU" in table


def test_traces_go_to_a_git_ignored_folder_inside_the_course_whatever_the_cwd(tmp_path, monkeypatch):
    """JupyterLab's file browser (rooted at the repository) must reach the traces, and git must not see them."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)  # a kernel started in notebooks/, at the root, or anywhere else
    folder = P.trace_folder()
    assert folder.is_dir() and folder == root / "runs" / "06_profiling"
    relative = folder.relative_to(root).as_posix()
    probe = f"{relative}/fp32_5.pt.trace.json"
    ignored = subprocess.run(["git", "check-ignore", relative, probe], cwd=root, capture_output=True, text=True)
    assert ignored.stdout.split() == [relative, probe], f"{relative} is not git-ignored: {ignored}"
    assert P.trace_folder("x", root=tmp_path) == tmp_path / "runs" / "x"


def test_show_traces_lists_sizes_and_links_the_files_relative_to_the_chapters(tmp_path, capsys, monkeypatch):
    (tmp_path / "fp32_5.pt.trace.json").write_text("{}" * 600)
    assert P.show_traces(tmp_path) is None  # a cell ending in it shows the list, not a list of paths again
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'fp32_5.pt.trace.json'}  (1 KiB)"  # no IPython kernel
    shown = []
    monkeypatch.setattr("IPython.get_ipython", lambda: object())
    monkeypatch.setattr("IPython.display.display", lambda obj, raw: shown.append(obj))
    folder = P.trace_folder("test_show_traces")
    (folder / "a.pt.trace.json").write_text("{}")
    try:
        P.show_traces(folder)
    finally:
        (folder / "a.pt.trace.json").unlink()
        folder.rmdir()
    page = shown[0]["text/html"]
    assert '<a href="../runs/test_show_traces/a.pt.trace.json" download>' in page and "runs/test_show_traces/" in page
    P.show_traces(tmp_path)  # a folder outside the course: named by its full path
    assert f"<p>In <code>{tmp_path}/</code>" in shown[-1]["text/html"]


def test_the_profilers_banners_are_dropped_and_other_stderr_is_kept(capfd):
    with P.quiet_profiler():
        os.write(
            2,
            b"USDT:2026 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
            b"ERROR:2026 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
            b"something a learner must see\n",
        )
    err = capfd.readouterr().err
    assert "something a learner must see" in err and "USDT" not in err and "gpuGetDeviceCount" not in err


def test_trace_summary_of_a_cpu_training_step(cpu_trace):
    run, trace = cpu_trace
    s = T.trace_summary(trace)
    assert s["device"] == "cpu" and s["steps"] == 3 and s["step_ms"] > 0
    names = {r["name"] for r in s["ops"]}
    assert "Optimizer.step#AdamW.step" in names and any(n.startswith("autograd::engine") for n in names)
    assert "aten::linear" in names
    linear = next(r for r in s["ops"] if r["name"] == "aten::linear")
    assert linear["calls"] == 3 and linear["kernels"] >= 3 and "float" in linear["input_types"]
    assert all(r["device_ms"] <= r["cpu_ms"] + 1e-6 for r in s["ops"])  # on a CPU, kernels run inside their op
    assert 0 < T.matmul_share(s) < 1
    assert T.diagnose_trace(s)[0] in ("overhead", "compute")
    assert all(len(line) <= 100 for line in T.format_summary({"tiny": s}).splitlines())


def test_phases_and_the_timeline_picture(cpu_trace):
    _, trace = cpu_trace
    p = T._parse(trace)
    phases = [e["_phase"] for e in p["tops"] if e["_step"] == 0]
    assert phases[0] == "forward" and "backward" in phases and "optimizer" in phases
    assert phases.index("optimizer") > phases.index("backward")
    fig = T.plot_timeline(trace, "tiny")
    timeline, memory = fig.axes
    assert [t.get_text() for t in timeline.get_legend().get_texts()] == ["forward", "backward", "optimizer"]
    assert memory.get_ylabel() == "MiB" and "ms" in memory.get_xlabel()
    matplotlib.pyplot.close(fig)


def test_load_trace_reads_gzip(tmp_path, cpu_trace):
    run, trace = cpu_trace
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    assert T.load_trace(path) == trace
    with pytest.raises(ValueError, match="ProfilerStep"):
        T.trace_summary({"traceEvents": []})


def gpu_trace(data_us: float = 0, kernel_us: float = 800, dtype: str = "c10::BFloat16") -> dict:
    """The events a CUDA profile has: steps on the CPU (and their GPU shadow), an op that launches a
    kernel through cudaLaunchKernel, the kernel on the GPU, linked by a correlation id."""
    ev = []
    for i in range(3):
        t = 1000.0 * i
        ev += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i + 2}", "ts": t, "dur": 1000, "tid": 1},
            {
                "ph": "X",
                "cat": "gpu_user_annotation",
                "name": f"ProfilerStep#{i + 2}",
                "ts": t + 50,
                "dur": 990,
                "tid": 7,
            },
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "ts": t + 10 + data_us,
                "dur": 30,
                "tid": 1,
                "args": {"Input type": [dtype, dtype]},
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": t + 20 + data_us,
                "dur": 5,
                "tid": 1,
                "args": {"correlation": 100 + i},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "sm90_gemm",
                "ts": t + 100 + data_us,
                "dur": kernel_us,
                "tid": 7,
                "args": {"correlation": 100 + i},
            },
        ]
        if data_us:
            ev.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                    "ts": t + 1,
                    "dur": data_us,
                    "tid": 1,
                }
            )
    return {"traceEvents": ev}


def test_a_gpu_trace_links_kernels_to_the_ops_that_launched_them():
    s = T.trace_summary(gpu_trace())
    assert s["device"] == "cuda" and s["steps"] == 3 and s["step_ms"] == pytest.approx(1.0)
    (mm,) = s["ops"]
    assert mm["name"] == "aten::mm" and mm["device_ms"] == pytest.approx(0.8) and mm["kernels"] == 1
    assert mm["input_types"] == ["c10::BFloat16", "c10::BFloat16"]
    assert T.diagnose_trace(s) == ("compute", "fewer_flops")
    assert T.diagnose_trace(T.trace_summary(gpu_trace(dtype="float"))) == ("compute", "amp")
    assert T.diagnose_trace(T.trace_summary(gpu_trace(kernel_us=100))) == ("overhead", "fewer_launches")
    assert T.diagnose_trace(T.trace_summary(gpu_trace(data_us=500, kernel_us=100))) == ("data", "more_workers")
    fig = T.plot_timeline(gpu_trace())
    assert "GPU: kernels" in [t.get_text() for t in fig.axes[0].get_yticklabels()]
    matplotlib.pyplot.close(fig)


def test_the_cpu_rule_for_overhead_is_the_length_of_the_ops_doing_the_work():
    def summary(kernel_us: float, kernels: int) -> dict:
        return {
            "device": "cpu",
            "step_ms": 10.0,
            "ops": [
                {
                    "name": "aten::linear",
                    "calls": 1,
                    "cpu_ms": 9.0,
                    "device_ms": kernel_us * kernels / 1e3,
                    "kernels": kernels,
                    "input_types": ["float"],
                }
            ],
        }

    assert T.diagnose_trace(summary(5, 1000)) == ("overhead", "fewer_launches")
    assert T.diagnose_trace(summary(2000, 4)) == ("compute", "amp")


@pytest.mark.timing
def test_the_contrived_bottlenecks_are_what_they_say(tmp_path):
    # The diagnosis reads the trace's times: "data" needs 30% of the step in the DataLoader. Its 64 images
    # sleep 1 ms each (a floor no load can shorten) against about 4 ms of the rest on one thread: 95% of
    # the step on 2 quiet cores, 84% with both busy; the rest would have to grow 40-fold to tip it. A loader
    # whose wait the trace misses fails anywhere.
    steps = M.bottleneck_steps("cpu")
    assert list(steps) == ["data", "overhead", "compute"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a 2-core machine shared with other jobs, two threads wait for each other
    try:
        run = P.profile_steps(steps["data"], wait=0, warmup=1, active=2, trace_dir=tmp_path, name="data")
    finally:
        torch.set_num_threads(threads)
    assert T.diagnose_trace(T.trace_summary(T.load_trace(run.traces[-1])))[0] == "data"  # 64 images x 1 ms of sleep


def test_timing_three_ways_and_the_cost_of_a_read_back():
    calls = []

    def make_step():
        calls.append("fresh")
        return lambda: time.sleep(0.002)

    ways = M.naive_vs_proper(make_step, "cpu", repeats=3, iters=4)
    assert list(ways) == ["naive", "no sync", "proper"] and len(calls) == 3
    assert len(ways["naive"].times_ms) == 3 and len(ways["proper"].times_ms) == 4
    assert all(t.median_ms >= 2 for t in ways.values())
    cost = M.sync_cost("cpu", steps=2, iters=2, width=4, batch=4)
    assert list(cost) == ["read every step", "read every 2 steps"]
    assert all(len(line) <= 100 for line in M.format_timings(cost).splitlines())


def test_the_recording_cli_writes_summaries_that_format_profiling_reference_reads(tmp_path, monkeypatch):
    small, time_fn, sync_cost, naive_vs_proper = M.make_trainer, P.time_fn, M.sync_cost, M.naive_vs_proper

    def tiny_make_trainer(precision="fp32", device="auto", width=None, batch=None, log_every=10):
        return small(precision, device, width=4, batch=8, log_every=log_every)

    for module in (P, M):  # looked up by profiling's _record_all and by measured_steps' sync_cost, naive_vs_proper
        monkeypatch.setattr(module, "make_trainer", tiny_make_trainer)
        monkeypatch.setattr(
            module, "time_fn", lambda fn, iters=10, **kw: time_fn(fn, **{**kw, "warmup": 1, "iters": 3})
        )
    for name, fast in (
        ("sync_cost", lambda device, **kw: sync_cost(device, steps=2, iters=2, **kw)),
        ("naive_vs_proper", lambda make, device: naive_vs_proper(make, device, repeats=2, iters=3)),
    ):
        monkeypatch.setattr(P, name, fast)  # the real sizes take minutes on a CPU
    trainer, batch = tiny_trainer(foreach=False)
    monkeypatch.setattr(P, "bottleneck_steps", lambda device: {"overhead": lambda: trainer.train_step(batch)})
    out = tmp_path / "profiling_cpu.json"
    assert P.main(["--device", "cpu", "--json", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert ref["provenance"]["command"].startswith("python -m course_lib.chapters.ch06.profiling")
    assert set(ref) >= {"steps", "bottlenecks", "timing", "sync"} and set(ref["steps"]) == {"fp32", "bf16"}
    assert all(len(v["summary"]["ops"]) <= 9 for v in ref["steps"].values())  # 8 heaviest + the rest, summed
    assert out.stat().st_size < 100_000  # summaries, not traces
    ref["memory"] = {"fp32": dict.fromkeys(("start", "forward", "backward", "optimizer", "end"), 1.0)}
    ref["snapshot"] = {
        "allocs": 3,
        "peak_mib": 2.0,
        "reserved_mib": 4.0,
        "largest": [{"mib": 1.0, "where": "profiling.py:1 step"}],
    }
    for part in ("steps", "bottlenecks", "sync", "timing", "memory"):
        text = P.format_profiling_reference(ref, part)
        assert text and all(len(line) <= 100 for line in text.splitlines()), part


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_per_phase_and_snapshot(tmp_path):
    trainer, batch = M.make_trainer("auto", "cuda", batch=64)
    phases = M.cuda_phase_memory(trainer, batch)
    assert phases["start"] > 0 and phases["backward"] >= phases["start"]
    summary = M.memory_snapshot_summary(lambda: trainer.train_step(batch), tmp_path / "s.pickle")
    assert summary["allocs"] > 0 and summary["largest"] and (tmp_path / "s.pickle").exists()


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


CPP_BACKWARD = [
    _frame("??", 0, "torch::unwind::unwind()"),
    _frame("??", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)"),
    _frame("??", 0, "at::native::empty_cuda(...)"),
    _frame("??", 0, "torch::autograd::generated::ConvolutionBackward0::apply(std::vector<at::Tensor>&&)"),
    _frame("??", 0, "torch::autograd::Engine::evaluate_function(...)"),
    _frame("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask> const&)"),
]
ENGINE_ONLY = [_frame("??", 0, "torch::unwind::unwind()"), _frame("??", 0, "torch::autograd::Engine::thread_main()")]
NO_AUTOGRAD = [_frame("??", 0, "torch::unwind::unwind()"), _frame("??", 0, "ncclKernelLaunch")]
FORWARD = [
    _frame("??", 0, "torch::unwind::unwind()"),
    _frame("/usr/lib/python3/site-packages/torch/nn/modules/conv.py", 548, "_conv_forward"),
    _frame("/work/course/course_lib/models.py", 37, "forward"),
    _frame("/tmp/ipykernel_1/123.py", 4, "<module>"),
]


def test_snapshot_allocations_are_placed_by_python_frame_and_backward_ones_are_named():
    # A fake snapshot shaped like torch.cuda.memory._snapshot(): innermost frame first, as the allocator records
    MiB = 2**20
    snap = {
        "segments": [{"total_size": 8 * MiB}, {"total_size": 2 * MiB}],
        "device_traces": [
            [
                {"action": "alloc", "size": 3 * MiB, "frames": FORWARD},
                {"action": "alloc", "size": 4 * MiB, "frames": CPP_BACKWARD},
                {"action": "free_requested", "size": 3 * MiB, "frames": FORWARD},
                {"action": "free_completed", "size": 3 * MiB, "frames": FORWARD},
                {"action": "alloc", "size": 1 * MiB, "frames": ENGINE_ONLY},
                {"action": "alloc", "size": 2 * MiB, "frames": NO_AUTOGRAD},
            ]
        ],
    }
    s = M.summarise_snapshot(snap)
    assert s["allocs"] == 4 and s["peak_mib"] == 7.0 and s["reserved_mib"] == 10.0
    assert [(a["mib"], a["where"]) for a in s["largest"]] == [
        (4.0, "autograd backward, ConvolutionBackward0 (no Python frame)"),
        (3.0, "models.py:37 forward"),  # the first Python frame outside torch, not conv.py or the C++ frames
        (2.0, "no Python frame (C++ only)"),
        (1.0, "autograd backward (no Python frame)"),
    ]
    assert all("unwind" not in a["where"] for a in s["largest"])
    inside_torch_only = [_frame("??", 0, "x"), _frame("/site-packages/torch/optim/adamw.py", 90, "_single_tensor")]
    assert M.allocation_site(inside_torch_only) == "adamw.py:90 _single_tensor"
    assert M.allocation_site([_frame("<string>", 1, "<module>")]) == "<string>:1 <module>"


def test_a_recorded_snapshot_without_python_frames_reads_as_autograd_backward():
    ref = {
        "memory": {},
        "snapshot": {
            "allocs": 2,
            "peak_mib": 2.0,
            "reserved_mib": 4.0,
            "largest": [
                {"mib": 1.5, "where": "??:0 torch::unwind::unwind()"},
                {"mib": 1.0, "where": "models.py:37 forward"},
            ],
        },
    }
    text = P.format_profiling_reference(ref, "memory")
    assert "1.5 MiB  autograd backward (no Python frame)" in text and "1.0 MiB  models.py:37 forward" in text
    assert "first C++ frame" in text and all(len(line) <= 100 for line in text.splitlines())


def test_the_snapshot_is_read_against_the_phase_table_reserved_against_the_largest_peak():
    phases = {
        "fp32": {"start": 90.0, "forward": 1500.0, "backward": 2000.0, "optimizer": 91.0, "end": 90.0},
        "bf16": {"start": 90.0, "forward": 1000.0, "backward": 1190.0, "optimizer": 91.0, "end": 90.0},
    }
    ref = {"memory": phases, "snapshot": {"allocs": 3, "peak_mib": 1100.0, "reserved_mib": 8000.0, "largest": []}}
    text = " ".join(P.format_profiling_reference(ref, "memory").split())
    # the snapshot is of the last precision's step: its peak above the start adds up to that step's backward peak
    assert "step (bf16): start + peak = 1,190.0 MiB, its backward column 1,190.0 MiB" in text
    assert "reserved 4.0x the table's largest peak" in text


def _ways(naive, nosync, proper):
    return {"naive": Timing(naive), "no sync": Timing(nosync), "proper": Timing(proper)}


def test_the_three_timings_are_read_against_each_other():
    # The H100 record of 2026-11-26, rounded: a first call 0.58 ms long, 0.65 ms left queued: they cancel
    h100 = _ways(
        [3.65, 2.84, 2.79, 2.45, 2.55],
        [2.21, 2.34, 2.22, 2.23, 2.19, 2.27, 1.99, 1.85, 6.16, 2.04],
        [2.80, 2.92, 2.96, 2.85, 2.82, 2.95, 2.91, 2.88, 2.78, 2.81],
    )
    text = M.read_timing_ways(h100)
    assert "naive - no sync  = +0.58 ms" in text and "proper - no sync = +0.65 ms" in text and "cancel" in text
    cpu = M.read_timing_ways(_ways([9.0, 9.5, 10.0], [5.0, 5.1, 4.9, 5.0], [5.0, 5.05, 4.95, 5.1]))
    assert "nothing was left queued" in cpu and "+4.50 ms" in cpu
    warm_gpu = M.read_timing_ways(_ways([2.0, 2.1, 2.0], [2.0, 2.05, 1.95, 2.0], [3.0, 3.05, 2.95, 3.0]))
    assert "short by what the missing synchronize drops, 1.00 ms" in warm_gpu
    cold_gpu = M.read_timing_ways(_ways([300.0, 310.0], [2.0, 2.05, 1.95, 2.0], [3.0, 3.05, 2.95, 3.0]))
    assert "long by" in cold_gpu
    for t in (text, cpu, warm_gpu, cold_gpu):
        assert all(len(line) <= 100 for line in t.splitlines())


def test_a_first_call_within_the_spread_is_not_read_as_a_cost():
    noisy = M.read_timing_ways(_ways([76.0, 70.0, 117.0], [100.0, 68.0, 156.0, 99.0], [99.0, 34.0, 125.0, 101.0]))
    assert "cannot tell it from the spread" in " ".join(noisy.split()) and "alone, -" not in noisy


# --------------------------------------------------------------------------- what the chapter leaves on disk


def new_in_temp(folder) -> list[str]:
    """What appeared in a (redirected) system temporary folder. torch's own compile cache,
    torchinductor_<user>, is not a run's leftover: torch makes it once per user and every run shares it."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.fixture
def system_temp(tmp_path, monkeypatch):
    """tempfile.gettempdir() and $TMPDIR (for child processes) redirected to an empty folder."""
    folder = tmp_path / "system-temp"
    folder.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_chapter_06_writes_one_trace_per_experiment_under_runs_and_nothing_in_the_temp_folder(tmp_path, system_temp):
    """As the chapter calls them: trace_folder(fresh=True) empties runs/06_profiling/ of an earlier run's
    files, every experiment writes under its own name (none overwrites another), the trace recorded with
    profile_memory=True holds the memory events its timeline draws, and nothing goes to the temp folder."""
    folder = P.trace_folder(root=tmp_path, fresh=True)
    (folder / "fp32_5.pt.trace.json").write_text("{}")  # an earlier run's trace, under an old name
    folder = P.trace_folder(root=tmp_path, fresh=True)
    assert list(folder.iterdir()) == []
    trainer, batch = tiny_trainer()
    written = {}
    for name, memory in (("fp32_memory", True), ("autocast_fp32", False), ("bottleneck_compute", False)):
        run = P.profile_steps(
            lambda: trainer.train_step(batch), trace_dir=folder, name=name, record_shapes=True, profile_memory=memory
        )
        written[name] = T.load_trace(run.traces[-1])
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}_5.pt.trace.json" for n in written)
    memory_events = {n: sum(e.get("name") == "[memory]" for e in t["traceEvents"]) for n, t in written.items()}
    assert memory_events["fp32_memory"] > 0 and memory_events["autocast_fp32"] == 0
    assert T._parse(written["fp32_memory"])["memory"]  # the timeline's memory panel has something to draw
    assert new_in_temp(system_temp) == []


def test_exercise_06s_profile_is_read_and_removed_with_its_temporary_folder(system_temp):
    """The exercise's cell profiles the course model into a TemporaryDirectory and reads the trace there:
    nothing of it stays in the system's temp folder (exercise 06 used to leave a 470 KB trace per run)."""
    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "solutions" / "06_profiling_exercises.ipynb", 4)
    cells = {c.get("id"): c.source for c in nb.cells}
    namespace: dict = {}
    exec(cells["c03-06_profiling_exe"].replace('check("06.diagnose_step", diagnose_step)', ""), namespace)
    exec(cells["c05-06_profiling_exe"], namespace)
    assert namespace["measured"]["steps"] == 3 and namespace["run"].traces
    assert not Path(namespace["run"].traces[-1]).exists() and new_in_temp(system_temp) == []


def test_the_timelines_are_titled_in_words():
    assert set(T.DIAGNOSES) == {"data", "overhead", "compute"}
    ref = {
        "bottlenecks": {
            "data": {
                "summary": {
                    "device": "cpu",
                    "steps": 3,
                    "step_ms": 10.0,
                    "ops": [
                        {
                            "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                            "calls": 1,
                            "cpu_ms": 6.0,
                            "device_ms": 0.0,
                            "kernels": 0,
                            "input_types": [],
                        }
                    ],
                },
                "diagnosis": ["data", "more_workers"],
            }
        }
    }
    text = P.format_profiling_reference(ref, "bottlenecks")
    assert "data: diagnosed waiting for data; fix: load and transform" in text
