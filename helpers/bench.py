"""Measuring softmax against the memory limit: timings, bandwidth, the copy ceiling, and recorded sweeps.

Softmax is memory-bound, so every number here is a bandwidth: elements moved (forward 2*M*N, backward 3*M*N) times
their size over the median time of ``triton.testing.do_bench``. The ceiling is a device-to-device copy measured in
the same run. Sweeps are written to ``results/<gpu>.csv``; on a machine with no GPU the notebooks plot those files.

``python -m helpers.bench`` (``make bench``) runs the course sweep on the GPU and writes the CSV.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from . import kernels, reference
from .device import DEVICE, INTERPRET

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
ELEMENTS_MOVED = {"forward": 2, "backward": 3}  # per element of x: forward reads x, writes y; backward reads y, dy


@dataclass
class Result:
    gpu: str
    impl: str
    phase: str
    dtype: str
    M: int
    N: int
    ms: float
    gbps: float
    copy_gbps: float
    date: str


def gpu_name() -> str:
    if INTERPRET or DEVICE.type != "cuda":
        raise RuntimeError("timings need a GPU: on CPU, plot the recorded results with load_results()")
    return torch.cuda.get_device_name(DEVICE)


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the GPU (events around many repetitions, after a warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def gbps(n_bytes: int, ms: float) -> float:
    return n_bytes / ms / 1e6


def copy_gbps(n_elements: int, dtype: torch.dtype) -> float:
    """The ceiling: a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(n_elements, device=DEVICE).to(dtype)
    dst = torch.empty_like(src)
    return gbps(2 * src.numel() * src.element_size(), time_ms(lambda: dst.copy_(src)))


def forward_impls() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """Forward implementations by name: each takes x (M x N) and returns a closure that runs once."""

    def kernel_impl(kernel):
        def make(x):
            y = torch.empty_like(x)
            return lambda: kernels.launch_forward(x, y, kernel)

        return make

    return {
        "naive": lambda x: lambda: reference.naive_softmax(x),
        "torch": lambda x: lambda: torch.softmax(x, -1),
        "row": kernel_impl(kernels.softmax_kernel),
        "online": kernel_impl(kernels.softmax_online_kernel),
    }


def backward_impls() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], object]]]:
    """Backward implementations by name: each takes (x, y, dy) and returns a closure that runs once."""

    def kernel_impl(kernel):
        def make(x, y, dy):
            dx = torch.empty_like(y)
            return lambda: kernels.launch_backward(y, dy, dx, kernel)

        return make

    def graph(x, y, dy):
        dx = torch.empty_like(x)
        return lambda: kernels.launch_graph_backward(x, dy, dx)

    return {
        "torch": lambda x, y, dy: lambda: torch._softmax_backward_data(dy, y, -1, y.dtype),
        "row": kernel_impl(kernels.softmax_backward_kernel),
        "graph": graph,
        "looped": kernel_impl(kernels.softmax_backward_looped_kernel),
    }


# One-block kernels hold next_power_of_2(N) values per program: past 65536 they spill so badly they are not worth
# timing, and the graph backward refuses rows longer than one block (ROW_BLOCK_LIMIT).
LONGEST_ROW = {"row": 65536, "graph": kernels.ROW_BLOCK_LIMIT}


def sweep(
    n_values: Iterable[int],
    total_elements: int = 2**27,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    phases: Iterable[str] = ("forward", "backward"),
    impls: Iterable[str] | None = None,
    progress: bool = True,
) -> list[Result]:
    """Time every implementation on M x N inputs with M = total_elements // N (fresh random data), plus the copy."""
    from tqdm.auto import tqdm

    gpu, date = gpu_name(), datetime.date.today().isoformat()
    wanted = set(impls) if impls is not None else None
    cases = [(phase, dtype, n) for phase in phases for dtype in dtypes for n in n_values]
    results = []
    for phase, dtype, n in tqdm(cases, desc="sweep", disable=not progress):
        m = max(total_elements // n, 1)
        x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
        ceiling = copy_gbps(m * n, dtype)
        n_bytes = ELEMENTS_MOVED[phase] * m * n * x.element_size()
        if phase == "forward":
            runs = {name: make(x) for name, make in forward_impls().items()}
        else:
            y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
            runs = {name: make(x, y, dy) for name, make in backward_impls().items()}
        for name, run in runs.items():
            if (wanted is not None and name not in wanted) or n > LONGEST_ROW.get(name, n):
                continue
            ms = time_ms(run)
            results.append(Result(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, ms, gbps(n_bytes, ms),
                                  ceiling, date))
        del x, runs
    return results


def results_path(gpu: str) -> Path:
    return RESULTS_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".csv")


def save_results(results: list[Result], path: Path | None = None) -> Path:
    path = path or results_path(results[0].gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    return path


def load_results(path: Path | None = None) -> list[Result]:
    """Recorded results: ``path``, or the newest CSV in results/."""
    if path is None:
        candidates = sorted(RESULTS_DIR.glob("*.csv"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"no recorded results in {RESULTS_DIR.name}/: run `make bench` on a GPU")
        path = candidates[-1]
    types = {field.name: field.type for field in fields(Result)}
    cast = {"int": int, "float": float, "str": str}
    with path.open() as f:
        return [Result(**{k: cast[types[k]](v) for k, v in row.items()}) for row in csv.DictReader(f)]


def select(results: list[Result], **where) -> list[Result]:
    """The results whose fields equal every keyword, e.g. ``select(rs, phase="forward", impl="torch")``."""
    return [r for r in results if all(getattr(r, k) == v for k, v in where.items())]


COURSE_N = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-elements", type=int, default=2**27, help="M * N of every input (default 2**27)")
    args = parser.parse_args()
    results = sweep(COURSE_N, args.total_elements, dtypes=(torch.float32, torch.bfloat16))
    path = save_results(results)
    print(f"wrote {len(results)} rows to {path}")
    for r in results:
        fraction = r.gbps / r.copy_gbps
        print(f"{r.phase:8s} {r.dtype:8s} N={r.N:6d} {r.impl:7s} {r.gbps:7.0f} GB/s  {fraction:5.2f} of copy")


if __name__ == "__main__":
    main()
