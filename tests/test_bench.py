"""The recorded GPU results the notebooks plot on CPU, the figures drawn from them, and the tuning's candidates."""

import csv
import dataclasses

import matplotlib
import pytest
import torch

from helpers import DEVICE, bench, bench_attention, bench_calls, figures, figures_calls, flash_attention, fused, tune
from helpers.everyday import everyday_path
from helpers.steps import machine_path, steps_path

matplotlib.use("Agg")
RESULTS = bench.load_results()


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_recorded_sweep_covers_the_grid(phase, dtype):
    for n in bench.GRID_N:
        rows = bench.select(RESULTS, phase=phase, dtype=dtype, N=n)
        assert {"helpers", "torch", "compile"} <= {r.impl for r in rows}, (phase, dtype, n)
        assert all(r.ms > 0 and r.copy_gbps > 0 and r.M * r.N <= 2**27 for r in rows)


def test_recorded_kernels_do_not_spill():
    (path,) = bench.RESULTS_DIR.glob(bench.results_path(RESULTS[0].gpu).stem + "-spills.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(int(r["n_spills"]) == 0 for r in rows)


def test_figures_draw_from_recorded_results():
    assert len(figures.peers_figure(RESULTS).axes) == 6
    assert len(figures.tuning_figure(bench.load_tuning()).axes) == 3
    fig = figures.bandwidth_figure(RESULTS, "forward", ["naive", "torch", "row"])
    assert [len(ax.lines) for ax in fig.axes] == [4, 4]  # the copy ceiling and three implementations per dtype
    texts = figures.forward_graph_figure().axes[0].texts  # a box per node; a label and an arrow (annotation) per edge
    assert len(texts) == len(figures.GRAPH_NODES) + 2 * len(figures.GRAPH_EDGES)
    latency = bench_calls.load_latency()
    fig = figures_calls.latency_figure(latency)  # a panel per phase and row count: each impl recorded, and a graph
    assert len(fig.axes) == 2 * len(bench_calls.DECODE_M) and all(len(ax.lines) >= 3 for ax in fig.axes)
    assert all(any("copying" in line.get_label() for line in ax.lines) for ax in fig.axes)  # the copy, dotted
    bars = figures_calls.host_figure(latency).axes[0].patches  # a bar per implementation and case
    cases = 2 * 2 * len(bench_calls.HOST_SHAPES)  # phases x dtypes x shapes
    assert len(bars) % cases == 0 and len(bars) >= 2 * cases


def test_recorded_latency_covers_the_decode_grid():
    latency = bench_calls.load_latency()
    for phase in ("forward", "backward"):
        for dtype in ("bfloat16", "float32"):
            for m in bench_calls.DECODE_M:
                for n in bench_calls.DECODE_N:
                    rows = bench.select(latency, phase=phase, dtype=dtype, M=m, N=n)
                    assert {("helpers", "eager"), ("helpers", "graph"), ("helpers", "host"), ("torch", "eager"),
                            ("copy", "eager")} <= {(r.impl, r.measure) for r in rows}, (phase, dtype, m, n)
            for m, n in bench_calls.HOST_SHAPES:
                rows = bench.select(latency, phase=phase, dtype=dtype, M=m, N=n, measure="host")
                assert {"helpers", "torch"} <= {r.impl for r in rows} and all(r.us > 0 for r in rows)


def test_recorded_other_dims_cover_their_shapes():
    rows = bench_calls.load_other_dims()
    for shape, dim, dtype in bench_calls.OTHER_DIMS:
        for phase in ("forward", "backward"):
            recorded = bench.select(rows, shape="x".join(map(str, shape)), dim=dim, phase=phase,
                                    dtype=str(dtype).removeprefix("torch."))
            assert {"helpers", "torch"} <= {r.impl for r in recorded} and all(0 < r.gbps for r in recorded)


def test_results_path_names_the_gpu():
    assert bench.results_path("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.csv"


def test_claims_are_checked_on_the_reference_gpus_sweep(capsys):
    """A notebook's checks read the reference GPU's numbers: its own timings as they are, another GPU's replaced by
    the reference record, with a line that says so."""
    record = bench.load_results(bench.results_path(bench.REFERENCE_GPU))
    assert bench.claimed(record) is record and not capsys.readouterr().out
    elsewhere = [dataclasses.replace(r, gpu="NVIDIA H200", gbps=r.gbps / 2) for r in record[:3]]
    assert bench.claimed(elsewhere) == record
    assert "Timed above on NVIDIA H200" in capsys.readouterr().out


def test_recorded_tuning_is_the_tuned_gpus():
    assert {row["gpu"] for row in bench.load_tuning()} == {bench.TUNED_GPU}


RECORDS = (bench.results_path, bench_calls.latency_path, bench_calls.other_dims_path, everyday_path,
           bench_attention.attention_path, steps_path, machine_path)


def test_a_gpu_with_its_own_records_reads_the_reference_gpus(monkeypatch, tmp_path):
    """After `make bench` on a GPU other than the reference, results/ holds that GPU's records beside the reference's.
    The notebooks' checks assert the figures their text quotes, so every loader still reads the reference GPU's;
    only `make images` draws the GPU's own."""
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench, "INTERPRET", False)
    monkeypatch.setattr(bench, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(bench, "gpu_name", lambda: "NVIDIA A100-SXM4-80GB")
    for path_for in RECORDS:
        for gpu in (bench.REFERENCE_GPU, "NVIDIA A100-SXM4-80GB"):
            path_for(gpu).write_text(gpu)
        assert bench.recorded(path_for) == path_for(bench.REFERENCE_GPU)
        assert bench.own_recorded(path_for) == path_for("NVIDIA A100-SXM4-80GB")
    machine_path(bench.REFERENCE_GPU).unlink()
    with pytest.raises(FileNotFoundError, match="no recorded"):
        bench.recorded(machine_path)


def test_an_h200_reads_the_reference_sweep(monkeypatch):
    """results/ holds an H200 sweep of earlier kernels: on an H200, the notebooks still read the reference one."""
    monkeypatch.setattr(bench, "INTERPRET", False)
    monkeypatch.setattr(bench, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(bench, "gpu_name", lambda: "NVIDIA H200")
    assert bench.results_path("NVIDIA H200").exists()
    assert {r.gpu for r in bench.load_results()} == {bench.REFERENCE_GPU}
    assert {r.gpu for r in bench.load_results(bench.own_recorded(bench.results_path))} == {"NVIDIA H200"}


def test_recorded_attention_covers_every_case_and_meets_the_targets():
    rows = bench_attention.load_attention()
    for head_dim, causal in bench_attention.CASES:
        for phase in ("forward", "backward"):
            recorded = bench.select(rows, head_dim=head_dim, causal=causal, phase=phase)
            assert {r.impl for r in recorded} == set(bench_attention.IMPLS), (head_dim, causal, phase)
            (ours,) = [r for r in recorded if r.impl == "helpers"]
            assert ours.max_error < 0.02 and ours.tflops < ours.matmul_tflops
    ratios = bench_attention.target_ratios(rows)
    assert len(ratios) == 12 and all(ratio >= 1.0 for ratio in ratios.values())  # every target met
    assert len(bench_attention.attention_figure(rows).axes) == 2  # forward and backward


def test_attention_tiles_are_the_best_of_the_recorded_tuning():
    path = bench_attention.attention_path(bench.REFERENCE_GPU)
    with path.with_name(path.stem + "-tuning.csv").open() as f:
        tuning = list(csv.DictReader(f))
    assert bench_attention.best_tiles(tuning) == {key: tuple(blocks) for key, blocks
                                                   in flash_attention.GPU_BLOCKS["16-bit"].items()}


def test_best_tiles_sums_causal_and_full_and_skips_spilling_candidates():
    def row(block_m, causal, ms, spills=0):
        return dict(kernel="forward", head_dim="64", causal=str(causal), block_m=str(block_m), block_n="64",
                    num_warps="4", num_stages="3", ms=str(ms), spills=str(spills))

    rows = [row(64, False, 1.0), row(64, True, 0.5),  # 1.5 in all
            row(128, False, 0.9), row(128, True, 0.7),  # faster without the mask, slower in all: 1.6
            row(32, False, 0.5), row(32, True, 0.3, spills=4)]  # fastest, but spills under the mask
    assert bench_attention.best_tiles(rows) == {("forward", 64): (64, 64, 4, 3)}


def test_recorded_attention_profiles():
    profiles = bench_attention.load_attention_profiles()
    assert list(profiles) == list(bench_attention.PROFILED)
    names = {impl: profile["Kernel Name"] for impl, profile in profiles.items()}
    assert names["helpers"] == "attention_forward_kernel" and "flex_attention" in names["flex"] \
        and "sdpa" in names["cudnn"], names  # each file holds its implementation's attention kernel
    assert all(0 < bench_attention.tensor_busy(profile) < 100 for profile in profiles.values())
    assert len(bench_attention.profile_figure(profiles).axes) == 2


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_sweep_times_only_right_outputs(monkeypatch, capsys, phase):
    """An implementation whose output is wrong (QuACK 0.6.5's 16-bit forward over rows of 151936 returns NaN) is
    reported and not timed; right ones are timed. The timer, the copy and the GPU's name are stubbed:
    only the check runs."""
    import torch

    monkeypatch.setattr(bench, "time_ms", lambda fn: 1.0)
    monkeypatch.setattr(bench, "copy_gbps", lambda n, dtype: 1.0)
    monkeypatch.setattr(bench, "gpu_name", lambda: "a stub")
    right = bench.forward_impls()["torch"] if phase == "forward" else bench.backward_impls()["torch"]
    impls = {"torch": right,
             "nan": lambda *inputs: lambda: torch.full_like(inputs[0], float("nan")),
             "input": lambda *inputs: lambda: inputs[-1]}  # x forward, dy backward: not softmax
    monkeypatch.setattr(bench, "forward_impls" if phase == "forward" else "backward_impls", lambda: impls)
    results = bench.sweep([96], total_elements=96 * 4, phases=(phase,), progress=False)
    assert [r.impl for r in results] == ["torch"]
    printed = capsys.readouterr().out
    assert "nan" in printed and "input" in printed and printed.count("wrong output") == 2


def test_latency_sweep_reports_wrong_and_refused_calls(monkeypatch, capsys):
    """The decode grid checks each call's output before timing it; a call that raises there (Liger refuses rows past
    65536 when called, not when made) is reported and skipped like a wrong one. Timers, host and GPU name stubbed."""
    import torch

    def refuses(*inputs):
        def call():
            raise RuntimeError("rows too long")
        return call

    monkeypatch.setattr(bench_calls, "time_ms", lambda fn: 1.0)
    monkeypatch.setattr(bench_calls, "graph_us", lambda fn: 1.0)
    monkeypatch.setattr(bench_calls, "cpu_ms_per_calls", lambda fns: {key: 1.0 for key in fns})
    monkeypatch.setattr(bench_calls, "gpu_name", lambda: "a stub")
    monkeypatch.setattr(bench_calls, "HOST_SHAPES", [])
    monkeypatch.setattr(bench_calls, "DECODE_M", [2])
    monkeypatch.setattr(bench_calls, "DECODE_N", [96])
    real = bench_calls.latency_impls
    monkeypatch.setattr(bench_calls, "latency_impls", lambda phase: {
        "torch": real(phase)["torch"], "refuses": refuses,
        "nan": lambda x, y, dy: lambda: torch.full_like(x, float("nan"))})
    results = bench_calls.sweep_latency(dtypes=(torch.float32,), progress=False)
    assert {(r.impl, r.phase) for r in results} == {(impl, phase) for impl in ("torch", "copy")
                                                    for phase in ("forward", "backward")}
    printed = capsys.readouterr().out
    assert printed.count("RuntimeError: rows too long") == 2 and printed.count("wrong output") == 2


def test_recorded_peers_only_where_their_output_was_right():
    """The sweeps record no time for a peer where its output was checked wrong (results/<gpu>-quack-check.csv), and
    that check found QuACK's 16-bit forward over rows of 151936 wrong and its backward right."""
    with (bench.RESULTS_DIR / "nvidia-h100-80gb-hbm3-quack-check.csv").open() as f:
        checked = list(csv.DictReader(f))
    wrong = {(r["phase"], r["dtype"], int(r["N"])) for r in checked if r["right"] == "False"}
    assert {("forward", "bfloat16", 151936), ("forward", "float16", 151936)} <= wrong
    assert all(phase == "forward" and dtype != "float32" for phase, dtype, _ in wrong)
    recorded = bench.load_results(bench.results_path(bench.REFERENCE_GPU))
    latency = bench_calls.load_latency(bench_calls.latency_path(bench.REFERENCE_GPU))
    quack = [(r.phase, r.dtype, r.N) for r in [*recorded, *latency] if r.impl == "quack"]
    assert quack and not wrong & set(quack)


def test_recorded_grid_meets_the_bandwidth_targets():
    """The reference GPU's recorded grid: every point with N >= 1024 at 0.95 of copy or more, forward and backward in
    every dtype, and none more than 0.01 of copy behind the best peer timed beside it (QuACK included)."""
    recorded = bench.load_results(bench.results_path(bench.REFERENCE_GPU))
    peers = ("torch", "compile", "liger", "quack")
    checked = 0
    for r in bench.select(recorded, impl="helpers"):
        if r.N not in bench.GRID_N:
            continue
        ours = r.gbps / r.copy_gbps
        best = max(p.gbps / p.copy_gbps for p in bench.select(recorded, phase=r.phase, dtype=r.dtype, N=r.N)
                   if p.impl in peers)
        assert r.N < 1024 or ours >= 0.95, (r.phase, r.dtype, r.N, ours)
        assert ours >= best - 0.01, (r.phase, r.dtype, r.N, ours, best)
        checked += 1
    assert checked == 2 * 3 * len(bench.GRID_N)


@pytest.mark.parametrize("n_cols, element_size", [(1000, 4), (5000, 2), (50257, 2)])
def test_tuning_candidates_cover_the_row(n_cols, element_size):
    candidates = tune.candidate_plans(n_cols, element_size)
    assert candidates and len(set(candidates)) == len(candidates)
    for plan in candidates:
        if plan.segments == 1:
            assert plan.block_n >= n_cols
        else:
            assert plan.segments * plan.block_n >= n_cols + plan.align - 1


def test_tuning_candidates_launch():
    x = torch.randn(3, 5000, device=DEVICE) * 4
    candidates = tune.candidate_plans(5000, 4)
    for plan in (min(candidates, key=lambda p: p.segments), max(candidates, key=lambda p: p.segments)):
        y = torch.full_like(x, float("nan"))
        fused.launch_rows_forward(x, y, plan)
        torch.testing.assert_close(y, torch.softmax(x, -1))
