"""The calls past notebook 06's grid, measured (notebook 07): few rows over a vocabulary (latency and the host's
time per call), single rows longer than a split holds, and softmax over a dim that is not the last.

``make bench`` runs them after the grid (``bench.main``); on a machine with no GPU the notebooks read the recorded
files in results/.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench import (
    ELEMENTS_MOVED,
    Result,
    checked_ms,
    compiled_softmax,
    copy_gbps,
    expected_output,
    gbps,
    gpu_name,
    peer_backward_impls,
    peer_forward_impls,
    read_rows,
    recorded,
    results_path,
    save_results,
    select,
    time_ms,
    wrong_output,
)
from .device import DEVICE


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
        expected = {phase: expected_output(phase, x, y, dy) for phase in ("forward", "backward")}
        for (phase, name), fn in impls.items():
            if (ms := checked_ms(fn, expected[phase], f"{name} {phase} {dtype} {m} x {n}")) is None:
                continue
            n_bytes = ELEMENTS_MOVED[phase] * m * n * x.element_size()
            results.append(Result(gpu, name, phase, str(dtype).removeprefix("torch."), m, n, ms, gbps(n_bytes, ms),
                                  ceiling, date))
        del expected
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


def load_latency(path: Path | None = None) -> list[Latency]:
    """Recorded host times and decode latencies (``make bench``'s latency part), found as ``load_results`` finds its
    sweep."""
    return read_rows(path or recorded(latency_path), Latency)


def latency_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-latency.csv")


def _forward_only(make: Callable, x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    return make(x)


def latency_impls(phase: str) -> dict[str, Callable[..., Callable[[], object]]]:
    """``bench``'s peers of ``phase`` (the course's op, torch, torch.compile, Liger and QuACK when installed), each
    taking (x, y, dy) whatever the phase."""
    if phase == "forward":
        return {name: functools.partial(_forward_only, make) for name, make in peer_forward_impls().items()}
    return peer_backward_impls()


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
        """(name, phase, closure, the output it must return or None for the copy and the host's parts) of every
        implementation wanted for this case."""
        x = (torch.randn(m, n, device=DEVICE) * 4).to(dtype)
        y, dy = torch.softmax(x.float(), -1).to(dtype), torch.randn_like(x)
        for phase in ("forward", "backward"):
            makers = latency_impls(phase)
            softmax_calls = set(makers)
            if measure == "host":
                makers = {name: makers[name] for name in ("helpers", "torch", "quack") if name in makers}
                makers.update(host_parts(phase))
            else:
                makers["copy"] = copy_reference(phase)
            expected = expected_output(phase, x, y, dy)
            for name, make in makers.items():
                if impls is None or name in impls:
                    try:
                        yield name, phase, make(x, y, dy), expected if name in softmax_calls else None
                    except Exception as error:  # a peer that refuses a shape (QuACK: rows not 16-byte multiples)
                        print(f"{name} {phase} {dtype} {m} x {n}: {type(error).__name__}: {str(error)[:100]}")

    host = {(name, phase, dtype, m, n): fn for dtype in dtypes for m, n in HOST_SHAPES
            for name, phase, fn, _ in calls("host", dtype, m, n)}
    for (name, phase, dtype, m, n), ms in cpu_ms_per_calls(host).items():
        record(name, phase, dtype, m, n, "host", ms * 1e3)
    decode = [(dtype, m, n) for dtype in dtypes for n in DECODE_N for m in DECODE_M]
    host = {}
    for dtype, m, n in tqdm(decode, desc="decode grid", disable=not progress):
        for name, phase, fn, expected in calls("eager", dtype, m, n):
            label = f"{name} {phase} {dtype} {m} x {n}"
            try:
                if expected is not None and (problem := wrong_output(fn(), expected)) is not None:
                    print(f"{label}: wrong output ({problem}), not timed")
                    continue
                timings = {"eager": time_ms(fn) * 1e3}
                if name in GRAPHED:
                    timings["graph"] = graph_us(fn)
            except Exception as error:  # refused when called: Liger past 65536, QuACK rows not 16-byte multiples
                print(f"{label}: {type(error).__name__}: {str(error)[:100]}")
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
                             "compile": functools.partial(compiled_softmax("forward", dim), x)},
                 "backward": {"helpers": functools.partial(softmax_backward, y, dy, dim),
                              "torch": functools.partial(torch._softmax_backward_data, dy, y, dim, dtype),
                              "compile": functools.partial(compiled_softmax("backward", dim), y, dy)}}
        for phase, impls in calls.items():
            n_bytes = ELEMENTS_MOVED[phase] * x.numel() * x.element_size()
            expected = expected_output(phase, x, y, dy, dim)
            for name, fn in impls.items():
                if (ms := checked_ms(fn, expected, f"{name} {phase} {dtype} dim {dim} of {shape}")) is None:
                    continue
                results.append(DimResult(gpu, name, phase, str(dtype).removeprefix("torch."),
                                         "x".join(map(str, shape)), dim, ms, gbps(n_bytes, ms), ceiling, date))
    return results


def run(parts: Iterable[str]) -> None:
    """``make bench``'s sweeps of these calls ("long-rows", "other-dims", "latency"): each written to results/, and
    the course's figures printed."""
    gpu = gpu_name()
    if "long-rows" in parts:
        long_rows = sweep_long_rows()
        path = results_path(gpu)
        print(f"wrote {len(long_rows)} rows to {save_results(long_rows, path.with_name(path.stem + '-long-rows.csv'))}")
        for r in select(long_rows, impl="helpers"):
            print(f"{r.phase:8s} {r.dtype:8s} {r.M} x {r.N:9d} helpers {r.gbps / r.copy_gbps:5.2f} of copy")
    if "other-dims" in parts:
        other_dims = sweep_other_dims()
        print(f"wrote {len(other_dims)} rows to {save_results(other_dims, other_dims_path(gpu))}")
        for r in other_dims:
            print(f"{r.phase:8s} {r.dtype:8s} dim {r.dim} of {r.shape:14s} {r.impl:8s} "
                  f"{r.gbps / r.copy_gbps:5.2f} of copy")
    if "latency" in parts:
        latency = sweep_latency()
        print(f"wrote {len(latency)} rows to {save_results(latency, latency_path(gpu))}")
        for r in select(latency, impl="helpers"):
            peers = {p.impl: p.us for p in select(latency, phase=r.phase, dtype=r.dtype, M=r.M, N=r.N,
                                                  measure=r.measure) if p.impl != "helpers"}
            print(f"{r.measure:5s} {r.phase:8s} {r.dtype:8s} {r.M:2d} x {r.N:6d} helpers {r.us:6.1f} us  "
                  + "  ".join(f"{name} {us:6.1f}" for name, us in peers.items()))
