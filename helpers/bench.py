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
import time
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


def cpu_ms_per_call(fn: Callable[[], object], calls: int = 200, repeats: int = 11) -> float:
    """Milliseconds of CPU time per call of ``fn`` while the GPU is kept busy, so that calls only queue their work:
    the time the host needs to issue one call, which must stay below the GPU's time per call to keep the GPU fed. The
    fastest of ``repeats`` runs: what the call costs, without what else the machine was doing meanwhile."""
    return cpu_ms_per_calls({"fn": fn}, calls, repeats)["fn"]


def cpu_ms_per_calls(fns: dict, calls: int = 200, repeats: int = 11) -> dict:
    """``cpu_ms_per_call`` of several functions, taken in turns: each repeat times every function once, so a
    moment when the machine's CPU is slow falls on all of them alike rather than on whichever was timed then."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    fastest = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda._sleep(50_000_000)  # about 30 ms of GPU work queued ahead of the calls (4 ms at 20 us a call)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            fastest[name] = min(fastest[name], time.perf_counter() - start)
            torch.cuda.synchronize()
    return {name: seconds / calls * 1e3 for name, seconds in fastest.items()}


def gbps(n_bytes: int, ms: float) -> float:
    return n_bytes / ms / 1e6


def copy_gbps(n_elements: int, dtype: torch.dtype) -> float:
    """The ceiling: a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(n_elements, device=DEVICE).to(dtype)
    dst = torch.empty_like(src)
    return gbps(2 * src.numel() * src.element_size(), time_ms(lambda: dst.copy_(src)))


def _liger():
    """Liger-Kernel's softmax functions when it is installed, else None."""
    try:
        from liger_kernel.ops import softmax as liger_softmax
    except ImportError:
        return None
    return liger_softmax


@functools.cache
def _compiled(phase: str, dim: int = -1):
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
        "compile": lambda x: lambda: _compiled("forward")(x),
    }
    if (liger := _liger()) is not None:
        impls["liger"] = lambda x: lambda: liger._softmax_forward(x)
    if (quack := _quack()) is not None:
        impls["quack"] = lambda x: functools.partial(quack.softmax_fwd, x)
    return impls


def peer_backward_impls() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], object]]]:
    from .ops import softmax_backward

    impls = {
        "helpers": lambda x, y, dy: lambda: softmax_backward(y, dy),
        "torch": lambda x, y, dy: lambda: torch._softmax_backward_data(dy, y, -1, y.dtype),
        "compile": lambda x, y, dy: lambda: _compiled("backward")(y, dy),
    }
    if (liger := _liger()) is not None:
        def liger_backward(x, y, dy):
            settings = liger._softmax_forward(x)[1:]  # block size, warps, and which kernel its forward used
            return lambda: liger._softmax_backward(dy, y, *settings)

        impls["liger"] = liger_backward
    if (quack := _quack()) is not None:
        impls["quack"] = lambda x, y, dy: functools.partial(quack.softmax_bwd, dy, y)
    return impls


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
    peers: bool = False,
) -> list[Result]:
    """Time every implementation on M x N inputs with M = total_elements // N (fresh random data), plus the copy.
    ``peers``: the course's public ops against torch, torch.compile and Liger instead of the teaching kernels."""
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
        for name, make in makers.items():
            if (wanted is not None and name not in wanted) or n > LONGEST_ROW.get(name, n):
                continue
            try:
                ms = time_ms(make(*inputs))
            except Exception as error:  # a peer that refuses a size (Liger past 65536) is recorded as missing
                print(f"{name} {phase} {dtype} N={n}: {type(error).__name__}: {str(error)[:100]}")
                continue
            results.append(Result(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, ms, gbps(n_bytes, ms),
                                  ceiling, date))
        del x, inputs
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


# The sweep that figures and CPU notebooks show: the GPU the course's speed targets are set on.
REFERENCE_GPU = "NVIDIA H100 80GB HBM3"


def load_results(path: Path | None = None) -> list[Result]:
    """Recorded results: ``path``; else, on a GPU that has its own sweep in results/ (``make bench``), that one;
    else the reference GPU's."""
    return read_rows(path or recorded(results_path), Result)


def load_latency(path: Path | None = None) -> list[Latency]:
    """Recorded host times and decode latencies (``make bench``'s latency part), found as ``load_results`` finds its
    sweep."""
    return read_rows(path or recorded(latency_path), Latency)


def latency_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-latency.csv")


def recorded(path_for: Callable[[str], Path]) -> Path:
    """This GPU's recorded file when there is one, else the reference GPU's."""
    own = path_for(gpu_name()) if not INTERPRET and DEVICE.type == "cuda" else None
    path = own if own is not None and own.exists() else path_for(REFERENCE_GPU)
    if not path.exists():
        raise FileNotFoundError(f"no recorded {path.name} in {RESULTS_DIR.name}/: run `make bench` on a GPU")
    return path


def read_rows(path: Path, row_type: type) -> list:
    types = {field.name: field.type for field in fields(row_type)}
    cast = {"int": int, "float": float, "str": str}
    with path.open() as f:
        return [row_type(**{k: cast[types[k]](v) for k, v in row.items()}) for row in csv.DictReader(f)]


def load_tuning(path: Path | None = None) -> list[dict]:
    """The rows of a recorded tuning sweep (``python -m helpers.tune``): the newest results/*-tuning.csv."""
    if path is None:
        candidates = sorted(RESULTS_DIR.glob("*-tuning.csv"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"no tuning sweep in {RESULTS_DIR.name}/: run `python -m helpers.tune` on a GPU")
        path = candidates[-1]
    with path.open() as f:
        return list(csv.DictReader(f))


def select(results: list[Result], **where) -> list[Result]:
    """The results whose fields equal every keyword, e.g. ``select(rs, phase="forward", impl="torch")``."""
    return [r for r in results if all(getattr(r, k) == v for k, v in where.items())]


COURSE_N = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
# Notebook 06's grid: short to LLM-vocabulary rows, powers of two and not (50257: GPT-2, 151936: Qwen).
GRID_N = [256, 1024, 4096, 16384, 32768, 50257, 65536, 131072, 151936, 262144]


# Single rows past what a split holds on chip (the two-pass kernels) and one short of it, and how many rows of each.
LONG_ROWS = [(1, 2**20), (1, 2**22 + 3), (2, 2**22), (1, 2**24), (1, 2**27)]


def sweep_long_rows(dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16), progress: bool = True,
                    ) -> list[Result]:
    """The course's ops and torch on LONG_ROWS, forward and backward, with the copy of the same bytes."""
    from tqdm.auto import tqdm

    from .ops import softmax_backward, softmax_forward

    gpu, date = gpu_name(), datetime.date.today().isoformat()
    results = []
    for dtype, (m, n) in tqdm([(d, shape) for d in dtypes for shape in LONG_ROWS], desc="long rows",
                              disable=not progress):
        x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
        y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
        ceiling = copy_gbps(m * n, dtype)
        impls = {
            ("forward", "helpers"): functools.partial(softmax_forward, x),
            ("forward", "torch"): functools.partial(torch.softmax, x, -1),
            ("backward", "helpers"): functools.partial(softmax_backward, y, dy),
            ("backward", "torch"): functools.partial(torch._softmax_backward_data, dy, y, -1, y.dtype),
        }
        for (phase, name), fn in impls.items():
            ms = time_ms(fn)
            n_bytes = ELEMENTS_MOVED[phase] * m * n * x.element_size()
            results.append(Result(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, ms, gbps(n_bytes, ms),
                                  ceiling, date))
    return results


# Few rows over a language model's vocabulary: sampling and decode, where a call is latency-bound, not bandwidth-bound.
DECODE_M = [1, 8, 64]
DECODE_N = [32000, 128256, 151936, 262144]  # Llama 2, Llama 3, Qwen, Gemma vocabularies
# Tiny calls whose GPU time is negligible, for the host's time per call: a tile and a split, fp32 and bf16
HOST_SHAPES = [(1, 1024), (1, 65536)]


@dataclass
class Latency:
    """Microseconds per call: ``measure`` is "host" (CPU time to issue a call, ``cpu_ms_per_call``), "eager"
    (``time_ms``, which clears L2 before each call: the host issues the call while the GPU clears, so this is the GPU's
    time for an eager call, its fills and extra launches included) or "graph" (the call captured in a CUDA graph and
    replayed). On the host, "launch" and "empty_like" are parts of the course's call timed alone: its kernels launched
    on an output allocated beforehand (no checks, no lookup), and the allocation of that output."""

    gpu: str
    impl: str
    phase: str
    dtype: str
    M: int
    N: int
    measure: str
    us: float
    date: str


def _quack():
    """QuACK's softmax module (Dao-AILab's CuTe-DSL kernels) when it is installed, else None. (``quack.softmax`` as
    an attribute is its autograd function, which shadows the module.)"""
    try:
        return importlib.import_module("quack.softmax")
    except ImportError:
        return None


def latency_impls(phase: str) -> dict[str, Callable[..., Callable[[], object]]]:
    """The course's public ops, torch eager, torch.compile, and Liger and QuACK when installed: each takes (x, y, dy)
    and returns a closure that runs one call of ``phase``."""
    from .ops import softmax_backward, softmax_forward

    if phase == "forward":
        impls = {"helpers": lambda x, y, dy: functools.partial(softmax_forward, x),
                 "torch": lambda x, y, dy: functools.partial(torch.softmax, x, -1),
                 "compile": lambda x, y, dy: functools.partial(_compiled("forward"), x)}
        if (liger := _liger()) is not None:
            impls["liger"] = lambda x, y, dy: functools.partial(liger._softmax_forward, x)
        if (quack := _quack()) is not None:
            impls["quack"] = lambda x, y, dy: functools.partial(quack.softmax_fwd, x)
        return impls
    impls = {"helpers": lambda x, y, dy: functools.partial(softmax_backward, y, dy),
             "torch": lambda x, y, dy: functools.partial(torch._softmax_backward_data, dy, y, -1, y.dtype),
             "compile": lambda x, y, dy: functools.partial(_compiled("backward"), y, dy)}
    if (liger := _liger()) is not None:
        impls["liger"] = lambda x, y, dy: (lambda settings: lambda: liger._softmax_backward(dy, y, *settings))(
            liger._softmax_forward(x)[1:])
    if (quack := _quack()) is not None:
        impls["quack"] = lambda x, y, dy: functools.partial(quack.softmax_bwd, dy, y)
    return impls


def host_parts(phase: str) -> dict[str, Callable[..., Callable[[], object]]]:
    """The course's call in parts, as ``latency_impls``: its recipe's launch alone, and its output's allocation."""
    from . import fused, recipes

    def launch(x, y, dy):
        operands = (torch.empty_like(x), x) if phase == "forward" else (torch.empty_like(y), y, dy)
        recipe = recipes.recipe_for(fused.forward_recipe if phase == "forward" else fused.backward_recipe, operands)
        return functools.partial(recipe.launch, operands, [t.data_ptr() for t in operands], x.get_device())

    return {"launch": launch, "empty_like": lambda x, y, dy: functools.partial(torch.empty_like, x)}


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph: the GPU's time for the call, host cost gone."""
    fn()  # compiles and plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay) * 1e3


def copy_reference(phase: str) -> Callable[..., Callable[[], object]]:
    """A call of one torch kernel that moves the bytes of a ``phase`` call, as ``latency_impls``: the forward's copy of
    x into y, the backward's sum of y and dy into dx. One launch and no exchange: a reference for what moving the bytes
    costs, not a bound (a kernel shaped for the call can beat torch's copy at some sizes)."""
    if phase == "forward":
        return lambda x, y, dy: functools.partial(torch.Tensor.copy_, torch.empty_like(x), x)
    return lambda x, y, dy: functools.partial(torch.add, y, dy, out=torch.empty_like(y))


GRAPHED = ("helpers", "torch", "quack", "copy")  # decode calls also timed as replays of a CUDA graph
HOST_TIMED = ("helpers", "torch", "quack")  # and the host's time to issue them


def sweep_latency(dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float32), progress: bool = True,
                  impls: Iterable[str] | None = None) -> list[Latency]:
    """Host time per call on HOST_SHAPES (every call timed in turns, ``cpu_ms_per_calls``), and eager latency on the
    decode grid (DECODE_M x DECODE_N), forward and backward, for the course, every peer installed and a copy;
    GRAPHED calls also inside a CUDA graph, and HOST_TIMED ones on the host."""
    from tqdm.auto import tqdm

    gpu, date = gpu_name(), datetime.date.today().isoformat()
    results = []

    def record(name, phase, dtype, m, n, measure, us):
        results.append(Latency(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, measure, us, date))

    def calls(measure, dtype, m, n):
        """(name, phase, closure) of every implementation wanted for this case."""
        x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
        y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
        for phase in ("forward", "backward"):
            makers = latency_impls(phase)
            if measure == "host":
                makers = {name: makers[name] for name in ("helpers", "torch", "quack") if name in makers}
                makers.update(host_parts(phase))
            else:
                makers["copy"] = copy_reference(phase)
            for name, make in makers.items():
                if impls is None or name in impls:
                    try:
                        yield name, phase, make(x, y, dy)
                    except Exception as error:  # a peer that refuses a shape (QuACK: rows not 16-byte multiples)
                        print(f"{name} {phase} {dtype} {m} x {n}: {type(error).__name__}: {str(error)[:100]}")

    host = {(name, phase, dtype, m, n): fn for dtype in dtypes for m, n in HOST_SHAPES
            for name, phase, fn in calls("host", dtype, m, n)}
    for (name, phase, dtype, m, n), ms in cpu_ms_per_calls(host).items():
        record(name, phase, dtype, m, n, "host", ms * 1e3)
    decode = [(dtype, m, n) for dtype in dtypes for n in DECODE_N for m in DECODE_M]
    host = {}
    for dtype, m, n in tqdm(decode, desc="decode grid", disable=not progress):
        for name, phase, fn in calls("eager", dtype, m, n):
            try:
                timings = {"eager": time_ms(fn) * 1e3}
                if name in GRAPHED:
                    timings["graph"] = graph_us(fn)
            except Exception as error:  # QuACK refuses rows that are not 16-byte multiples when called
                print(f"{name} {phase} {dtype} {m} x {n}: {type(error).__name__}: {str(error)[:100]}")
                continue
            for measure, us in timings.items():
                record(name, phase, dtype, m, n, measure, us)
            if name in HOST_TIMED:
                host[name, phase, dtype, m, n] = fn
    for (name, phase, dtype, m, n), ms in cpu_ms_per_calls(host).items():  # the decode points' host time, in turns
        record(name, phase, dtype, m, n, "host", ms * 1e3)
    return results


# Softmax over a dim that is not the last: a long leading dim, a sequence dim, a segmentation head's 21 classes
OTHER_DIMS = [((32768, 4096), 0, torch.float32), ((32, 1024, 4096), 1, torch.bfloat16),
              ((64, 21, 512, 512), 1, torch.float32)]


@dataclass
class DimResult:
    """A timing of softmax over ``dim`` of a tensor of ``shape`` ("32x1024x4096"), as ``Result``."""

    gpu: str
    impl: str
    phase: str
    dtype: str
    shape: str
    dim: int
    ms: float
    gbps: float
    copy_gbps: float
    date: str


def other_dims_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-other-dims.csv")


def load_other_dims(path: Path | None = None) -> list[DimResult]:
    """Recorded other-dim timings (``make bench``), found as ``load_results`` finds its sweep."""
    return read_rows(path or recorded(other_dims_path), DimResult)


def sweep_other_dims(progress: bool = True) -> list[DimResult]:
    """The course, torch and torch.compile on OTHER_DIMS, forward and backward, with the copy of the same tensor."""
    from tqdm.auto import tqdm

    from .ops import softmax_backward, softmax_forward

    gpu, date = gpu_name(), datetime.date.today().isoformat()
    results = []
    for shape, dim, dtype in tqdm(OTHER_DIMS, desc="other dims", disable=not progress):
        x = (torch.randn(shape, device=DEVICE) * 4).to(dtype)
        y, dy = torch.softmax(x.float(), dim).to(dtype), torch.randn_like(x)
        ceiling = copy_gbps(x.numel(), dtype)
        calls = {"forward": {"helpers": functools.partial(softmax_forward, x, dim),
                             "torch": functools.partial(torch.softmax, x, dim),
                             "compile": functools.partial(_compiled("forward", dim), x)},
                 "backward": {"helpers": functools.partial(softmax_backward, y, dy, dim),
                              "torch": functools.partial(torch._softmax_backward_data, dy, y, dim, dtype),
                              "compile": functools.partial(_compiled("backward", dim), y, dy)}}
        for phase, impls in calls.items():
            n_bytes = ELEMENTS_MOVED[phase] * x.numel() * x.element_size()
            for name, fn in impls.items():
                ms = time_ms(fn)
                results.append(DimResult(gpu, name, phase, str(dtype).removeprefix("torch."),
                                         "x".join(map(str, shape)), dim, ms, gbps(n_bytes, ms), ceiling, date))
    return results


def spill_report() -> list[dict]:
    """Registers and spills of every variant of the fused and column kernels compiled in this process."""
    from . import columns, split_rows, tiles, two_pass

    rows = []
    for kernel in (tiles.softmax_tile_kernel, split_rows.softmax_split_kernel, tiles.softmax_backward_tile_kernel,
                   split_rows.softmax_backward_split_kernel, two_pass.softmax_two_pass_kernel,
                   two_pass.softmax_backward_two_pass_kernel, columns.softmax_column_kernel,
                   columns.softmax_backward_column_kernel, columns.softmax_column_split_kernel,
                   columns.softmax_backward_column_split_kernel, columns.softmax_column_looped_kernel,
                   columns.softmax_backward_column_looped_kernel):
        for compiled in kernel.device_caches[torch.cuda.current_device()][0].values():
            compiled._init_handles()
            constants = {k[0] if isinstance(k, tuple) else k: v for k, v in compiled.src.constants.items()}
            rows.append(dict(kernel=kernel.fn.__name__, n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                             num_warps=compiled.metadata.num_warps, constants=str(constants)))
    return rows


PARTS = ("grid", "long-rows", "other-dims", "latency")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-elements", type=int, default=2**27, help="M * N of every input (default 2**27)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="which sweeps to run (default all)")
    args = parser.parse_args()
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
    if "long-rows" in args.parts:
        long_rows = sweep_long_rows()
        print(f"wrote {len(long_rows)} rows to {save_results(long_rows, path.with_name(path.stem + '-long-rows.csv'))}")
        for r in select(long_rows, impl="helpers"):
            print(f"{r.phase:8s} {r.dtype:8s} {r.M} x {r.N:9d} helpers {r.gbps / r.copy_gbps:5.2f} of copy")
    if "other-dims" in args.parts:
        other_dims = sweep_other_dims()
        print(f"wrote {len(other_dims)} rows to {save_results(other_dims, other_dims_path(gpu_name()))}")
        for r in other_dims:
            print(f"{r.phase:8s} {r.dtype:8s} dim {r.dim} of {r.shape:14s} {r.impl:8s} "
                  f"{r.gbps / r.copy_gbps:5.2f} of copy")
    if "latency" in args.parts:
        latency = sweep_latency()
        print(f"wrote {len(latency)} rows to {save_results(latency, latency_path(gpu_name()))}")
        for r in select(latency, impl="helpers"):
            peers = {p.impl: p.us for p in select(latency, phase=r.phase, dtype=r.dtype, M=r.M, N=r.N,
                                                  measure=r.measure) if p.impl != "helpers"}
            print(f"{r.measure:5s} {r.phase:8s} {r.dtype:8s} {r.M:2d} x {r.N:6d} helpers {r.us:6.1f} us  "
                  + "  ".join(f"{name} {us:6.1f}" for name, us in peers.items()))
    spills = spill_report()
    with path.with_name(path.stem + "-spills.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(spills[0]))
        writer.writeheader()
        writer.writerows(spills)
    print(f"fused kernels compiled: {len(spills)}, with spills: {sum(r['n_spills'] > 0 for r in spills)}")


if __name__ == "__main__":
    main()
