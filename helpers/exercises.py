"""Checkers for notebook 09's exercises. Each runs a learner's function on several inputs, compares it with PyTorch,
and prints one line: a pass mark, or a fail mark with the input, the place and the size of the worst difference.
Each returns True on a pass, so tests can assert on it; none raises, so a notebook of untouched stubs still runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from .device import DEVICE, sized
from .ops import softmax_forward
from .plans import plan_for

PASS, FAIL = "✓", "✗"


def _inputs(shapes, scale=3.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {f"{m} x {n}": (torch.randn(m, n, generator=generator) * scale).to(DEVICE) for m, n in shapes}


# Inputs this far from 0 overflow exp in fp32 (e^89 is already inf): only a safe softmax, which subtracts the max
# first, passes on them.
LARGE_OFFSET = 1000.0


def _with_large_values(cases: dict) -> dict:
    """``cases`` and, for the first, the same input + LARGE_OFFSET."""
    label, x = next(iter(cases.items()))
    return {**cases, f"{label} + {LARGE_OFFSET:g}": x + LARGE_OFFSET}


@contextmanager
def _unwritten_as_nan():
    """New tensors (``torch.empty``, ``empty_like``) filled with NaN while it lasts, as PyTorch fills them in
    deterministic mode: an element a learner's kernel never writes then fails the comparison, rather than passing on
    whatever the memory held (often 0, the value a masked entry should have)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)  # only for the fill: nothing raises
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _last_line(error: Exception) -> str:
    """An exception's last line, where a Triton compilation error names its cause (after the learner's source)."""
    lines = str(error).strip().splitlines()
    return lines[-1][:200] if lines else ""


def _compare(name: str, fn: Callable, cases: dict, expected_fn: Callable, atol=1e-5, rtol=1e-4,
             passed: str | None = "") -> bool:
    """Whether ``fn`` matches ``expected_fn`` on every case; a fail line at the first that does not, and a pass line
    ending in ``passed`` (none where it is None) if all do. ``fn`` gets copies of the inputs (one that writes them
    cannot change what it is compared with) and NaN where it leaves its output unwritten."""
    for label, args in cases.items():
        args = args if isinstance(args, tuple) else (args,)
        try:
            with _unwritten_as_nan():
                got = fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        except Exception as error:  # a stub or a broken kernel: say so, do not stop the notebook
            print(f"{FAIL} {name}: on {label} it raised {type(error).__name__}: {_last_line(error)}")
            return False
        expected = expected_fn(*args)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            print(f"{FAIL} {name}: on {label} it returned {shape}, expected a tensor of shape {tuple(expected.shape)}")
            return False
        got64, expected64 = got.double().cpu(), expected.double().cpu()
        close = torch.isclose(got64, expected64, atol=atol, rtol=rtol, equal_nan=True)
        if not close.all():
            error = torch.where(close, 0.0, (got64 - expected64).abs().nan_to_num(float("inf")))
            where = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
            print(f"{FAIL} {name}: on {label}, {int((~close).sum())} of {close.numel()} values differ; "
                  f"worst at {list(where)}: got {got64[where].item():.6g}, expected {expected64[where].item():.6g}")
            return False
    if passed is not None:
        inputs = "1 input" if len(cases) == 1 else f"{len(cases)} inputs"
        print(f"{PASS} {name}: matches PyTorch on {inputs} ({', '.join(cases)}){passed}")
    return True


def check_column_softmax(column_softmax: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """softmax along dim 0 of a 2-D tensor: each column sums to 1; also of a transposed tensor (its columns
    neighbours in memory) and of large values."""
    cases = _with_large_values(_inputs([(sized(1823, 67), sized(781, 45)), (1, 5), (37, 1)]))
    cases["a transposed 45 x 67"] = _inputs([(67, 45)], seed=1)["67 x 45"].t()
    # many of a long column's outputs are under 1e-5 (most at the GPU size): an atol that size would pass any of them
    return _compare("column_softmax", column_softmax, cases, lambda x: torch.softmax(x, dim=0), atol=1e-10)


def check_temperature_softmax(temperature_softmax: Callable[[torch.Tensor, float], torch.Tensor]) -> bool:
    """softmax(x / T): sharper as T -> 0 (one-hot on the max), flatter as T -> infinity (uniform)."""
    x = _inputs([(sized(512, 16), sized(1000, 100))])
    (label, x), = x.items()
    cases = {f"{label}, T = {t}": (x, t) for t in (0.5, 1.0, 4.0)}
    if not _compare("temperature_softmax", temperature_softmax, cases, lambda x, t: torch.softmax(x / t, dim=-1)):
        return False
    # rows of distinct values 0.1 apart, so the max is unique and T -> 0 has a clear limit
    generator = torch.Generator().manual_seed(1)
    spaced = torch.stack([torch.randperm(x.shape[-1], generator=generator) for _ in range(x.shape[0])]) * 0.1
    spaced = spaced.to(dtype=x.dtype, device=DEVICE)
    one_hot = torch.nn.functional.one_hot(spaced.argmax(-1), x.shape[-1]).to(x.dtype)
    limits = {
        "T -> 0 (T = 1e-3) gives a one-hot vector on each row's max": ((spaced, 1e-3), one_hot),
        "T -> infinity (T = 1e6) gives the uniform 1/N": ((spaced, 1e6), torch.full_like(x, 1 / x.shape[-1])),
    }
    for label, (args, expected) in limits.items():
        if not _compare("temperature_softmax", temperature_softmax, {label: args}, lambda *_, e=expected: e,
                        atol=1e-4, rtol=1e-3):
            return False
    return True


def check_log_softmax(log_softmax: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """log softmax(x) = x - m - log d, finite even where softmax itself underflows to 0."""
    cases = _inputs([(sized(1823, 67), sized(781, 181)), (3, 7)])
    spread = torch.zeros(4, 5, device=DEVICE)
    # the others' softmax underflows in fp32: to 0 (e^-200 and less), or to a subnormal (e^-90)
    spread[:, 0] = torch.tensor([200.0, 500.0, 1000.0, 90.0], device=DEVICE)
    cases["rows where softmax underflows to 0"] = spread
    return _compare("log_softmax", log_softmax, cases, lambda x: torch.log_softmax(x, dim=-1), atol=1e-4)


class _TorchCalls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called inside it (a Triton launch calls only
    ``data_ptr``, ``stride`` and the like)."""

    def __enter__(self):
        self.names = set()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)).strip("_").removeprefix("r"))
        return func(*args, **(kwargs or {}))


# What computes on the scores in PyTorch, outside a kernel: each a full read and write of them. Names as _TorchCalls
# records them (underscores and a reflected operator's "r" stripped), torch's aliases included.
_SCORE_ARITHMETIC = {"mul", "multiply", "div", "divide", "truediv", "true_divide", "softmax", "exp", "sub", "subtract",
                     "add"}


def check_scaled_softmax(scaled_softmax: Callable[[torch.Tensor, float], torch.Tensor]) -> bool:
    """softmax(scale * x) in one kernel, as attention does with scale = 1 / sqrt(d_head): the right values, and no
    arithmetic in PyTorch around the kernel (scaling x first is the extra read and write the fusion saves)."""
    (label, x), = _inputs([(sized(1823, 67), sized(781, 181))]).items()
    cases = {f"{label}, scale = {s:g}": (x, s) for s in (0.125, 1.0, 3.0)}
    cases[f"{label} + {LARGE_OFFSET:g}, scale = 0.125"] = (x + LARGE_OFFSET, 0.125)
    probe = x.clone()  # the learner's function may write its input
    with _TorchCalls() as calls:
        try:
            scaled_softmax(probe, 0.125)
        except Exception:  # a stub or a broken kernel: _compare says so
            pass
    outside = sorted(calls.names & _SCORE_ARITHMETIC)
    if not _compare("scaled_softmax", scaled_softmax, cases, lambda x, s: torch.softmax(x * s, dim=-1),
                    passed=None if outside else ", with no arithmetic outside the kernel"):
        return False
    if not outside:
        return True
    print(f"{FAIL} scaled_softmax: PyTorch computes on the scores outside the kernel ({', '.join(outside)}), one more "
          f"read and write of them each: multiply by scale inside the kernel, after the load")
    return False


SHAPES = {  # name -> (the GPU shape, the CPU shape with the same row length where the interpreter allows)
    "wide": ((16, 8192), (4, 8192)),
    "tall": ((8192, 128), (256, 128)),
    "square": ((2048, 2048), (64, 2048)),
    "vocabulary": ((64, 50257), (2, 50257)),
}


def check_predicted_plans(predicted_plans: dict[str, tuple[int, int]]) -> bool:
    """For each shape, (rows per program, programs per row) of the course's forward kernel, predicted by the learner;
    then the kernel itself is checked on every shape."""
    for name, (gpu_shape, _) in SHAPES.items():
        plan = plan_for(gpu_shape[1], "forward")
        actual = (plan.rows, plan.segments)
        guess = predicted_plans.get(name) if isinstance(predicted_plans, dict) else None
        if not isinstance(guess, (tuple, list)) or tuple(guess) != actual:  # a list [1, 1] answers as (1, 1) does
            print(f"{FAIL} predicted_plans: for {name} {gpu_shape} you predicted {guess}, the kernel uses {actual} "
                  f"(rows per program, programs per row)")
            return False
    cases = _inputs([sized(*SHAPES[name]) for name in SHAPES])
    return _compare("the course's softmax on every shape", softmax_forward, cases, lambda x: torch.softmax(x, -1),
                    atol=1e-6)


def check_causal_softmax(causal_softmax: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Row i of a T x T score matrix sees columns 0..i only (as in a decoder's attention); masked entries are 0."""
    def expected(x):
        future = torch.ones_like(x, dtype=torch.bool).triu(1)
        return torch.softmax(x.masked_fill(future, float("-inf")), dim=-1)

    cases = _with_large_values(_inputs([(sized(512, 37), sized(512, 37)), (1, 1), (5, 5)]))
    return _compare("causal_softmax", causal_softmax, cases, expected)
