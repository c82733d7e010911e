"""The teaching kernels of notebooks 01-05, launched directly, and the fused kernels' plans (notebook 06)."""

import pytest
import torch
from conftest import DTYPES, ODD_SHAPE, TOLERANCE, backward_tolerance, randn, torch_backward

import helpers
from helpers import fused, kernels, plans, residency

FORWARD = [kernels.softmax_kernel, kernels.softmax_online_kernel]
BACKWARD = [kernels.softmax_backward_kernel, kernels.softmax_backward_looped_kernel]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", FORWARD, ids=lambda k: k.__name__)
def test_forward_kernels(looped, kernel, dtype):
    """Under ``looped`` the looped kernel walks a row in chunks of 16 (twelve of them on CPU), so every chunk after the
    first may raise the running max."""
    x = randn(*ODD_SHAPE, dtype=dtype).t()  # strided: column stride != 1
    y = torch.full(x.shape, float("nan"), dtype=dtype, device=x.device)
    kernels.launch_forward(x, y, kernel)
    torch.testing.assert_close(y, torch.softmax(x, -1), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", BACKWARD, ids=lambda k: k.__name__)
def test_backward_kernels(looped, kernel, dtype):
    y = torch.softmax(randn(*ODD_SHAPE, dtype=torch.float64), -1).to(dtype)
    dy = randn(1, ODD_SHAPE[1], dtype=dtype).expand(ODD_SHAPE)  # zero row stride
    dx = torch.full(y.shape, float("nan"), dtype=dtype, device=y.device)
    kernels.launch_backward(y, dy, dx, kernel)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, -1), **backward_tolerance(y, dy, -1))


@pytest.mark.parametrize("element_size", [2, 4, 8])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("n_cols", [1, 3, 256, 781, 1024, 4097, 16384, 32769, 50257, 65536, 151936, 262144])
def test_plans_cover_the_row(phase, n_cols, element_size):
    plan = plans.plan_for(n_cols, phase, element_size)
    assert plan.segments * plan.block_n >= n_cols > (plan.segments - 1) * plan.block_n
    assert plan.rows * plan.block_n <= max(plans.TILE_ELEMENTS, plan.block_n)
    assert 1 <= plan.num_warps <= 16
    assert plan.persistent == (plan.segments > 1)  # a split must be persistent (all its programs resident)


def test_small_calls_spread_their_tiles():
    """On an H100's 132 SMs: 64 rows of 10 (one tile of 64 rows) take 64 one-row tiles on 4 warps; 16384 rows of 8
    (128 tiles of 128 rows) 1024 tiles of 16 rows; 100000 rows of 3 (391 tiles) 782 of 128; 200000 rows of 3 (782
    tiles) and one-row tiles (rows of 1000 and 16384) keep their plan."""
    h100 = 132
    assert plans.spread_tiles(plans.tile_plan(10), 64, h100) == plans.Plan(1, 16, 1, plans.SPREAD_WARPS)
    assert plans.spread_tiles(plans.tile_plan(8), 16384, h100) == plans.Plan(16, 8, 1, plans.SPREAD_WARPS)
    assert plans.spread_tiles(plans.tile_plan(3), 100000, h100) == plans.Plan(128, 4, 1, plans.SPREAD_WARPS)
    for n_rows, n_cols in ((200000, 3), (8, 1000), (8, 16384)):
        assert plans.spread_tiles(plans.tile_plan(n_cols), n_rows, h100) == plans.tile_plan(n_cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_small_call_launches_spread_tiles(phase, dtype):
    """A call of 64 rows of 10 launches the tile ``spread_tiles`` gives it on this device (CPU_SMS under the
    interpreter), fewer rows than the plan's, and writes every element right."""
    x = randn(64, 10, dtype=dtype)
    y = torch.softmax(x, -1)
    out = torch.full_like(x, float("nan"))
    if phase == "forward":
        (step,) = fused.forward_recipe(out, x, None).steps
        fused.launch_rows_forward(x, out)
        expected, tolerance = y, TOLERANCE[dtype]
    else:
        dy = randn(64, 10, dtype=dtype)
        (step,) = fused.backward_recipe(out, y, dy, None).steps
        fused.launch_rows_backward(y, dy, out)
        expected = torch_backward(y, dy, -1)
        tolerance = backward_tolerance(y, dy, -1)
    plan = plans.plan_for(10, phase, x.element_size())
    spread = plans.spread_tiles(plan, 64, residency.sm_count(x.device))
    assert (step.constexprs["ROWS"], step.num_warps) == (spread.rows, spread.num_warps)
    assert spread.rows < plan.rows and step.grid <= plans.cdiv(64, spread.rows)
    torch.testing.assert_close(out.to(expected.dtype), expected, **tolerance)


def test_a_given_tile_is_launched_as_given():
    """A plan handed to the launch (notebook 06's steps, the tuning sweeps) is not spread, however small the call."""
    x = randn(64, 10)
    plan = plans.tile_plan(10)
    (step,) = fused.forward_recipe(torch.empty_like(x), x, plan).steps
    assert (step.constexprs["ROWS"], step.num_warps) == (plan.rows, plan.num_warps) == (64, 2)


@pytest.mark.parametrize("shape", [(23, 50), (1024, 8)])  # split rows (pieces of 32 under `looped`), tiles
def test_fused_grid_is_persistent(looped, shape):
    """Under the interpreter the grid is a few programs (or groups), so each loops over several tiles or rows; on a GPU
    it is as many as the GPU holds (more than these shapes' work), so no more than the work."""
    x = randn(*shape)
    (*_, step) = fused.forward_recipe(torch.empty_like(x), x, None).steps
    segments = step.constexprs.get("SEGMENTS", 1)
    work = shape[0] if segments > 1 else plans.cdiv(shape[0], step.constexprs["ROWS"])  # rows of a split, or tiles
    if helpers.INTERPRET:
        assert step.grid == segments * residency.CPU_PROGRAMS and residency.CPU_PROGRAMS < work
    else:
        assert step.grid == segments * work
    torch.testing.assert_close(helpers.softmax_forward(x), torch.softmax(x, -1))
