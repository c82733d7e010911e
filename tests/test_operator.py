"""helpers.softmax as a PyTorch operator (notebook 08): torch.library.opcheck, torch.compile, and a model that trains.

On a GPU the ops are triton_ops that torch.compile traces into; under Triton's interpreter they are opaque custom_ops
(the interpreter cannot be traced), so there torch.compile calls them whole and the tests say so.
"""

import pytest
import torch
from conftest import (
    ON_GPU,
    backward_tolerance,
    randn,
    run_with_timeout,
    split_wherever_it_fits,
    torch_backward,
    traced_by_torch,
)
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import helpers
from helpers import model

FORWARD, BACKWARD = torch.ops.softmax_course.softmax.default, torch.ops.softmax_course.softmax_backward.default


def forward_cases():
    """(x, dim, the output's dtype)."""
    odd = randn(5, 3, 37, dtype=torch.float64)
    return [
        (randn(7, 33), -1, torch.float32),
        (randn(7, 33, dtype=torch.bfloat16), 0, torch.bfloat16),
        (odd, 1, torch.float64),
        (odd.transpose(0, 2), 2, torch.float64),  # non-contiguous
        (randn(2, 1100, 3, dtype=torch.float64), 1, torch.float64),  # fp64 down a long dim: two passes
        (randn(0, 9), -1, torch.float32),  # empty
        (randn(), 0, torch.float32),  # 0-d: one row of one element
        (randn(7, 33, dtype=torch.float16), -1, torch.float32),  # upcast as loaded: rows and columns
        (randn(7, 33, dtype=torch.bfloat16), 0, torch.float32),
    ]


@pytest.mark.parametrize("case", range(len(forward_cases())))
def test_opcheck_forward(case):
    x, dim, dtype = forward_cases()[case]
    results = torch.library.opcheck(FORWARD, (x.requires_grad_(), dim, dtype))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("case", range(len(forward_cases())))
def test_opcheck_backward(case):
    """y and dy in the forward output's dtype, dx in its input's."""
    x, dim, dtype = forward_cases()[case]
    y = torch.softmax(x.float(), dim).to(dtype)
    dy = randn(*x.shape, dtype=dtype).expand_as(y)  # the expanded gradients autograd passes work too
    results = torch.library.opcheck(BACKWARD, (y, dy, dim, x.dtype))
    assert set(results.values()) == {"SUCCESS"}, results


def test_opcheck_long_rows(looped):
    """The split kernels (rows cut into pieces with a ticket counter) through the op, fake tensors included."""
    x = randn(6, 100)
    assert helpers.plans.plan_for(100, "forward").segments > 1
    assert set(torch.library.opcheck(FORWARD, (x, -1, x.dtype)).values()) == {"SUCCESS"}
    y = torch.softmax(x, -1)
    assert set(torch.library.opcheck(BACKWARD, (y, randn(6, 100), -1, y.dtype)).values()) == {"SUCCESS"}


class Logged(TorchDispatchMode):
    """The operators torch dispatches in the block, as a logger or a FLOP counter sees them."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_watched_calls_run_the_operators():
    """A TorchDispatchMode (a logger, FlopCounterMode, make_fx) and torch.jit.trace see an operator only through its
    dispatcher, which plain calls skip: a watched call, of a layout launched before too, runs the operators, forward
    and backward, with torch's values."""
    x, dy = randn(4, 50), randn(4, 50, scale=1.0)
    y = helpers.softmax(x, 0)  # plain calls: each layout's launch is kept
    helpers.softmax_backward(y, dy, 0)
    with Logged() as logged:
        y_watched, dx = helpers.softmax(x, 0), helpers.softmax_backward(y, dy, 0)
    assert logged.ops == [FORWARD, BACKWARD]
    torch.testing.assert_close(y_watched, torch.softmax(x, 0))
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, 0), **backward_tolerance(y, dy, 0))
    traced = torch.jit.trace(lambda x: helpers.softmax(x, 0), x)
    assert "softmax_course::softmax" in {node.kind() for node in traced.graph.nodes()}
    x_new = randn(4, 50)
    torch.testing.assert_close(traced(x_new), torch.softmax(x_new, 0))


def traced_operators(fn, tracing_mode: str, *args) -> set[str]:
    """The operators a trace of ``fn`` calls: of the operators' bodies, as torch.compile traces them on a GPU, with
    sizes as numbers ("fake") or as symbols ("symbolic", torch.compile's dynamic shapes)."""
    return {str(node.target) for node in make_fx(fn, tracing_mode=tracing_mode)(*args).graph.nodes}


def test_eager_operators_where_a_traced_plan_would_not_hold(looped):
    """A traced call is recorded as an opaque operator that runs the eager launch where its rows' plan caps the
    kernel's registers (Inductor would build the kernel without the cap: the 16-bit forward's wide pieces and the
    backward's 16 KB pieces here, with ``looped``'s small pieces) and where a size is a symbol (a plan would fix the
    graph to one length). Their fake implementations lay the output out as the launch does (opcheck), and a compiled
    step trains like eager."""
    x16, x32 = randn(6, 100, dtype=torch.bfloat16), randn(6, 100)
    assert helpers.plans.plan_for(100, "forward", 2).max_registers is not None
    assert helpers.plans.plan_for(100, "forward", 4).max_registers is None
    assert helpers.plans.plan_for(100, "backward", 4).max_registers is not None
    eager_forward = torch.ops.softmax_course.softmax_eager.default
    eager_backward = torch.ops.softmax_course.softmax_backward_eager.default
    for x, dim in ((x16, -1), (x32.t(), 0), (x32.t().contiguous(), 0)):  # rows, turned tiles, columns
        assert set(torch.library.opcheck(eager_forward, (x, dim, x.dtype)).values()) == {"SUCCESS"}
    y = torch.softmax(x32, -1)
    assert set(torch.library.opcheck(eager_backward, (y, randn(6, 100), -1, y.dtype)).values()) == {"SUCCESS"}

    forward, backward = helpers.ops._forward, helpers.ops._backward
    assert "softmax_course.softmax_eager.default" in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x16)
    assert not any("eager" in op for op in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x32))
    assert "softmax_course.softmax_eager.default" in traced_operators(lambda x: forward(x, 1, x.dtype), "symbolic", x32)
    assert "softmax_course.softmax_backward_eager.default" in traced_operators(
        lambda y, dy: backward(y, dy, 1, y.dtype), "fake", y, y)
    torch._dynamo.reset()
    x = x32.clone().requires_grad_()
    dy = randn(6, 100)
    (expected,) = torch.autograd.grad(helpers.softmax(x * 0.5, -1), x, dy)
    compiled = torch.compile(lambda x: helpers.softmax(x * 0.5, -1), backend="aot_eager", fullgraph=True)
    (dx,) = torch.autograd.grad(compiled(x), x, dy)
    torch.testing.assert_close(dx, expected)


def test_traced_columns_in_two_passes_run_eager(monkeypatch):
    """A traced call down the columns is recorded as its kernels where it is held or split, and as the opaque eager
    operators where it takes two passes (fp64 past what turned tiles hold, a split that does not fit, or a forward
    split that would not pay): traced with its backward under torch 2.11 and Triton 3.9, the two-pass kernels failed to
    compile (``ops``)."""
    forward, backward = helpers.ops._forward, helpers.ops._backward
    x = randn(2, helpers.columns.TURNED_MAX_HELD_FP64 + 76, 3, dtype=torch.float64)
    y = torch.softmax(x, 1)
    assert "softmax_course.softmax_eager.default" in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x)
    assert "softmax_course.softmax_backward_eager.default" in traced_operators(
        lambda y, dy: backward(y, dy, 1, y.dtype), "fake", y, y)
    x32 = randn(2, helpers.columns.MAX_HELD + 76, 40)
    assert "softmax_course.softmax_eager.default" in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x32)
    monkeypatch.setattr(helpers.recipes, "_recipes", {})
    split_wherever_it_fits(monkeypatch)
    assert not any("eager" in op for op in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x32))  # split
    monkeypatch.setattr(helpers.recipes, "_recipes", {})
    monkeypatch.setattr(helpers.residency, "split_grid", lambda *args: 0)  # no split fits: two passes
    assert "softmax_course.softmax_eager.default" in traced_operators(lambda x: forward(x, 1, x.dtype), "fake", x32)


@pytest.mark.parametrize("dim", [-1, 0])
def test_compiled_growing_length(looped, dim):
    """A softmax dim that grows call by call, as the scores of a decode loop's attention do, under
    torch.compile(fullgraph=True): torch.compile traces the length as a symbol from its second value on, and the
    call then runs as the opaque eager operator, so the graphs compiled stay few (torch.compile refuses a ninth, and
    fullgraph then fails) while forward and backward match eager at every length. Rows (tile and split, ``looped``'s
    pieces) and columns, on CPU through AOTAutograd's eager backend (the GPU test: Inductor). Three columns are held
    up to 8192 elements (``columns.held_length``); longer ones are split, or taken in two passes."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: helpers.softmax(x * 0.5, dim), backend="aot_eager", fullgraph=True)
    lengths = (5, 12, 17, 40, 100, 257, 600, 1000, 1500, 2100) if dim == -1 else (5, 17, 100, 1000, 8192, 8500)
    for n in lengths:
        x = (randn(3, n) if dim == -1 else randn(n, 3)).requires_grad_()
        dy = torch.randn_like(x)
        y = compiled(x)
        (dx,) = torch.autograd.grad(y, x, dy)
        expected = torch.softmax(x.detach().double() * 0.5, dim)
        torch.testing.assert_close(y, expected.float())
        torch.testing.assert_close(dx, torch_backward(expected, dy, dim).float() * 0.5)
    # The first length's graph, then one for every length after, whichever kernel a length takes: the traced call asks
    # no plan of the symbol, so crossing the longest held length compiles nothing new.
    assert dim == -1 or any(n > helpers.columns.held_length(3, 4, 1) for n in lengths[1:])
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]


def attention_probabilities(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return helpers.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1)


def test_no_graph_break():
    q, k = randn(2, 3, 40, 16), randn(2, 3, 40, 16)
    explanation = torch._dynamo.explain(attention_probabilities)(q, k)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert "softmax_course.softmax" in explanation.graphs[0].code


def compiled_against_eager(backend: str) -> None:
    torch._dynamo.reset()
    q, k = randn(2, 3, 40, 16).requires_grad_(), randn(2, 3, 40, 16)
    dp = randn(2, 3, 40, 40)
    expected = attention_probabilities(q, k)
    (expected_dq,) = torch.autograd.grad(expected, q, dp)
    p = torch.compile(attention_probabilities, backend=backend, fullgraph=True)(q, k)
    (dq,) = torch.autograd.grad(p, q, dp)
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(dq, expected_dq)


@traced_by_torch
def test_compiled_aot_eager():
    """AOTAutograd traces forward and backward together and runs the result eagerly."""
    compiled_against_eager("aot_eager")


@traced_by_torch
def test_compiled_dynamic_split_columns():
    """A dim too long to hold, split down its columns, traced with symbolic sizes: the fake output asks no plan (a
    split's plan is cached by concrete sizes), and one graph takes two lengths, forward and backward."""
    torch._dynamo.reset()
    softmax_dim_1 = torch.compile(lambda t: helpers.softmax(t, 1), backend="aot_eager", dynamic=True, fullgraph=True)
    for n_reduced in (1500, 1600):
        x = randn(2, n_reduced, 16).requires_grad_()
        assert n_reduced > helpers.columns.held_length(16, 4, 1) and helpers.columns.takes_columns(1, x)
        y = softmax_dim_1(x)
        dy = randn(*y.shape)
        (dx,) = torch.autograd.grad(y, x, dy)
        torch.testing.assert_close(y, torch.softmax(x, 1))
        torch.testing.assert_close(dx, torch_backward(y.detach(), dy, 1).float(), atol=1e-6, rtol=1e-4)


@traced_by_torch
def test_compiled_zero_dim():
    torch._dynamo.reset()
    x = randn().requires_grad_()
    y = torch.compile(lambda t: helpers.softmax(t, 0), backend="aot_eager", fullgraph=True)(x)
    (dx,) = torch.autograd.grad(y, x)
    assert y.shape == () and y.item() == 1.0 and dx.item() == 0.0


@traced_by_torch
@pytest.mark.parametrize("dim", [-1, 1])
def test_compiled_jagged_nested_tensor(dim):
    """A nested tensor of the jagged layout through torch.compile(fullgraph=True), over its columns and over its
    ragged sequence dim: each sequence's softmax and gradient, as in eager."""
    torch._dynamo.reset()
    sequences = [randn(length, 6) for length in (3, 5, 1)]
    x = torch.nested.nested_tensor(sequences, layout=torch.jagged).requires_grad_()
    backend = "inductor" if ON_GPU else "aot_eager"
    y = torch.compile(lambda t: helpers.softmax(t, dim), backend=backend, fullgraph=True)(x)
    dy = torch.nested.nested_tensor_from_jagged(torch.randn_like(y.values()), x.offsets())
    (dx,) = torch.autograd.grad(y, x, dy)
    for sequence, y_seq, dy_seq, dx_seq in zip(sequences, y.unbind(), dy.unbind(), dx.unbind(), strict=True):
        expected = torch.softmax(sequence, dim - 1 if dim > 0 else dim)
        torch.testing.assert_close(y_seq, expected)
        torch.testing.assert_close(dx_seq, torch_backward(expected, dy_seq, dim - 1 if dim > 0 else dim).float())


@pytest.mark.skipif(not ON_GPU, reason="Inductor compiles the Triton kernels it traces for a GPU; Triton's "
                    "interpreter cannot be traced, so on CPU the op is opaque and Inductor would only call it "
                    "(test_compiled_aot_eager covers that path)")
@traced_by_torch
def test_compiled_inductor_traces_the_kernels():
    from torch._inductor.utils import run_and_get_code

    compiled_against_eager("inductor")
    torch._dynamo.reset()
    q, k = randn(2, 3, 40, 16), randn(2, 3, 40, 16)
    _, (code, *_) = run_and_get_code(torch.compile(attention_probabilities), q, k)
    assert "softmax_tile_kernel" in code  # Inductor launches our kernel itself: the op is not a black box


def test_model_trains_like_torch_softmax():
    config = model.Config(context=32, width=32, heads=2, layers=1, batch=8)
    expected = model.train(config, torch.softmax, 30, helpers.DEVICE)
    losses = model.train(config, helpers.softmax, 30, helpers.DEVICE)
    assert losses[-1] < 0.9 * losses[0]  # it learns
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-4)


# The compiled scripts below first check the eager call against torch in fp64, so that a compiled call cannot pass by
# matching a wrong eager one.
AGAINST_TORCH = r"""
import torch


def against_torch(x, dy, dim, y, dx):
    # y = softmax(0.5 x) within a rounding of its dtype; dx from the same y, with an atol of a rounding of the
    # products y * dy (where dy - sum(y * dy) cancels)
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(x.dtype, 2e-2)
    floor = 1e-12 if x.dtype == torch.float64 else 1e-6
    expected = torch.softmax(x.detach().double() * 0.5, dim)
    torch.testing.assert_close(y.double(), expected, atol=floor * 1e-3, rtol=rtol)
    y = y.detach().double()
    expected_dx = 0.5 * torch._softmax_backward_data(dy.double(), y, dim, torch.float64)
    scale = (y.abs().amax() * dy.double().abs().amax()).item()
    torch.testing.assert_close(dx.double(), expected_dx, atol=floor * scale, rtol=rtol)
"""


# torch.compile over every kernel shape: a tile (1000), splits (50257, 131072; bf16 65536, whose forward's plan caps
# its registers, and fp32 131072's backward: opaque operators), the two-pass kernels (2**22 + 3), a split down the
# columns of a dim of 3000 and two passes down them in fp64 (opaque too), forward and backward, in a subprocess whose
# timeout fails the test if a launch waits forever. Under CUDA graphs an opaque operator runs in the graph's memory
# pool and must leave no buffer there.
COMPILED_ROWS = AGAINST_TORCH + r"""
import sys
import torch
import helpers
from torch._inductor.utils import run_and_get_code

torch._dynamo.config.recompile_limit = 64
mode = sys.argv[1]
options = dict(fullgraph=True, dynamic=mode == "dynamic", mode="reduce-overhead" if mode == "cuda-graphs" else None)
# (shape after the rows, softmax dim, dtype, what Inductor's code calls for its forward: the kernel it launches, or
# the opaque operator of a plan with a register cap)
CASES = [((1000,), -1, torch.float32, "softmax_tile_kernel"), ((50257,), -1, torch.float32, "softmax_split_kernel"),
         ((131072,), -1, torch.float32, "softmax_split_kernel"),
         ((65536,), -1, torch.bfloat16, "softmax_course.softmax_eager"),
         ((2**22 + 3,), -1, torch.float32, "softmax_two_pass_kernel"),
         ((3000, 2048), 1, torch.float32, "softmax_column_split_kernel"),
         ((3000, 512), 1, torch.float64, "softmax_course.softmax_eager")]


for shape, dim, dtype, kernel in CASES:
    def scaled_softmax(x):
        return helpers.softmax(x * 0.5, dim)

    torch._dynamo.reset()
    compiled = torch.compile(scaled_softmax, **options)
    for rows in (4, 3) if shape[0] < 2**22 else (1, 2):  # a second row count: dynamic shapes, or a recompile
        x = torch.randn(rows, *shape, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(rows, *shape, device="cuda", dtype=dtype)
        expected = scaled_softmax(x)
        (expected_dx,) = torch.autograd.grad(expected, x, dy)
        against_torch(x, dy, dim, expected, expected_dx)
        for _ in range(3):  # CUDA graphs record on a later call than the first, then replay
            y = compiled(x)
            (dx,) = torch.autograd.grad(y, x, dy)
        rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y, expected, atol=1e-7, rtol=rtol)
        torch.testing.assert_close(dx, expected_dx, atol=1e-7, rtol=rtol)
    if mode == "default":  # Inductor's code launches the course's kernel for this shape
        torch._dynamo.reset()
        _, (code, *_) = run_and_get_code(torch.compile(scaled_softmax, fullgraph=True), x.detach())
        assert kernel in code, (shape, kernel)
    print(shape, "ok", flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="Inductor compiles the traced Triton kernels only for a GPU")
@pytest.mark.parametrize("mode", ["default", "dynamic", "cuda-graphs"])
def test_compiled_every_row_length(mode):
    stdout = run_with_timeout(COMPILED_ROWS, mode, timeout=600)
    assert stdout.count(" ok") == 7, stdout


# A row length that grows call by call through every kernel a length takes: tiles, splits (bf16 65536's forward and
# fp32 151936's backward with register caps), the two passes (2**22 + 3); a graph for the first length, one for the
# symbol that every later length is. In a subprocess whose timeout fails the test if a launch waits forever.
GROWING_ROWS = AGAINST_TORCH + r"""
import sys
import torch
import helpers
from torch._dynamo.utils import counters

dtype, mode = getattr(torch, sys.argv[1]), None if sys.argv[2] == "default" else sys.argv[2]


def scaled_softmax(x):
    return helpers.softmax(x * 0.5, -1)


compiled = torch.compile(scaled_softmax, fullgraph=True, mode=mode)
for n in (5, 100, 1000, 3000, 16384, 16385, 50257, 65536, 151936, 2**22 + 3):
    x = torch.randn(2, n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(2, n, device="cuda", dtype=dtype)
    expected = scaled_softmax(x)
    (expected_dx,) = torch.autograd.grad(expected, x, dy)
    against_torch(x, dy, -1, expected, expected_dx)
    for _ in range(3 if mode else 1):  # CUDA graphs record on a later call than the first, then replay
        y = compiled(x)
        (dx,) = torch.autograd.grad(y, x, dy)
    tolerance = dict(atol=1e-7, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(y, expected, **tolerance)
    torch.testing.assert_close(dx, expected_dx, **tolerance)
print("graphs", counters["stats"]["unique_graphs"], flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="Inductor compiles the traced Triton kernels only for a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_growing_row_length(dtype, mode):
    stdout = run_with_timeout(GROWING_ROWS, dtype, mode, timeout=600)
    assert "graphs 2" in stdout.splitlines(), stdout
