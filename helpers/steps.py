"""The capstone's steps (notebook 06), each a kernel choice a learner can run, and the GPU's own numbers that say why
each step helps.

A step keeps what the ones before it built and adds one idea:

- ``rows``: notebook 01's kernel, one row per program (notebook 05's looped kernel for rows past ROW_BLOCK_LIMIT; the
  backward: notebook 04's);
- ``tiles``: several short rows per program, a whole row per program up to MAX_TILE_ROW (``tiles``);
- ``split``: longer rows split among programs that exchange partials, so x is read once (``split_rows``);
- ``aligned``: pieces placed on 16-byte boundaries, so odd row lengths load 16 bytes at a time: the course's kernels.

``python -m helpers.steps`` times every step over the row lengths in STEP_N and measures the GPU's numbers (what a
program costs to start, a load's latency); both go to results/ for the notebooks to read on CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from . import bench, fused, kernels, plans
from .device import DEVICE

STEPS = ("rows", "tiles", "split", "aligned")
STEP_N = (256, 1024, 4096, 16384, 32768, 50257, 65536, 131072, 262144)


def step_plan(step: str, n_cols: int, phase: str, element_size: int) -> plans.Plan | None:
    """The fused kernels' plan for rows of ``n_cols`` as of ``step``; None: the step runs notebook 01's (or 04's,
    05's) one-row kernels."""
    if step == "rows" or (step == "tiles" and triton.next_power_of_2(n_cols) > plans.MAX_TILE_ROW):
        return None
    if step == "tiles":
        return plans.tile_plan(n_cols)
    plan = plans.plan_for(n_cols, phase, element_size)
    return dataclasses.replace(plan, align=1) if step == "split" else plan


def launch_step_forward(step: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """y = softmax(x) over the rows of the 2-D ``x``, with ``step``'s kernels."""
    plan = step_plan(step, x.shape[1], "forward", x.element_size())
    if plan is None:
        kernels.launch_forward(x, y)
    else:
        fused.launch_rows_forward(x, y, plan)


def launch_step_backward(step: str, y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """dx from the 2-D ``y`` and ``dy``, with ``step``'s kernels."""
    plan = step_plan(step, y.shape[1], "backward", y.element_size())
    if plan is None:
        kernels.launch_backward(y, dy, dx)
    else:
        fused.launch_rows_backward(y, dy, dx, plan)


def sweep_steps(n_values=STEP_N, dtypes=(torch.float32, torch.bfloat16), total_elements: int = 2**27,
                progress: bool = True) -> list[bench.Result]:
    """Every step, forward and backward, on M x N inputs (M = total_elements // N), with the copy in the same run."""
    from tqdm.auto import tqdm

    gpu, date = bench.gpu_name(), datetime.date.today().isoformat()
    results = []
    for phase, dtype, n in tqdm([(p, d, n) for p in ("forward", "backward") for d in dtypes for n in n_values],
                                desc="steps", disable=not progress):
        m = max(total_elements // n, 1)
        x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
        y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
        out = torch.empty_like(x)
        ceiling = bench.copy_gbps(m * n, dtype)
        n_bytes = bench.ELEMENTS_MOVED[phase] * m * n * x.element_size()
        for step in STEPS:
            if phase == "forward":
                launch_step_forward(step, x, out)
                torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=1e-2, rtol=0)
                ms = bench.time_ms(lambda: launch_step_forward(step, x, out))  # noqa: B023 (timed here)
            else:
                launch_step_backward(step, y, dy, out)
                ms = bench.time_ms(lambda: launch_step_backward(step, y, dy, out))  # noqa: B023
            results.append(bench.Result(gpu, step, phase, str(dtype).removeprefix("torch."), m, n, ms,
                                        bench.gbps(n_bytes, ms), ceiling, date))
    return results


def steps_path(gpu: str) -> Path:
    path = bench.results_path(gpu)
    return path.with_name(path.stem + "-steps.csv")


def load_steps(path: Path | None = None) -> list[bench.Result]:
    """The recorded sweep of the steps: ``path``; else the reference GPU's."""
    return bench.read_rows(path or bench.recorded(steps_path), bench.Result)


@triton.jit
def empty_kernel(out_ptr):
    """A program that does nothing: a grid of them times what starting a program costs."""
    pass


@triton.jit
def chase_kernel(out_ptr, next_ptr, steps):
    """One thread follows ``steps`` links of a random cycle, each load's address the previous load's value: the time
    per link is the latency of one load from memory."""
    i = tl.load(next_ptr)
    for _ in range(steps):
        i = tl.load(next_ptr + i)
    tl.store(out_ptr, i)


def machine_numbers(device=DEVICE) -> dict:
    """The numbers that bound a kernel's bytes per program on this GPU: SMs, registers per SM, the copy's bandwidth,
    a load's latency from memory, and how often an SM starts a program (empty programs, back to back)."""
    properties = torch.cuda.get_device_properties(device)
    sms = properties.multi_processor_count
    out = torch.empty(1, dtype=torch.int64, device=device)
    programs = 1 << 22
    start_ms = bench.time_ms(lambda: empty_kernel[(programs,)](out, num_warps=1))
    links, chase_steps = 1 << 24, 20000  # a cycle over 128 MB, more than the L2 cache holds
    order = torch.randperm(links, device=device)
    next_index = torch.empty(links, dtype=torch.int64, device=device)
    next_index[order] = order.roll(-1)
    chase_ms = bench.time_ms(lambda: chase_kernel[(1,)](out, next_index, chase_steps, num_warps=1))
    return dict(gpu=bench.gpu_name(), sms=sms, registers_per_sm=properties.regs_per_multiprocessor,
                copy_gbps=bench.copy_gbps(2**27, torch.float32), latency_ns=chase_ms * 1e6 / chase_steps,
                program_start_ns=start_ms * 1e6 * sms / programs, date=datetime.date.today().isoformat())


def machine_path(gpu: str) -> Path:
    path = bench.results_path(gpu)
    return path.with_name(path.stem + "-machine.json")


def load_machine(path: Path | None = None) -> dict:
    return json.loads((path or bench.recorded(machine_path)).read_text())


# Figures of the steps (notebook 06)
STEP_STYLE = {"rows": ("one row per program (01, 05)", "tab:red", "v"),
              "tiles": ("+ tiles", "tab:blue", "s"),
              "split": ("+ split rows", "tab:purple", "D"),
              "aligned": ("+ aligned pieces", "tab:green", "o")}


def steps_figure(results: list[bench.Result], last: str, phase: str = "forward", dtypes=("float32", "bfloat16")):
    """Fraction of copy against row length for every step up to ``last``, the newest drawn boldest."""
    import matplotlib.pyplot as plt

    shown = STEPS[:STEPS.index(last) + 1]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 3.6), sharey=True)
    for ax, dtype in zip(axes, dtypes, strict=True):
        for step in shown:
            rows = sorted(bench.select(results, impl=step, phase=phase, dtype=dtype), key=lambda r: r.N)
            label, colour, marker = STEP_STYLE[step]
            ax.plot([r.N for r in rows], [r.gbps / r.copy_gbps for r in rows], marker=marker, color=colour,
                    label=label, linewidth=2.5 if step == last else 1, alpha=1 if step == last else 0.6)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="copy (the limit)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.set_xlabel("N (row length)")
        ax.set_title(f"{phase}, {dtype}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of copy")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"recorded on {results[0].gpu}, {results[0].date}", fontsize=9)
    fig.tight_layout()
    return fig


def start_bound(machine: dict, bytes_moved: float) -> float:
    """The fraction of copy an SM can reach when each program moves ``bytes_moved`` bytes and programs start one
    after another: a program's bytes over what the copy moves per SM while one program starts."""
    per_sm_bytes_per_ns = machine["copy_gbps"] / machine["sms"]  # GB/s is bytes per ns
    return min(1.0, bytes_moved / (per_sm_bytes_per_ns * machine["program_start_ns"]))


def program_bytes_figure(machine: dict, element_size: int = 4):
    """Bytes of x a forward program loads against row length, for one row per program and for the course's plans,
    between the floor the GPU's numbers set (a program must carry what the copy moves while the next one starts, and
    an SM must keep a latency's worth of bytes in flight) and the ceiling (an SM's registers)."""
    import matplotlib.pyplot as plt

    per_sm = machine["copy_gbps"] / machine["sms"]  # bytes per ns
    start_floor = per_sm * machine["program_start_ns"] / 2  # loaded bytes: half of what a forward program moves
    latency_floor = per_sm * machine["latency_ns"] / 2
    registers = machine["registers_per_sm"] * 4
    ns = [2**k for k in range(6, 21)]
    plans_ = [plans.plan_for(n, "forward", element_size) for n in ns]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.plot(ns, [n * element_size for n in ns], "v-", color="tab:red", label="one row per program")
    planned = [p.rows * min(p.block_n, n) * element_size for p, n in zip(plans_, ns, strict=True)]
    ax.plot(ns, planned, "o-", color="tab:green", label="the course's plan: tiles, then split pieces")
    ax.axhline(start_floor, color="tab:orange", linestyle="--",
               label=f"moved while an SM starts a program ({machine['program_start_ns']:.0f} ns)")
    ax.axhline(latency_floor, color="tab:gray", linestyle=":",
               label=f"in flight per SM over one load's latency ({machine['latency_ns']:.0f} ns)")
    ax.axhline(registers, color="black", linestyle="-.", label="an SM's registers")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("N (row length)")
    ax.set_ylabel("bytes of x per program")
    ax.set_title(f"{machine['gpu']}: {machine['sms']} SMs, copy {machine['copy_gbps']:,.0f} GB/s "
                 f"(fp{8 * element_size})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "drain", "mio_throttle", "not_selected",
          "math_pipe_throttle", "membar", "selected")


def load_profile(path: Path) -> dict:
    """One kernel's metrics from Nsight Compute's raw CSV (``ncu --csv --page raw``): name -> value."""
    import csv

    with path.open() as f:
        header, _units, values = list(csv.reader(f))[:3]
    return {name: value.replace(",", "") for name, value in zip(header, values, strict=True)}


def stall_reasons(profile: dict) -> dict[str, float]:
    """Warps stalled per issued instruction, by reason: where a kernel's warps wait."""
    return {reason: float(profile[f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"])
            for reason in STALLS}


def profile_figure(profiles: dict[str, dict]):
    """Where each profiled kernel's warps wait, with its DRAM throughput, registers and occupancy."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 3.4), sharex=True)
    for ax, (label, profile) in zip(axes, profiles.items(), strict=True):
        stalls = stall_reasons(profile)
        ax.barh(list(stalls)[::-1], list(stalls.values())[::-1], color="tab:blue")
        ax.set_title(f"{label}\nDRAM {float(profile['gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed']):.0f}%"
                     f" of peak, {profile['launch__registers_per_thread']} registers, "
                     f"{float(profile['sm__warps_active.avg.pct_of_peak_sustained_active']):.0f}% warps active",
                     fontsize=9)
        ax.set_xlabel("warps stalled per issued instruction")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


PROFILES = {"split, bf16, 2048 x 65536": "ncu-split-bf16-65536", "tile, fp32, 32768 x 4096": "ncu-tile-fp32-4096"}


def load_profiles(gpu: str = bench.REFERENCE_GPU) -> dict[str, dict]:
    """The recorded Nsight Compute profiles of one split and one tile forward ."""
    stem = bench.results_path(gpu).stem
    return {label: load_profile(bench.RESULTS_DIR / f"{stem}-{name}.csv") for label, name in PROFILES.items()}


def main() -> None:
    gpu = bench.gpu_name()
    numbers = machine_numbers()
    machine_path(gpu).write_text(json.dumps(numbers, indent=1) + "\n")
    print(numbers)
    results = sweep_steps()
    print(f"wrote {len(results)} rows to {bench.save_results(results, steps_path(gpu))}")
    for r in results:
        print(f"{r.phase:8s} {r.dtype:8s} N={r.N:6d} {r.impl:8s} {r.gbps / r.copy_gbps:5.2f} of copy")


if __name__ == "__main__":
    main()
