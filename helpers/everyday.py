"""Everyday calls (notebook 07): the shapes a learner's code hands softmax, far from the benchmark grid, each timed for
the course against ``torch.softmax`` and its backward in the same run. ``make bench`` records them
(``python -m helpers.bench --parts everyday``); on a machine with no GPU the notebook reads the recorded file.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench import expected_output, gpu_name, read_rows, recorded, results_path, time_ms, wrong_output
from .device import DEVICE

# (what the call is, shape, dim, dtype, view): the view takes the tensor as made ("contiguous"), transposed ("t"), its
# first 1000 columns ("sliced"), its last position along dim 1 ("last", a sampling loop's logits[:, -1]) or in
# channels-last memory ("channels_last", as convolutions leave it), or takes it as made and asks for an fp32 result
# ("fp32 result": softmax(x, dim, dtype=torch.float32), as attention code upcasts 16-bit scores; its backward
# returns dx in x's dtype).
CASES = [
    ("classifier logits", (64, 10), -1, torch.float32, "contiguous"),
    ("ImageNet logits", (256, 1000), -1, torch.float32, "contiguous"),
    ("MoE router, 8 experts", (16384, 8), -1, torch.float32, "contiguous"),
    ("MoE router, 64 experts", (8192, 64), -1, torch.bfloat16, "contiguous"),
    ("attention scores, 512", (8, 12, 512, 512), -1, torch.float16, "contiguous"),
    ("attention scores, 2048", (2, 16, 2048, 2048), -1, torch.bfloat16, "contiguous"),
    ("scores to fp32", (2, 16, 2048, 2048), -1, torch.bfloat16, "fp32 result"),
    ("fp16 scores to fp32", (8, 12, 512, 512), -1, torch.float16, "fp32 result"),
    ("decode scores", (1, 32, 1, 4096), -1, torch.bfloat16, "contiguous"),
    ("LM logits", (8, 1024, 50257), -1, torch.bfloat16, "contiguous"),
    ("sampling one row", (1, 50257), -1, torch.float32, "contiguous"),
    ("sampling 16 rows", (16, 128256), -1, torch.float32, "contiguous"),
    ("logits[:, -1]", (8, 128, 50257), -1, torch.bfloat16, "last"),
    ("odd rows", (333, 777), -1, torch.float32, "contiguous"),
    ("xyz rows", (100000, 3), -1, torch.float32, "contiguous"),
    ("fp64 rows", (1024, 1024), -1, torch.float64, "contiguous"),
    ("transposed", (4096, 4096), -1, torch.float32, "t"),
    ("sliced", (4096, 1024), -1, torch.float32, "sliced"),
    ("150 classes (ADE20K)", (8, 150, 128, 128), 1, torch.float32, "contiguous"),
    ("21 classes, bf16", (4, 21, 256, 256), 1, torch.bfloat16, "contiguous"),
    ("21 classes, channels last", (4, 21, 256, 256), 1, torch.float32, "channels_last"),
    ("scores over queries", (8, 12, 512, 512), -2, torch.float16, "contiguous"),
    ("dim 0 over 64 columns", (1000, 64), 0, torch.float32, "contiguous"),
    ("dim 0, 20000 x 512", (20000, 512), 0, torch.bfloat16, "contiguous"),
    ("dim 0, 100000 x 64", (100000, 64), 0, torch.float32, "contiguous"),
    ("pooling, 8 heads", (1, 100000, 8), 1, torch.float32, "contiguous"),
    ("pooling, 4 heads", (64, 2000, 4), 1, torch.float32, "contiguous"),
    ("two columns", (4096, 1000, 2), 1, torch.float32, "contiguous"),
    ("dim 0 of fp64", (20000, 512), 0, torch.float64, "contiguous"),
]


@dataclass
class EverydayResult:
    """One call's timing: ``gpu_us`` the GPU's time (``time_ms``'s median, the lesser of two taken in turns with
    torch's), ``host_us`` the host's time to issue it (``bench_calls.cpu_ms_per_calls``)."""

    gpu: str
    case: str
    shape: str
    dim: int
    dtype: str
    view: str
    phase: str
    impl: str
    gpu_us: float
    host_us: float
    date: str


def make_input(shape: tuple, dtype: torch.dtype, view: str) -> torch.Tensor:
    x = (torch.randn(shape, device=DEVICE) * 4).to(dtype)
    if view == "t":
        return x.t()
    if view == "last":
        return x[:, -1]
    if view == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    return x[..., :1000] if view == "sliced" else x


def everyday_path(gpu: str) -> Path:
    path = results_path(gpu)
    return path.with_name(path.stem + "-everyday.csv")


def load_everyday(path: Path | None = None) -> list[EverydayResult]:
    """Recorded everyday calls (``make bench``), found as ``bench.load_results`` finds its sweep."""
    return read_rows(path or recorded(everyday_path), EverydayResult)


def torch_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype):
    """torch's backward of ``torch.softmax(x, dim, y.dtype)`` for an x of ``dtype``, as its autograd runs it. On a GPU
    torch casts a 16-bit x to an fp32 y inside its softmax kernels for fp16 only (its half_to_float kernels); a bf16 x
    is cast first, so its gradient is the fp32 backward and then the cast's."""
    if dtype == y.dtype or dtype == torch.float16:
        return functools.partial(torch._softmax_backward_data, dy, y, dim, dtype)
    return lambda: torch._softmax_backward_data(dy, y, dim, y.dtype).to(dtype)


def sweep(progress: bool = True) -> list[EverydayResult]:
    """The course and torch on every case of CASES, forward and backward, each output checked first."""
    from tqdm.auto import tqdm

    from .bench_calls import cpu_ms_per_calls
    from .ops import softmax, softmax_backward

    gpu, date = gpu_name(), datetime.date.today().isoformat()
    results = []
    for case, shape, dim, dtype, view in tqdm(CASES, desc="everyday calls", disable=not progress):
        x = make_input(shape, dtype, view)
        y_dtype = torch.float32 if view == "fp32 result" else dtype
        y = torch.softmax(x, dim, dtype=y_dtype)
        dy = torch.randn_like(y)
        calls = {"forward": {"helpers": functools.partial(softmax, x, dim, y_dtype),
                             "torch": functools.partial(torch.softmax, x, dim, dtype=y_dtype)},
                 "backward": {"helpers": functools.partial(softmax_backward, y, dy, dim, dtype),
                              "torch": torch_backward(y, dy, dim % x.ndim, dtype)}}
        for phase, fns in calls.items():
            expected = expected_output(phase, x, y, dy, dim)
            for name, fn in fns.items():
                output = fn()
                if (problem := wrong_output(output, expected)) is not None:
                    raise AssertionError(f"{name} {phase} of {case}: {problem}")
                if output.dtype != (y_dtype if phase == "forward" else dtype):
                    raise AssertionError(f"{name} {phase} of {case}: {output.dtype}")
            first, second = ({name: time_ms(fn) for name, fn in fns.items()} for _ in range(2))
            host = cpu_ms_per_calls(fns, calls=100, repeats=5)
            for name in fns:
                results.append(EverydayResult(gpu, case, "x".join(map(str, x.shape)), dim,
                                              str(dtype).removeprefix("torch."), view, phase, name,
                                              min(first[name], second[name]) * 1e3, host[name] * 1e3, date))
    return results
