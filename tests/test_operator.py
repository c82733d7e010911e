"""helpers.softmax as a PyTorch operator (notebook 08): torch.library.opcheck, torch.compile, and a model that trains.

On a GPU the ops are triton_ops that torch.compile traces into; under Triton's interpreter they are opaque custom_ops
(the interpreter cannot be traced), so there torch.compile calls them whole and the tests say so.
"""

import pytest
import torch
from conftest import ON_GPU, randn, run_with_timeout, traced_by_torch

import helpers
from helpers import model

FORWARD, BACKWARD = torch.ops.softmax_course.softmax.default, torch.ops.softmax_course.softmax_backward.default


def forward_cases():
    odd = randn(5, 3, 37, dtype=torch.float64)
    return [
        (randn(7, 33), -1),
        (randn(7, 33, dtype=torch.bfloat16), 0),
        (odd, 1),
        (odd.transpose(0, 2), 2),  # non-contiguous
        (randn(0, 9), -1),  # empty
    ]


@pytest.mark.parametrize("case", range(len(forward_cases())))
def test_opcheck_forward(case):
    x, dim = forward_cases()[case]
    results = torch.library.opcheck(FORWARD, (x.requires_grad_(), dim))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("case", range(len(forward_cases())))
def test_opcheck_backward(case):
    x, dim = forward_cases()[case]
    y = torch.softmax(x.float(), dim).to(x.dtype)
    dy = randn(*x.shape, dtype=x.dtype).expand_as(y)  # the expanded gradients autograd passes work too
    results = torch.library.opcheck(BACKWARD, (y, dy, dim))
    assert set(results.values()) == {"SUCCESS"}, results


def test_opcheck_long_rows(looped):
    """The split kernels (rows cut into pieces with a ticket counter) through the op, fake tensors included."""
    x = randn(6, 100)
    assert helpers.plans.plan_for(100, "forward").segments > 1
    assert set(torch.library.opcheck(FORWARD, (x, -1)).values()) == {"SUCCESS"}
    y = torch.softmax(x, -1)
    assert set(torch.library.opcheck(BACKWARD, (y, randn(6, 100), -1)).values()) == {"SUCCESS"}


def test_capped_plans_trace_as_opaque_operators(looped):
    """A traced call whose rows take a plan with a register cap (Inductor would build its kernel without it) is
    recorded as an opaque operator that runs the eager launch: the 16-bit forward's wide pieces and the backward's
    16 KB pieces here, with ``looped``'s small pieces. Its fake implementation lays the output out as the launch does
    (opcheck), and it trains like the traced operator."""
    x16, x32 = randn(6, 100, dtype=torch.bfloat16), randn(6, 100)
    assert helpers.plans.plan_for(100, "forward", 2).max_registers is not None
    assert helpers.plans.plan_for(100, "forward", 4).max_registers is None
    assert helpers.plans.plan_for(100, "backward", 4).max_registers is not None
    capped_forward = torch.ops.softmax_course.softmax_capped.default
    capped_backward = torch.ops.softmax_course.softmax_backward_capped.default
    assert set(torch.library.opcheck(capped_forward, (x16.clone().requires_grad_(), -1)).values()) == {"SUCCESS"}
    y = torch.softmax(x32, -1)
    assert set(torch.library.opcheck(capped_backward, (y, randn(6, 100), -1)).values()) == {"SUCCESS"}
    for x, op in ((x16, "softmax_course.softmax_capped.default"), (x32, "softmax_course.softmax.default")):
        code = torch._dynamo.explain(lambda x: helpers.softmax(x * 0.5, -1))(x).graphs[0].code
        assert op in code, code
    torch._dynamo.reset()
    x = x32.clone().requires_grad_()
    dy = randn(6, 100)
    (expected,) = torch.autograd.grad(helpers.softmax(x * 0.5, -1), x, dy)
    compiled = torch.compile(lambda x: helpers.softmax(x * 0.5, -1), backend="aot_eager", fullgraph=True)
    (dx,) = torch.autograd.grad(compiled(x), x, dy)  # its backward: the opaque capped operator
    torch.testing.assert_close(dx, expected)


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


# torch.compile over every kernel shape: a tile (1000), splits (50257, 131072; bf16 65536, whose forward's plan caps
# its registers, and fp32 131072's backward: opaque operators), the two-pass kernels (2**22 + 3) and a split down the
# columns of a dim of 3000, forward and backward, in a subprocess whose timeout fails the test if a launch waits
# forever. Under CUDA graphs an opaque operator runs in the graph's memory pool and must leave no buffer there.
COMPILED_ROWS = r"""
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
         ((65536,), -1, torch.bfloat16, "softmax_course.softmax_capped"),
         ((2**22 + 3,), -1, torch.float32, "softmax_two_pass_kernel"),
         ((3000, 2048), 1, torch.float32, "softmax_column_split_kernel")]


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
        for _ in range(3):  # CUDA graphs record on a later call than the first, then replay
            y = compiled(x)
            (dx,) = torch.autograd.grad(y, x, dy)
        torch.testing.assert_close(y, expected, atol=1e-7, rtol=1e-5 if dtype == torch.float32 else 1e-2)
        torch.testing.assert_close(dx, expected_dx, atol=1e-7, rtol=1e-5 if dtype == torch.float32 else 1e-2)
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
    assert stdout.count(" ok") == 6, stdout
