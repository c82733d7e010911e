"""FlashAttention measured (notebook 10): ``helpers.attention`` against SDPA's cuDNN and flash backends, FlexAttention
(torch.compile's Triton kernels) and the naive PyTorch version, in TFLOP/s forward and backward, with the bf16 matmul
ceiling measured in the same run. ``python -m helpers.bench_attention`` (part of ``make bench``) writes
results/<gpu>-attention.csv; on a machine with no GPU the notebook reads the recorded file.
"""

from __future__ import annotations

import csv
import datetime
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from . import bench
from .bench import gpu_name, read_rows, recorded, results_path, save_results, select, time_ms
from .device import DEVICE

BATCH, HEADS, SEQ = 4, 16, 4096
CASES = [(128, False), (128, True), (64, False), (64, True)]  # (head_dim, causal)
IMPLS = ("helpers", "cudnn", "flash", "flex", "naive")
# The course's targets: forward at least FlexAttention's and 0.75 of SDPA's best backend, backward 0.8 of Flex's.
FORWARD_OF_FLEX, FORWARD_OF_BEST_SDPA, BACKWARD_OF_FLEX = 1.0, 0.75, 0.8
ROUNDS = 3  # timings of each implementation or tile, interleaved; the median is kept


@dataclass
class AttentionResult:
    """One implementation on one case: milliseconds per call, TFLOP/s, the largest difference from cuDNN's output
    (forward) or gradients (backward), and the matmul ceiling of the same run."""

    gpu: str
    impl: str
    head_dim: int
    causal: bool
    phase: str
    ms: float
    tflops: float
    max_error: float
    matmul_tflops: float
    date: str


def attention_flops(head_dim: int, causal: bool, phase: str, batch: int = BATCH, heads: int = HEADS,
                    seq: int = SEQ) -> float:
    """Two matmuls of seq x seq x head_dim per head forward (2 flops a multiply-add), half of them under a causal
    mask; the backward's five (S recomputed, dP, dV, dQ, dK) count 2.5 times the forward's."""
    forward = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return forward if phase == "forward" else 2.5 * forward


def matmul_tflops(n: int = 8192) -> float:
    """The ceiling: a bf16 n x n x n matmul (cuBLAS on the tensor cores)."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    return 2 * n**3 / time_ms(lambda: a @ a) / 1e9


def attention_impls(causal: bool) -> dict:
    """Each implementation as a function of (q, k, v) returning O, differentiable."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from .attention_ops import attention
    from .reference import attention_reference

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    flex = torch.compile(flex_attention)
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, SEQ, SEQ) if causal else None
    return {"helpers": lambda q, k, v: attention(q, k, v, causal=causal),
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=mask),
            "naive": lambda q, k, v: attention_reference(q, k, v, causal)}


def sweep_attention(progress: bool = True, rounds: int = ROUNDS) -> list[AttentionResult]:
    """Every implementation on every case of CASES, bf16, checked against cuDNN's output and gradients, forward and
    backward timed (the backward as a call of autograd on a kept graph): the median of ``rounds`` rounds, each timing
    every implementation once (a GPU's clock drifts with its heat: no implementation gets only the cool start)."""
    from tqdm.auto import tqdm

    gpu, date, ceiling = gpu_name(), datetime.date.today().isoformat(), matmul_tflops()
    results = []
    for head_dim, causal in tqdm(CASES, desc="attention", disable=not progress):
        q, k, v = (torch.randn(BATCH, HEADS, SEQ, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        impls = attention_impls(causal)
        expected = impls["cudnn"](q, k, v)
        expected_grads = torch.autograd.grad(expected, (q, k, v), do)
        calls, errors = {}, {}
        for name, fn in impls.items():
            o = fn(q, k, v)
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            errors[name, "forward"] = (o - expected).abs().max().item()
            errors[name, "backward"] = max((g - e).abs().max().item() for g, e in zip(grads, expected_grads,
                                                                                       strict=True))
            calls[name, "forward"] = functools.partial(fn, q, k, v)
            calls[name, "backward"] = functools.partial(torch.autograd.grad, o, (q, k, v), do, retain_graph=True)
        times = interleaved_ms(calls, rounds)
        for (name, phase), ms in times.items():
            results.append(AttentionResult(gpu, name, head_dim, causal, phase, ms,
                                           attention_flops(head_dim, causal, phase) / ms / 1e9, errors[name, phase],
                                           ceiling, date))
    return results


def interleaved_ms(calls: dict, rounds: int) -> dict:
    """The median milliseconds of each call over ``rounds`` rounds that each time every call once, in turn."""
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(time_ms(call))
    return {key: statistics.median(values) for key, values in times.items()}


def attention_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-attention.csv")


def load_attention(path: Path | None = None) -> list[AttentionResult]:
    """Recorded attention timings: ``path``; else the reference GPU's."""
    return read_rows(path or recorded(attention_path), AttentionResult)


def target_ratios(rows: list[AttentionResult]) -> dict[tuple[int, bool, str], float]:
    """For each case, the course's ratio against each target (1 or more: met): forward against Flex, forward against
    SDPA's best backend over 0.75, backward against Flex over 0.8."""
    def tflops(impl, head_dim, causal, phase):
        (row,) = select(rows, impl=impl, head_dim=head_dim, causal=causal, phase=phase)
        return row.tflops

    ratios = {}
    for head_dim, causal in CASES:
        ours = {phase: tflops("helpers", head_dim, causal, phase) for phase in ("forward", "backward")}
        best_sdpa = max(tflops(impl, head_dim, causal, "forward") for impl in ("cudnn", "flash"))
        ratios[head_dim, causal, "forward of flex"] = ours["forward"] / tflops("flex", head_dim, causal, "forward") \
            / FORWARD_OF_FLEX
        ratios[head_dim, causal, "forward of best SDPA"] = ours["forward"] / best_sdpa / FORWARD_OF_BEST_SDPA
        ratios[head_dim, causal, "backward of flex"] = ours["backward"] / tflops("flex", head_dim, causal,
                                                                                 "backward") / BACKWARD_OF_FLEX
    return ratios


LEGEND = {"helpers": ("this course (helpers.attention)", "tab:green"), "cudnn": ("SDPA, cuDNN", "tab:blue"),
          "flash": ("SDPA, flash", "tab:cyan"), "flex": ("FlexAttention (torch.compile)", "tab:purple"),
          "naive": ("naive PyTorch", "tab:red")}  # label and colour of each implementation in the figures


def attention_figure(rows: list[AttentionResult]):
    """TFLOP/s of each implementation on each case, forward and backward, with the matmul ceiling dashed."""
    import matplotlib.pyplot as plt

    impls = [impl for impl in IMPLS if select(rows, impl=impl)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    width = 0.8 / len(impls)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for i, impl in enumerate(impls):
            values = [next((r.tflops for r in select(rows, impl=impl, head_dim=d, causal=c, phase=phase)), 0.0)
                      for d, c in CASES]
            label, colour = LEGEND[impl]
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in range(len(CASES))], values, width,
                   color=colour, label=label)
        ax.axhline(rows[0].matmul_tflops, color="black", linestyle="--", linewidth=1,
                   label=f"bf16 matmul: {rows[0].matmul_tflops:.0f}")
        ax.set_xticks(range(len(CASES)), [f"d={d}\n{'causal' if c else 'full'}" for d, c in CASES])
        ax.set_title(f"{phase}, bf16, {BATCH} x {HEADS} heads x {SEQ}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=len(impls) + 1)
    fig.suptitle(f"recorded on {rows[0].gpu}, {rows[0].date}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# The tiles tried for each kernel (BLOCK_M, BLOCK_N, warps, stages), by head_dim: GPU_BLOCKS holds their best_tiles
# (results/<gpu>-attention-tuning.csv).
TILE_CANDIDATES = {
    ("forward", 128): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 3),
                       (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 2), (64, 32, 4, 3)],
    ("forward", 64): [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3),
                      (64, 64, 4, 4), (64, 128, 4, 3)],
    ("dkdv", 128): [(32, 64, 8, 3), (32, 128, 4, 5), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
                    (16, 128, 4, 4), (64, 128, 8, 2), (32, 128, 8, 2)],
    ("dkdv", 64): [(64, 128, 8, 3), (32, 128, 4, 5), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 4, 3),
                   (32, 128, 4, 3)],
    ("dq", 128): [(64, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 8, 3),
                  (128, 32, 4, 3), (64, 64, 8, 2)],
    ("dq", 64): [(128, 64, 8, 3), (128, 32, 4, 5), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3)],
}


def tune_tiles(path: Path, rounds: int = ROUNDS) -> None:
    """Time each kernel's TILE_CANDIDATES on every case of CASES (bf16), the other kernels at their GPU_BLOCKS, each
    checked against the GPU_BLOCKS results; write kernel, head_dim, causal, tiles, ms (the median of ``rounds``
    interleaved rounds) and TFLOP/s of the whole phase (forward, or backward: dK/dV and dQ), and the spills of each
    candidate's compiled kernel, to ``path``."""
    from . import flash_attention
    from .flash_attention import Blocks

    table = flash_attention.GPU_BLOCKS["16-bit"]
    with path.open("w") as out:
        out.write("kernel,head_dim,causal,block_m,block_n,num_warps,num_stages,ms,tflops,spills\n")
        for head_dim, causal in CASES:
            q, k, v, do = (torch.randn(BATCH, HEADS, SEQ, head_dim, device=DEVICE, dtype=torch.bfloat16)
                           for _ in range(4))
            scale = head_dim ** -0.5
            o, L = flash_attention.attention_forward(q, k, v, causal, scale)
            grads = flash_attention.attention_backward(do, q, k, v, o, L, causal, scale)
            for kernel in ("forward", "dkdv", "dq"):
                phase = "forward" if kernel == "forward" else "backward"
                jit = getattr(flash_attention, f"attention_{kernel}_kernel")
                current, calls, spills = table[kernel, head_dim], {}, {}
                for tiles in TILE_CANDIDATES[kernel, head_dim]:
                    table[kernel, head_dim] = Blocks(*tiles)
                    jit.device_caches.clear()  # so that the check's launch leaves this candidate alone in the cache
                    if phase == "forward":
                        run = functools.partial(flash_attention.attention_forward, q, k, v, causal, scale)
                        torch.testing.assert_close(run()[0], o, atol=2e-2, rtol=2e-2)
                    else:
                        run = functools.partial(flash_attention.attention_backward, do, q, k, v, o, L, causal, scale)
                        for got, expected in zip(run(), grads, strict=True):
                            torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)
                    (compiled,) = jit.device_caches[DEVICE.index or 0][0].values()
                    spills[tiles] = compiled.n_spills
                    calls[tiles] = functools.partial(_with_tiles, table, (kernel, head_dim), Blocks(*tiles), run)
                for tiles, ms in interleaved_ms(calls, rounds).items():
                    tflops = attention_flops(head_dim, causal, phase) / ms / 1e9
                    out.write(f"{kernel},{head_dim},{causal},{','.join(map(str, tiles))},{ms},{tflops},"
                              f"{spills[tiles]}\n")
                    print(f"{kernel:8s} d={head_dim:3d} causal={causal!s:5s} {tiles}: {tflops:4.0f} TFLOP/s, "
                          f"spills {spills[tiles]}", flush=True)
                table[kernel, head_dim] = current


def _with_tiles(table: dict, key: tuple, tiles, run):
    table[key] = tiles
    return run()


def best_tiles(rows: list[dict]) -> dict:
    """GPU_BLOCKS' rule: for each kernel and head_dim, the candidate with the least time summed over causal and
    full that spills no register in either."""
    totals, spilling = {}, set()
    for r in rows:
        key = (r["kernel"], int(r["head_dim"]))
        tiles = tuple(int(r[name]) for name in ("block_m", "block_n", "num_warps", "num_stages"))
        totals[key, tiles] = totals.get((key, tiles), 0.0) + float(r["ms"])
        if int(r["spills"]):
            spilling.add((key, tiles))
    best = {}
    for (key, tiles), total in totals.items():
        if (key, tiles) not in spilling and (key not in best or total < totals[key, best[key]]):
            best[key] = tiles
    return best


PROFILED = {"helpers": "this course", "flex": "FlexAttention", "cudnn": "cuDNN"}  # results/<gpu>-ncu-attention-*.csv
PROFILE_STALLS = ("wait", "barrier", "long_scoreboard", "short_scoreboard", "dispatch_stall", "mio_throttle",
                  "math_pipe_throttle", "not_selected")


def profile_forward(impl: str, head_dim: int = 128) -> None:
    """One forward of ``impl`` (bf16, full, the sweep's shape) inside a CUDA profiler range, after three to compile and
    warm up: ``ncu --profile-from-start off`` then profiles that call's kernels alone."""
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    fn = attention_impls(causal=False)[impl]
    for _ in range(3):
        fn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def load_attention_profiles(gpu: str | None = None) -> dict[str, dict]:
    """The recorded Nsight Compute profiles of each PROFILED forward (head_dim 128, full): impl -> metric -> value."""
    from .steps import load_profile

    stem = results_path(gpu or bench.REFERENCE_GPU).stem
    return {impl: load_profile(bench.RESULTS_DIR / f"{stem}-ncu-attention-{impl}.csv") for impl in PROFILED}


def tensor_busy(profile: dict) -> float:
    """Percent of the run the SMs' tensor cores were busy (Nsight Compute's tensor pipe, all its instruction kinds)."""
    return float(profile["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"])


def profile_figure(profiles: dict[str, dict]):
    """How busy each profiled forward keeps the tensor cores, and where its warps wait."""
    import matplotlib.pyplot as plt

    fig, (busy, stalls) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": (1, 2)})
    busy.barh([PROFILED[impl] for impl in profiles][::-1], [tensor_busy(p) for p in profiles.values()][::-1],
              color=[LEGEND[impl][1] for impl in profiles][::-1])
    busy.set(xlim=(0, 100), xlabel="% of the time the tensor cores are busy")
    width = 0.8 / len(profiles)
    for i, (impl, profile) in enumerate(profiles.items()):
        stalls.bar([j + (i - (len(profiles) - 1) / 2) * width for j in range(len(PROFILE_STALLS))],
                   [float(profile[f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"])
                    for reason in PROFILE_STALLS], width, label=PROFILED[impl], color=LEGEND[impl][1])
    stalls.set_xticks(range(len(PROFILE_STALLS)), [r.replace("_", "\n") for r in PROFILE_STALLS], fontsize=7)
    stalls.set_ylabel("warps stalled\nper issued instruction")
    stalls.legend(fontsize=8)
    for ax in (busy, stalls):
        ax.grid(alpha=0.3, axis="x" if ax is busy else "y")
    fig.tight_layout()
    return fig


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="time the kernels' candidate tiles instead (minutes)")
    parser.add_argument("--profile", choices=PROFILED, help="run one forward for Nsight Compute instead: ncu "
                        "--profile-from-start off --csv --page raw python -m helpers.bench_attention --profile IMPL")
    args = parser.parse_args()
    if args.profile:
        profile_forward(args.profile)
        return
    if args.tune:
        path = attention_path(gpu_name())
        path = path.with_name(path.stem + "-tuning.csv")
        tune_tiles(path)
        with path.open() as f:
            print("the fastest that spill nothing (GPU_BLOCKS' rule):", best_tiles(list(csv.DictReader(f))))
        return
    results = sweep_attention()
    print(f"wrote {len(results)} rows to {save_results(results, attention_path(gpu_name()))}")
    for r in results:
        print(f"d={r.head_dim:3d} {'causal' if r.causal else 'full  '} {r.phase:8s} {r.impl:8s} {r.tflops:6.0f} TFLOP/s"
              f"  max error {r.max_error:.3g}")
    for (head_dim, causal, target), ratio in target_ratios(results).items():
        print(f"d={head_dim:3d} {'causal' if causal else 'full  '} {target:22s} {ratio:5.2f} of the target")


if __name__ == "__main__":
    main()
