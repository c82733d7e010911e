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
import functools
import importlib
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


def expected_output(phase: str, x: torch.Tensor, y: torch.Tensor | None = None, dy: torch.Tensor | None = None,
                    dim: int = -1) -> torch.Tensor:
    """What a timed call must return, by torch in fp32: softmax(x) forward, the backward's dx from y and dy."""
    if phase == "forward":
        return torch.softmax(x.float(), dim)
    return reference.softmax_backward(y.float(), dy.float(), dim)


# A sweep times only calls that compute softmax: an output further from ``expected_output`` than this, as a fraction of
# its largest value, by element size, is reported and not timed (QuACK 0.6.5's 16-bit forward returns NaN for every
# element of rows of 151936: results/README.md, "Peers checked").
OUTPUT_TOLERANCE = {2: 2e-2, 4: 1e-4, 8: 1e-4}


def wrong_output(output: torch.Tensor | tuple, expected: torch.Tensor) -> str | None:
    """Why ``output`` (or a tuple's first item, as Liger's forward returns) is not ``expected``; None if it is."""
    output = output[0] if isinstance(output, tuple) else output
    error = ((output.float() - expected).abs().max() / expected.abs().max()).item()
    if error <= OUTPUT_TOLERANCE[output.element_size()]:  # False for NaN
        return None
    return f"off by {error:.2g} of its largest value"


def checked_ms(fn: Callable[[], object], expected: torch.Tensor, label: str) -> float | None:
    """``time_ms(fn)`` if ``fn`` returns ``expected`` (``wrong_output``), else None, with ``label`` and the reason
    printed."""
    if (problem := wrong_output(fn(), expected)) is not None:
        print(f"{label}: wrong output ({problem}), not timed")
        return None
    return time_ms(fn)


def copy_gbps(n_elements: int, dtype: torch.dtype) -> float:
    """The ceiling: a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(n_elements, device=DEVICE).to(dtype)
    dst = torch.empty_like(src)
    return gbps(2 * src.numel() * src.element_size(), time_ms(lambda: dst.copy_(src)))


def liger_module():
    """Liger-Kernel's softmax functions when it is installed, else None."""
    try:
        from liger_kernel.ops import softmax as liger_softmax
    except ImportError:
        return None
    return liger_softmax


def quack_module():
    """QuACK's softmax module (Dao-AILab's CuTe-DSL kernels) when it is installed, else None. (``quack.softmax`` as
    an attribute is its autograd function, which shadows the module.)"""
    try:
        return importlib.import_module("quack.softmax")
    except ImportError:
        return None


@functools.cache
def compiled_softmax(phase: str, dim: int = -1):
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1000  # one graph per shape and dtype: the default 8 falls back to eager
    if phase == "forward":
        return torch.compile(lambda x: torch.softmax(x, dim), dynamic=False)
    return torch.compile(lambda y, dy: torch.ops.aten._softmax_backward_data(dy, y, dim, y.dtype), dynamic=False)


def peer_forward_impls() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """The course's public op against its peers: torch eager, torch.compile, and Liger-Kernel and QuACK when
    installed."""
    from .ops import softmax_forward

    impls = {
        "helpers": lambda x: lambda: softmax_forward(x),
        "torch": lambda x: lambda: torch.softmax(x, -1),
        "compile": lambda x: lambda: compiled_softmax("forward")(x),
    }
    if (liger := liger_module()) is not None:
        impls["liger"] = lambda x: lambda: liger._softmax_forward(x)
    if (quack := quack_module()) is not None:
        impls["quack"] = lambda x: functools.partial(quack.softmax_fwd, x)
    return impls


def peer_backward_impls() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], object]]]:
    from .ops import softmax_backward

    impls = {
        "helpers": lambda x, y, dy: lambda: softmax_backward(y, dy),
        "torch": lambda x, y, dy: lambda: torch._softmax_backward_data(dy, y, -1, y.dtype),
        "compile": lambda x, y, dy: lambda: compiled_softmax("backward")(y, dy),
    }
    if (liger := liger_module()) is not None:
        def liger_backward(x, y, dy):
            settings = liger._softmax_forward(x)[1:]  # block size, warps, and which kernel its forward used
            return lambda: liger._softmax_backward(dy, y, *settings)

        impls["liger"] = liger_backward
    if (quack := quack_module()) is not None:
        impls["quack"] = lambda x, y, dy: functools.partial(quack.softmax_bwd, dy, y)
    return impls


def forward_impls() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """Forward implementations by name: each takes x (M x N) and returns a closure that runs once."""

    def kernel_impl(kernel):
        def make(x):
            y = torch.empty_like(x)

            def run():
                kernels.launch_forward(x, y, kernel)
                return y

            return run

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

            def run():
                kernels.launch_backward(y, dy, dx, kernel)
                return dx

            return run

        return make

    def graph(x, y, dy):
        dx = torch.empty_like(x)

        def run():
            kernels.launch_graph_backward(x, dy, dx)
            return dx

        return run

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
    peers: bool = False,
) -> list[Result]:
    """Time every implementation on M x N inputs with M = total_elements // N (fresh random data), plus the copy.
    ``peers``: the course's public ops against torch, torch.compile, Liger and QuACK instead of the teaching kernels.
    An implementation whose output is wrong is reported and not timed (``checked_ms``)."""
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
            makers, inputs = (peer_forward_impls() if peers else forward_impls()), (x,)
        else:
            y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
            makers, inputs = (peer_backward_impls() if peers else backward_impls()), (x, y, dy)
        expected = expected_output(phase, *inputs)
        for name, make in makers.items():
            if (wanted is not None and name not in wanted) or n > LONGEST_ROW.get(name, n):
                continue
            label = f"{name} {phase} {dtype} N={n}"
            try:
                ms = checked_ms(make(*inputs), expected, label)
            except Exception as error:  # a peer that refuses a size (Liger past 65536) is recorded as missing
                print(f"{label}: {type(error).__name__}: {str(error)[:100]}")
                continue
            if ms is not None:
                results.append(Result(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, ms,
                                      gbps(n_bytes, ms), ceiling, date))
        del x, inputs, expected
    return results


def results_path(gpu: str) -> Path:
    return RESULTS_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".csv")


def save_results(results: list, path: Path | None = None) -> Path:
    """Write ``results`` (Result or Latency rows) as CSV, by default to results/<gpu>.csv."""
    path = path or results_path(results[0].gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(results[0])])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    return path


# The GPU the course's speed targets are set on, whose records the notebooks' text quotes and checks.
REFERENCE_GPU = "NVIDIA H100 80GB HBM3"


def load_results(path: Path | None = None) -> list[Result]:
    """Recorded results: ``path``; else the reference GPU's sweep."""
    return read_rows(path or recorded(results_path), Result)


def claimed(results: list[Result]) -> list[Result]:
    """The sweep a notebook's text quotes and its checks assert: ``results`` where they are the reference GPU's (timed
    on it, or its record read on CPU), else the reference GPU's recorded sweep. Another GPU reaches other fractions
    of its copy limit (an H200's faster memory, a T4 without bf16 in hardware), so its own timings are plotted and
    the text's claims are checked where they were made."""
    if all(r.gpu == REFERENCE_GPU for r in results):
        return results
    path = results_path(REFERENCE_GPU)
    print(f"Timed above on {results[0].gpu}. The text's numbers, and the checks below, are the {REFERENCE_GPU}'s "
          f"recorded sweep ({RESULTS_DIR.name}/{path.name}).")
    return load_results(path)


def recorded(path_for: Callable[[str], Path], gpu: str = REFERENCE_GPU) -> Path:
    """``gpu``'s recorded file, by default the reference GPU's: the record a notebook's text quotes and checks, on any
    machine, also on a GPU whose own sweep ``make bench`` wrote beside it."""
    path = path_for(gpu)
    if not path.exists():
        raise FileNotFoundError(f"no recorded {path.name} in {RESULTS_DIR.name}/")
    return path


def own_recorded(path_for: Callable[[str], Path], fallback: str = REFERENCE_GPU) -> Path:
    """This GPU's recorded file when ``make bench`` wrote one, else the ``fallback`` GPU's: what ``make images``
    draws."""
    own = path_for(gpu_name()) if not INTERPRET and DEVICE.type == "cuda" else None
    return own if own is not None and own.exists() else recorded(path_for, fallback)


def read_rows(path: Path, row_type: type) -> list:
    types = {field.name: field.type for field in fields(row_type)}
    cast = {"int": int, "float": float, "str": str, "bool": lambda value: value == "True"}
    with path.open() as f:
        return [row_type(**{k: cast[types[k]](v) for k, v in row.items()}) for row in csv.DictReader(f)]


# The GPU whose full tuning sweep is recorded (``python -m helpers.tune``, minutes of GPU time).
TUNED_GPU = "NVIDIA H200"


def tuning_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-tuning.csv")


def load_tuning(path: Path | None = None) -> list[dict]:
    """The rows of a recorded tuning sweep: ``path``; else TUNED_GPU's."""
    with (path or recorded(tuning_path, TUNED_GPU)).open() as f:
        return list(csv.DictReader(f))


def select(results: list[Result], **where) -> list[Result]:
    """The results whose fields equal every keyword, e.g. ``select(rs, phase="forward", impl="torch")``."""
    return [r for r in results if all(getattr(r, k) == v for k, v in where.items())]


COURSE_N = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
# Notebook 06's grid: short to LLM-vocabulary rows, powers of two and not (50257: GPT-2, 151936: Qwen).
GRID_N = [256, 1024, 4096, 16384, 32768, 50257, 65536, 131072, 151936, 262144]


PARTS = ("grid", "long-rows", "other-dims", "latency", "everyday")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-elements", type=int, default=2**27, help="M * N of every input (default 2**27)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="which sweeps to run (default all)")
    args = parser.parse_args()
    from . import bench_calls, residency

    path = results_path(gpu_name())
    if "grid" in args.parts:
        results = sweep(COURSE_N, args.total_elements, dtypes=(torch.float32, torch.bfloat16))
        results += sweep(GRID_N, args.total_elements, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                         peers=True)
        print(f"wrote {len(results)} rows to {save_results(results, path)}")
        for r in select(results, impl="helpers"):
            best_peer = max((p.gbps for p in select(results, phase=r.phase, dtype=r.dtype, N=r.N)
                             if p.impl in ("torch", "compile", "liger", "quack")), default=0.0)
            print(f"{r.phase:8s} {r.dtype:8s} N={r.N:6d} helpers {r.gbps / r.copy_gbps:5.2f} of copy, "
                  f"best peer {best_peer / r.copy_gbps:5.2f}")
    bench_calls.run(args.parts)
    if "everyday" in args.parts:
        from . import everyday

        calls = everyday.sweep()
        print(f"wrote {len(calls)} rows to {save_results(calls, everyday.everyday_path(gpu_name()))}")
        for r in select(calls, impl="helpers"):
            (torch_call,) = select(calls, impl="torch", case=r.case, phase=r.phase)
            print(f"{r.phase:8s} {r.case:24s} helpers {r.gpu_us:8.1f} us (host {r.host_us:5.1f}), torch "
                  f"{torch_call.gpu_us:8.1f} us (host {torch_call.host_us:5.1f})")
    if "grid" in args.parts:  # the kernels the grid compiled, every plan's
        spills = residency.spill_report()
        with path.with_name(path.stem + "-spills.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(spills[0]))
            writer.writeheader()
            writer.writerows(spills)
        print(f"fused kernels compiled: {len(spills)}, with spills: {sum(r['n_spills'] > 0 for r in spills)}")


if __name__ == "__main__":
    main()
