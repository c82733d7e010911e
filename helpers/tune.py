"""The tuning sweep behind the course's plans (``helpers.plans``): ``python -m helpers.tune`` (GPU only).

For each row length, phase and dtype it times the candidate shapes of the fused kernels (rows per program, elements
per thread, hence warps; for long rows the segment each program holds) and writes every timing to
``results/<gpu>-tuning.csv``, printing the best shape per case. The constants in ``helpers.plans`` are read off it.
"""

from __future__ import annotations

import argparse
import csv

import torch
import triton

from . import bench, fused, plans
from .device import DEVICE

TILE_ELEMENTS = (256, 512, 1024, 2048, 4096, 8192, 16384)
SEGMENT_ELEMENTS = (2048, 4096, 8192, 16384)
ELEMENTS_PER_THREAD = (4, 8, 16, 32, 64)
N_VALUES = (256, 1024, 4096, 16384, 32768, 50257, 65536, 131072, 151936, 262144)


def candidate_plans(n_cols: int, element_size: int) -> list[plans.Plan]:
    block = triton.next_power_of_2(n_cols)
    aligns = (1, 16 // element_size) if n_cols % 16 else (1,)  # rows off 16-byte boundaries: pieces aligned or not
    candidates = set()
    for per_thread in ELEMENTS_PER_THREAD:
        def warps(elements, per_thread=per_thread):
            return max(1, min(32, elements // (32 * per_thread)))

        if block <= 32768:
            for tile in TILE_ELEMENTS:
                rows = max(1, tile // block)
                for persistent in (False, True):
                    candidates.add(plans.Plan(rows, block, 1, warps(rows * block), persistent))
        if n_cols > 4096:
            for segment in SEGMENT_ELEMENTS:
                for align in aligns if segment < block else ():
                    segments = triton.cdiv(n_cols + align - 1, segment)
                    candidates.add(plans.Plan(1, segment, segments, warps(segment), True, align))
    return sorted(candidates, key=lambda p: (p.segments, p.rows, p.block_n, p.num_warps, p.persistent, p.align))


def time_plan(phase: str, plan: plans.Plan, x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor) -> float:
    out = torch.empty_like(x)
    if phase == "forward":
        fused.launch_rows_forward(x, out, plan)
        torch.testing.assert_close(out, y, atol=1e-2, rtol=1e-2)  # a shape that is fast but wrong must not win
        return bench.time_ms(lambda: fused.launch_rows_forward(x, out, plan))
    fused.launch_rows_backward(y, dy, out, plan)
    return bench.time_ms(lambda: fused.launch_rows_backward(y, dy, out, plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-elements", type=int, default=2**26)
    parser.add_argument("--out", default=None, help="CSV path (default results/<gpu>-tuning.csv)")
    parser.add_argument("--n", type=int, nargs="+", default=N_VALUES, help="row lengths to tune")
    args = parser.parse_args()
    gpu = bench.gpu_name()
    path = args.out or str(bench.results_path(gpu)).replace(".csv", "-tuning.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["gpu", "phase", "dtype", "N", "rows", "block_n", "segments", "num_warps", "persistent",
                         "align", "ms", "fraction"])
        for dtype in (torch.float32, torch.bfloat16):
            for n in args.n:
                m = max(args.total_elements // n, 1)
                x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
                y = torch.softmax(x.float(), -1).to(dtype)
                dy = torch.randn_like(x)
                ceiling = bench.copy_gbps(m * n, dtype)
                for phase in ("forward", "backward"):
                    n_bytes = bench.ELEMENTS_MOVED[phase] * m * n * x.element_size()
                    best = None
                    for plan in candidate_plans(n, x.element_size()):
                        ms = time_plan(phase, plan, x, y, dy)
                        fraction = bench.gbps(n_bytes, ms) / ceiling
                        writer.writerow([gpu, phase, str(dtype)[6:], n, plan.rows, plan.block_n, plan.segments,
                                         plan.num_warps, int(plan.persistent), plan.align, f"{ms:.5f}",
                                         f"{fraction:.3f}"])
                        best = max(best or (0, plan), (fraction, plan), key=lambda t: t[0])
                    default = plans.plan_for(n, phase, x.element_size())
                    print(f"{phase:8s} {str(dtype)[6:]:8s} N={n:6d} best {best[0]:.2f} {best[1]}  default {default}",
                          flush=True)
                f.flush()


if __name__ == "__main__":
    main()
