"""Softmax over a dim that is not the last, in place (helpers.columns): which calls take it, torch's values and
layout, and the plan's limits."""

import dataclasses
import functools

import pytest
import torch
from conftest import (
    BACKWARD_TOLERANCE,
    DTYPES,
    ON_GPU,
    TOLERANCE,
    backward_tolerance,
    launched,
    randn,
    run_with_timeout,
    split_wherever_it_fits,
    torch_backward,
)

import helpers
from helpers import columns, recipes, residency, turned

# (shape, dim): a short class dim, a dim of 1, an odd dim over odd columns, the longest dim held, a leading dim
# the two passes' running sum rounds once per block of rows: fp32 a little looser than TOLERANCE; the same for the
# backward's sum of y * dy over a dim of 1101, whose rounding an element of dx near 0.03 saw at 1.5e-6 in one CPU run
LONG_TOLERANCE = {**TOLERANCE, torch.float32: dict(atol=1e-6, rtol=1e-4)}
LONG_BACKWARD_TOLERANCE = {**BACKWARD_TOLERANCE, torch.float32: dict(atol=1e-6, rtol=1e-4)}
long_backward_tolerance = functools.partial(backward_tolerance, tolerances=LONG_BACKWARD_TOLERANCE)
SHAPES = [((4, 21, 6, 5), 1), ((3, 1, 7), 1), ((2, 37, 19), 1), ((2, columns.MAX_HELD, 3), 1), ((9, 40), 0)]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float64])
@pytest.mark.parametrize("shape, dim", SHAPES)
def test_values_and_layout(shape, dim, dtype):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[::7] = float("-inf")  # columns with -inf, and (for dims of 1) columns of nothing but -inf
    assert columns.takes_columns(dim, x)
    y, expected = helpers.softmax_forward(x, dim), torch.softmax(x, dim)
    torch.testing.assert_close(y, expected, equal_nan=True, **TOLERANCE[dtype])
    assert y.stride() == expected.stride() == x.stride()  # torch's layout: contiguous, as the input
    dy = randn(*shape, dtype=dtype, scale=1.0)
    dx = helpers.softmax_backward(expected, dy, dim)
    torch.testing.assert_close(dx.double(), torch_backward(expected, dy, dim), equal_nan=True,
                               **backward_tolerance(expected, dy, dim))
    assert dx.stride() == x.stride()


def test_autograd_gradient_in_the_input_layout():
    x = randn(3, 21, 8).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    weights = torch.linspace(-1, 1, 8, device=x.device)  # dy of order 1, as BACKWARD_TOLERANCE assumes
    (helpers.softmax(x, 1) * weights).sum().backward()
    (torch.softmax(x_torch, 1) * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **BACKWARD_TOLERANCE[torch.float32])
    assert x.grad.stride() == x_torch.grad.stride()


@pytest.mark.parametrize("make_input, dim", [
    (lambda: randn(6, 5, 4).transpose(0, 2), 1),  # not contiguous
    (lambda: randn(5, 7, dtype=torch.float64), 0),  # fp64
    (lambda: randn(5, 7), 1),  # the last dim: rows
    (lambda: randn(5, 7, 1), 1),  # no neighbours: contiguous rows
])
def test_other_calls_keep_the_rows_path(make_input, dim):
    x = make_input()
    assert not columns.takes_columns(dim, x)
    torch.testing.assert_close(helpers.softmax_forward(x, dim), torch.softmax(x, dim), **TOLERANCE[x.dtype])


@pytest.mark.parametrize("fits", [True, False], ids=["split", "two-pass"])
def test_long_dim_with_few_columns(monkeypatch, fits):
    """A dim too long to hold over few columns takes the columns whatever the GPU holds: split where a group of its
    pieces fits the GPU together, else in two passes, whose chunks of rows give the GPU programs that the columns
    alone would not."""
    split_wherever_it_fits(monkeypatch)
    if not fits:
        monkeypatch.setattr(residency, "split_grid", lambda *args: 0)
    monkeypatch.setattr(columns, "TWO_PASS_PIECE", (256, 128, 8))
    monkeypatch.setattr(recipes, "_recipes", {})
    x = randn(2, columns.MAX_HELD + 1, 40)
    assert columns.takes_columns(1, x)
    y, expected = helpers.softmax_forward(x, 1), torch.softmax(x, 1)
    torch.testing.assert_close(y, expected, **LONG_TOLERANCE[torch.float32])
    dy = randn(*x.shape, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(expected, dy, 1).double(), torch_backward(expected, dy, 1),
                               **long_backward_tolerance(expected, dy, 1))
    split = {"softmax_column_split_kernel", "softmax_backward_column_split_kernel"}
    passes = {"softmax_column_two_pass_kernel", "softmax_backward_column_two_pass_kernel"}
    assert launched() == (split if fits else passes)
    if not fits:  # 2 outer indices x 2 column blocks x 5 chunks of 256 rows
        assert {step.grid for recipe in recipes._recipes.values() for step in recipe.steps} == {20}


@pytest.mark.parametrize("n_inner", [2, 3, 5, 8])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("n_inputs", [1, 2])
def test_narrow_columns(n_inner, element_size, n_inputs):
    """Fewer columns than MIN_COLUMNS: blocks as narrow as the columns (a power of two), held while they hold no more
    elements than the longest held block, split past that into pieces as much taller as they are narrower."""
    block_c = 1 << (n_inner - 1).bit_length()
    longest = columns.held_length(n_inner, element_size, n_inputs)
    if n_inputs == 1:
        assert longest * block_c == columns.MAX_HELD * columns.NARROW_COLUMNS
    else:
        assert longest * block_c * element_size == columns.MAX_HELD_BACKWARD * columns.NARROW_RUN_BYTES
    held, split = (columns.column_plan(n, n_inner, element_size, n_inputs) for n in (longest, longest + 1))
    assert (held.segments, held.block_r, held.block_c) == (1, longest, block_c)
    piece = (columns.TWO_LEVEL_PIECE if element_size == 4 else columns.FORWARD_PIECE) if n_inputs == 1 else (
        columns.BACKWARD_PIECE)
    rows, run_bytes, warps = piece
    assert (split.block_c, split.num_warps) == (block_c, warps) and split.segments > 1
    assert split.block_r * block_c == rows * run_bytes // element_size  # the piece's elements, no idle lanes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_reduced", [1000, 5000, 20000])
def test_narrow_column_values(monkeypatch, dtype, n_reduced):
    """Two columns: held blocks of two columns, tall pieces of two (in fp32 at 20000, merged in two levels with one
    column for the first two programs to merge and none for the rest), each with torch's values."""
    split_wherever_it_fits(monkeypatch)
    monkeypatch.setattr(recipes, "_recipes", {})
    x = randn(2, n_reduced, 2, dtype=dtype)
    x[1, :, 0] = float("-inf")
    assert columns.takes_columns(1, x)
    y, expected = helpers.softmax_forward(x, 1), torch.softmax(x, 1)
    torch.testing.assert_close(y, expected, equal_nan=True, **LONG_TOLERANCE[dtype])
    dy = randn(*x.shape, dtype=dtype, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(expected, dy, 1).double(), torch_backward(expected, dy, 1),
                               equal_nan=True, **long_backward_tolerance(expected, dy, 1))
    assert {step.constexprs["BLOCK_C"] for recipe in recipes._recipes.values() for step in recipe.steps} == {2}


def test_offsets_past_32_bits_keep_the_rows_path():
    """The column kernels' offsets within one outer index are 32-bit: a dim of 1024 over 2**21 + 1 columns (8 GB in
    fp32, described here on the meta device) takes the rows path, one column fewer the columns."""
    assert not columns.takes_columns(0, torch.empty(1024, 2**21 + 1, device="meta"))
    assert columns.takes_columns(0, torch.empty(1024, 2**21 - 1, device="meta"))


@pytest.mark.parametrize("n_reduced", [1, 21, 100, 512, 1000, columns.MAX_HELD])
@pytest.mark.parametrize("n_inner", [1, 3, 4096, 262144])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("n_inputs", [1, 2])
def test_plan(n_reduced, n_inner, element_size, n_inputs):
    plan = columns.column_plan(n_reduced, n_inner, element_size, n_inputs)
    if n_inputs == 2 and n_reduced > columns.held_length(n_inner, element_size, 2):  # y and dy: split sooner
        assert n_reduced > columns.MAX_HELD_BACKWARD
        rows, run_bytes, warps = columns.BACKWARD_PIECE  # a few pieces at most, here
        assert plan == columns.ColumnPlan(rows, run_bytes // element_size, warps, segments=-(-n_reduced // rows))
        return
    assert plan.segments == 1
    assert plan.block_r >= n_reduced and plan.block_r & (plan.block_r - 1) == 0  # the whole dim, a power of two
    long = n_reduced > columns.LONG_COLUMN // 2
    if n_inputs == 1:  # the forward computes in fp32 whatever the dtype: columns, not bytes
        assert plan.block_c <= (columns.NARROW_COLUMNS if long else columns.WIDE_COLUMNS)
    else:
        run_bytes = columns.NARROW_RUN_BYTES if long else columns.WIDE_RUN_BYTES
        assert plan.block_c * element_size <= run_bytes
    assert plan.block_c < n_inner * 2  # no wider than the columns there are
    held_bytes = plan.block_r * plan.block_c * element_size * n_inputs
    assert plan.num_warps in (2, 4, 8, 16) and plan.num_warps * columns.WARP_BYTES <= max(2 * columns.WARP_BYTES,
                                                                                          held_bytes)


SHORT_SPLIT = columns.BACKWARD_PIECE[0] * columns.MAX_BACKWARD_PIECES  # the longest backward dim in short pieces
TALL_SPLIT = columns.TALL_BACKWARD_PIECE[0] * columns.MAX_TALL_PIECES  # ... and in tall ones


TWO_LEVEL_SPLIT = columns.TWO_LEVEL_PIECE[0] * columns.MAX_TWO_LEVEL_PIECES  # the longest fp32 forward dim in them


@pytest.mark.parametrize("n_inputs, n_reduced, element_size, piece", [
    (1, columns.MAX_HELD + 1, 2, "FORWARD_PIECE"), (1, 32768, 2, "FORWARD_PIECE"), (1, 10**6, 2, "FORWARD_PIECE"),
    (1, columns.MAX_HELD + 1, 4, "TWO_LEVEL_PIECE"), (1, TWO_LEVEL_SPLIT, 4, "TWO_LEVEL_PIECE"),
    (1, TWO_LEVEL_SPLIT + 1, 4, "FORWARD_PIECE"), (1, 10**6, 4, "FORWARD_PIECE"),
    *[(2, n_reduced, element_size, piece) for element_size in (2, 4) for n_reduced, piece in (
        (columns.MAX_HELD + 1, "BACKWARD_PIECE"), (SHORT_SPLIT, "BACKWARD_PIECE"),
        (SHORT_SPLIT + 1, "TALL_BACKWARD_PIECE"), (32768, "TALL_BACKWARD_PIECE"), (TALL_SPLIT, "TALL_BACKWARD_PIECE"),
        (TALL_SPLIT + 1, "LONG_BACKWARD_PIECE"), (10**6, "LONG_BACKWARD_PIECE"))],
])
def test_split_plan(n_inputs, n_reduced, element_size, piece):
    """Past MAX_HELD, pieces of a fixed shape, as many as the dim needs: in an fp32 forward, short ones merged in two
    levels up to MAX_TWO_LEVEL_PIECES of them; in the backward, short ones up to MAX_BACKWARD_PIECES of them, then
    tall ones up to MAX_TALL_PIECES; else long. The pieces after the first are the launch's fallbacks, in order,
    ending with one for any length (the backward's longest, after the long)."""
    rows, run_bytes, warps = getattr(columns, piece)
    plan = columns.column_plan(n_reduced, 4096, element_size, n_inputs)
    assert (plan.block_r, plan.block_c * element_size, plan.num_warps) == (rows, run_bytes, warps)
    assert plan.levels == (2 if piece == "TWO_LEVEL_PIECE" else 1)
    assert (plan.segments - 1) * plan.block_r < n_reduced <= plan.segments * plan.block_r
    plans = columns.split_plans(n_reduced, element_size, n_inputs)
    last = columns.FORWARD_PIECE if n_inputs == 1 else columns.LONGEST_BACKWARD_PIECE
    assert plans[0] == plan and (plans[-1].block_r, plans[-1].num_warps) == (last[0], last[2])
    assert [p.block_r for p in plans] == sorted(p.block_r for p in plans)  # taller pieces, fewer of them, as they go


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_takes_the_first_plan_that_fits(monkeypatch, dtype):
    """Where the first plan's group of pieces does not fit the GPU together, the split takes the next: here short
    pieces of 64 rows (9 of them, more than this GPU holds), then tall ones of 256 (3)."""
    monkeypatch.setattr(columns, "BACKWARD_PIECE", (64, 64, 4))
    monkeypatch.setattr(columns, "TALL_BACKWARD_PIECE", (256, 64, 4))
    monkeypatch.setattr(recipes, "_recipes", {})
    split_grid = residency.split_grid
    monkeypatch.setattr(residency, "split_grid", lambda segments, *args: split_grid(segments, *args) * (segments <= 4))
    x = randn(2, columns.MAX_HELD_BACKWARD + 1, 40, dtype=dtype)
    y = torch.softmax(x.float(), 1).to(dtype)
    dy = randn(*x.shape, dtype=dtype, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 1).double(), torch_backward(y, dy, 1),
                               equal_nan=True, **long_backward_tolerance(y, dy, 1))
    (step,) = [step for recipe in recipes._recipes.values() for step in recipe.steps[:1]]
    assert step.kernel.fn.__name__ == "softmax_backward_column_split_kernel"
    assert (step.constexprs["BLOCK_R"], step.constexprs["SEGMENTS"]) == (256, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fits, two_level_bytes, max_two_level_pieces", [
    (True, 64, 5), (True, 8, 5), (True, 64, 4), (False, 64, 5)],
    ids=["split", "split-narrow", "split-long", "two-pass"])
def test_long_dims(monkeypatch, dtype, fits, two_level_bytes, max_two_level_pieces):
    """A dim too long to hold is split among programs that exchange each column's partials, in pieces of 256 rows
    here (5 pieces), or taken in two passes where those programs would not fit the GPU together. In fp32 the forward's
    two-level merge gives each of the 5 programs 4 of 16 columns, or 1 of 2 columns to the first two and none to the
    others; with at most 4 short pieces it takes FORWARD_PIECE (256 rows here too), merged in one level, as 16 bits
    always do."""
    monkeypatch.setattr(columns, "FORWARD_PIECE", (256, 64, 4))
    monkeypatch.setattr(columns, "TWO_LEVEL_PIECE", (256, two_level_bytes, 4))
    monkeypatch.setattr(columns, "MAX_TWO_LEVEL_PIECES", max_two_level_pieces)
    monkeypatch.setattr(columns, "BACKWARD_PIECE", (256, 64, 4))
    monkeypatch.setattr(recipes, "_recipes", {})
    split_wherever_it_fits(monkeypatch)
    if not fits:
        monkeypatch.setattr(residency, "split_grid", lambda *args: 0)
    x = randn(2, columns.MAX_HELD + 77, 40, dtype=dtype)
    x[0, :, 3] = float("-inf")  # a column of nothing but -inf
    x[1, 5, 7] = float("nan")
    assert columns.takes_columns(1, x)
    y, expected = helpers.softmax_forward(x, 1), torch.softmax(x, 1)
    torch.testing.assert_close(y, expected, equal_nan=True, **LONG_TOLERANCE[dtype])
    assert y.stride() == x.stride()
    dy = randn(*x.shape, dtype=dtype, scale=1.0)
    dx = helpers.softmax_backward(expected, dy, 1)
    torch.testing.assert_close(dx.double(), torch_backward(expected, dy, 1), equal_nan=True,
                               **long_backward_tolerance(expected, dy, 1))
    assert dx.stride() == x.stride()
    split = {"softmax_column_split_kernel", "softmax_backward_column_split_kernel"}
    passes = {"softmax_column_two_pass_kernel", "softmax_backward_column_two_pass_kernel"}
    assert launched() == (split if fits else passes)


@pytest.mark.parametrize("shape, dim, max_chunks, chunks", [
    ((2, columns.TURNED_MAX_HELD_FP64 + 77, 40), 1, columns.MAX_COLUMN_CHUNKS, 5),  # chunks of one block of 256 rows
    ((2, columns.TURNED_MAX_HELD_FP64 + 77, 40), 1, 2, 2),  # chunks of 3 blocks, the last one shorter
    ((3000, 3), 0, 4, 3),  # blocks as narrow as the columns (4 of a run's 16), 4 times taller: 3 chunks of 1024 rows
])
def test_fp64_long_dims_take_two_passes(monkeypatch, shape, dim, max_chunks, chunks):
    """fp64 partials do not fit the split's packed words: an fp64 dim longer than turned tiles hold takes the columns
    in two passes, computing in fp64, in chunks of several blocks where MAX_COLUMN_CHUNKS caps their count; the
    backward with y in fp32 and dy in fp64 too."""
    monkeypatch.setattr(columns, "TWO_PASS_PIECE", (256, 128, 8))
    monkeypatch.setattr(columns, "MAX_COLUMN_CHUNKS", max_chunks)
    monkeypatch.setattr(recipes, "_recipes", {})
    x = randn(*shape, dtype=torch.float64)
    x.select(dim + 1, 1).fill_(float("-inf"))  # a column of nothing but -inf: NaNs, as torch's
    x.select(dim + 1, 2).select(dim, 7).fill_(float("nan"))
    x.view(-1)[::11] = float("-inf")
    assert columns.takes_columns(dim, x)
    y, expected = helpers.softmax_forward(x, dim), torch.softmax(x, dim)
    torch.testing.assert_close(y, expected, equal_nan=True, **TOLERANCE[torch.float64])
    assert y.stride() == x.stride()
    dy = randn(*shape, dtype=torch.float64, scale=1.0)
    for y_in in (expected, expected.float()):
        dx = helpers.softmax_backward(y_in, dy, dim)
        assert dx.dtype == y_in.dtype and dx.stride() == x.stride()
        torch.testing.assert_close(dx.double(), torch_backward(y_in, dy, dim), equal_nan=True,
                                   **backward_tolerance(y_in, dy, dim))
    assert launched() == {"softmax_column_two_pass_kernel", "softmax_backward_column_two_pass_kernel"}
    assert {step.ints[2] for recipe in recipes._recipes.values() for step in recipe.steps} == {chunks}


@pytest.mark.parametrize("fits", [True, False], ids=["split", "held"])
def test_backward_held_where_its_split_does_not_fit(monkeypatch, fits):
    """A backward dim between MAX_HELD_BACKWARD and MAX_HELD is split, or held where the split would not fit."""
    monkeypatch.setattr(recipes, "_recipes", {})
    if not fits:
        monkeypatch.setattr(residency, "split_grid", lambda *args: 0)
    x = randn(2, columns.MAX_HELD, 40)
    y = helpers.softmax_forward(x, 1)
    dy = randn(*x.shape, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 1).double(), torch_backward(y, dy, 1),
                               **long_backward_tolerance(y, dy, 1))  # a sum of 1024: torch's fp32 errs as much
    backward = "softmax_backward_column_split_kernel" if fits else "softmax_backward_column_kernel"
    assert launched() == {"softmax_column_kernel", backward}


def test_split_that_leaves_the_gpu_idle_gives_way(monkeypatch):
    """On a GPU that holds 32 programs whatever their registers, 17 short pieces of 32 rows fit, but as one group
    that runs 17 of the 32 (under MIN_FILL): the split takes the next plan, 5 tall pieces of 128 rows, 6 groups."""
    monkeypatch.setattr(columns, "BACKWARD_PIECE", (32, 64, 4))
    monkeypatch.setattr(columns, "TALL_BACKWARD_PIECE", (128, 64, 4))
    monkeypatch.setattr(recipes, "_recipes", {})
    resources = residency.compiled_resources
    monkeypatch.setattr(residency, "compiled_resources",
                        lambda *args: dataclasses.replace(resources(*args), resident=32, assured=32))
    monkeypatch.setattr(residency, "most_resident", lambda *args: 64)  # by threads alone
    x = randn(2, columns.MAX_HELD_BACKWARD + 1, 40)
    y = torch.softmax(x, 1)
    dy = randn(*x.shape, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 1).double(), torch_backward(y, dy, 1),
                               **long_backward_tolerance(y, dy, 1))
    (step,) = [step for recipe in recipes._recipes.values() for step in recipe.steps[:1]]
    assert (step.constexprs["BLOCK_R"], step.constexprs["SEGMENTS"]) == (128, 5)


@pytest.mark.parametrize("n_inner, resident, takes_split", [(130, 10, True), (40, 10, False), (130, 12, False)],
                         ids=["five-rounds", "two-rounds", "two-idle"])
def test_forward_split_only_where_it_pays(monkeypatch, n_inner, resident, takes_split):
    """A forward split runs only where it keeps the GPU full through FORWARD_MIN_ROUNDS rounds of its column blocks,
    else two passes. Here 5 pieces of 256 rows a block of 32 columns, on a GPU that holds 10 programs whatever their
    registers, run 2 groups at once: 10 column blocks take 5 rounds, 4 take 2; where the GPU holds 12, the 2 groups
    leave 2 idle (under FULL_FILL). The backward's split, of 9 pieces of 128 rows, runs in every case."""
    monkeypatch.setattr(recipes, "_recipes", {})
    resources = residency.compiled_resources
    monkeypatch.setattr(residency, "compiled_resources",
                        lambda *args: dataclasses.replace(resources(*args), resident=resident, assured=resident))
    x = randn(2, columns.MAX_HELD + 77, n_inner)
    y, expected = helpers.softmax_forward(x, 1), torch.softmax(x, 1)
    torch.testing.assert_close(y, expected, **LONG_TOLERANCE[torch.float32])
    dy = randn(*x.shape, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(expected, dy, 1).double(), torch_backward(expected, dy, 1),
                               **long_backward_tolerance(expected, dy, 1))
    forward = "softmax_column_split_kernel" if takes_split else "softmax_column_two_pass_kernel"
    assert launched() == {forward, "softmax_backward_column_split_kernel"}
    first_steps = {recipe.steps[0].kernel.fn.__name__: recipe.steps[0] for recipe in recipes._recipes.values()}
    assert first_steps["softmax_backward_column_split_kernel"].constexprs["SEGMENTS"] == 9
    if takes_split:
        assert first_steps[forward].constexprs["SEGMENTS"] == 5


@pytest.mark.parametrize("n_inner, run_bytes, resident, takes_split", [
    (64, 32, 12, True), (72, 32, 12, False), (144, 64, 12, True), (72, 32, 10, True)],
    ids=["short-runs-8-rounds", "short-runs-9-rounds", "longer-runs-9-rounds", "short-runs-9-rounds-full"])
def test_backward_split_of_short_runs_only_where_it_pays(monkeypatch, n_inner, run_bytes, resident, takes_split):
    """A backward split of LONGEST_BACKWARD_PIECE's 32-byte runs that leaves part of the GPU idle (under FULL_FILL)
    runs only over LONGEST_MAX_ROUNDS rounds or fewer, else two passes; one of longer runs, or on a full GPU, over
    any number. Here the backward's only piece is 128 rows of ``run_bytes``, 9 of them a column block, one group at a
    time, a round a column block: 9 of the 12 programs the GPU holds, or 9 of 10 (full)."""
    monkeypatch.setattr(recipes, "_recipes", {})
    resources = residency.compiled_resources
    monkeypatch.setattr(residency, "compiled_resources",
                        lambda *args: dataclasses.replace(resources(*args), resident=resident, assured=resident))
    monkeypatch.setattr(columns, "MAX_BACKWARD_PIECES", 0)
    monkeypatch.setattr(columns, "MAX_TALL_PIECES", 0)
    monkeypatch.setattr(columns, "LONG_BACKWARD_PIECE", (128, run_bytes, 4))
    monkeypatch.setattr(columns, "LONGEST_BACKWARD_PIECE", (128, 32, 4))
    y = torch.softmax(randn(columns.MAX_HELD + 77, n_inner), 0)
    dy = randn(*y.shape, scale=1.0)
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 0).double(), torch_backward(y, dy, 0),
                               **long_backward_tolerance(y, dy, 0))
    (step,) = [recipe.steps[0] for recipe in recipes._recipes.values()]
    if takes_split:
        assert step.kernel is columns.softmax_backward_column_split_kernel
        assert step.constexprs["SEGMENTS"] == 9 and step.constexprs["BLOCK_C"] * 4 == run_bytes
    else:
        assert step.kernel is columns.softmax_backward_column_two_pass_kernel


# A GPU subprocess: the backward over dim 0 of a (32768, 4096) fp32 tensor, against torch. On a GPU of at least 128
# SMs it takes 128 tall pieces on 8 warps, a group that fits the GPU only once over, at one program an SM, which the
# GPU holds whatever registers a build takes (``residency.assured_resident``); on a smaller one, the long pieces.
GPU_TALL_PIECES = r"""
import torch
import helpers
from helpers import columns, recipes, residency

x = torch.randn(32768, 4096, device="cuda") * 4
y, dy = torch.softmax(x, 0), torch.randn_like(x)
expected = torch._softmax_backward_data(dy.double(), y.double(), 0, torch.float64)
for call in range(3):
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 0).double(), expected, atol=1e-6, rtol=1e-4)
(step,) = [recipe.steps[0] for recipe in recipes._recipes.values()]
assert step.kernel is columns.softmax_backward_column_split_kernel, step.kernel
sms = torch.cuda.get_device_properties(0).multi_processor_count
piece = columns.TALL_BACKWARD_PIECE if sms >= 128 else columns.LONG_BACKWARD_PIECE
assert (step.constexprs["BLOCK_R"], step.num_warps) == (piece[0], piece[2]), step
assert step.grid == step.constexprs["SEGMENTS"] * (sms // step.constexprs["SEGMENTS"]), step.grid
if sms >= 128:
    (resources,) = residency._resources_cache.values()
    assert resources.registers > 128 and resources.resident == resources.assured == sms, resources
    assert resources.spills == 0, resources  # 128 partials a column merged in registers
print("ok", sms, step.constexprs["SEGMENTS"], flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the split's programs wait for each other only there")
def test_tall_backward_pieces_on_the_gpu():
    assert run_with_timeout(GPU_TALL_PIECES).startswith("ok")


# A GPU subprocess: the backward over dim 0 of a (100000, 64) tensor, against torch. Long pieces would be 196, more than
# the 132 programs of 8 warps an H100 surely holds; the longest pieces are 98, split where the rows would read each
# column as a strided row. Over 256 columns they would take more than LONGEST_MAX_ROUNDS rounds: two passes.
GPU_LONGEST_PIECES = r"""
import torch
import helpers
from helpers import columns, recipes

sms = torch.cuda.get_device_properties(0).multi_processor_count
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(100000, 64, device="cuda") * 4
    y, dy = torch.softmax(x, 0).to(dtype), torch.randn_like(x).to(dtype)
    expected = torch._softmax_backward_data(dy.double(), y.double(), 0, torch.float64)
    recipes._recipes.clear()
    for call in range(3):
        torch.testing.assert_close(helpers.softmax_backward(y, dy, 0).double(), expected, atol=1e-6 if dtype ==
                                   torch.bfloat16 else 1e-6, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)
    (step,) = [recipe.steps[0] for recipe in recipes._recipes.values()]
    if sms >= 98:
        assert step.kernel is columns.softmax_backward_column_split_kernel, step.kernel
        rows, run_bytes, warps = columns.LONGEST_BACKWARD_PIECE
        assert (step.constexprs["BLOCK_R"], step.constexprs["SEGMENTS"], step.num_warps) == (rows, 98, warps), step
        assert step.constexprs["BLOCK_C"] * y.element_size() == run_bytes
# Over 256 fp32 columns the same 98 pieces would take 32 rounds, one group at a time: two passes instead.
y, dy = torch.softmax(torch.randn(100000, 256, device="cuda") * 4, 0), torch.randn(100000, 256, device="cuda")
expected = torch._softmax_backward_data(dy.double(), y.double(), 0, torch.float64)
recipes._recipes.clear()
torch.testing.assert_close(helpers.softmax_backward(y, dy, 0).double(), expected, atol=1e-6, rtol=1e-4)
(step,) = [recipe.steps[0] for recipe in recipes._recipes.values()]
if 98 <= sms < 2 * 98:
    assert step.kernel is columns.softmax_backward_column_two_pass_kernel, step.kernel
print("ok", sms, flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the split's programs wait for each other only there")
def test_longest_backward_pieces_on_the_gpu():
    assert run_with_timeout(GPU_LONGEST_PIECES).startswith("ok")


# Turned tiles: (how the input is made from a contiguous tensor of ``shape``, shape, dim). The dim held whole next to
# itself in memory where torch's output holds it apart, or apart where torch's output holds it next to itself.
TURNED = [
    pytest.param(lambda t: t.contiguous(memory_format=torch.channels_last), (4, 21, 6, 5), 1, id="channels-last"),
    pytest.param(lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), (3, 19, 10), 1, id="channels-last-1d"),
    pytest.param(lambda t: t.t().contiguous().t(), (9, 40), -1, id="transposed"),
    pytest.param(lambda t: t.t().contiguous().t()[2:7], (9, 40), -1, id="transposed-sliced"),
    pytest.param(lambda t: t.t().contiguous().t(), (40, 9), 0, id="transposed-dim-0"),
    pytest.param(lambda t: t.contiguous(memory_format=torch.channels_last).expand(3, -1, -1, -1), (1, 6, 4, 5), 1,
                 id="expanded"),
    pytest.param(lambda t: t.t().contiguous().t(), (turned.LONG + 3, 17), -1, id="long-transposed"),
]


def turned_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as ``like`` (y and dy as a turned layer's autograd would hand them over): ``t``'s values,
    those at index 0 of the dims ``like`` expands."""
    first = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in like.stride())
    t, like_first = t[first], like[first]
    return torch.empty_strided(like_first.shape, like_first.stride(), dtype=t.dtype, device=t.device).copy_(t).expand(
        like.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make, shape, dim", TURNED)
def test_turned_values_and_layout(monkeypatch, make, shape, dim, dtype):
    """Forward (twice: its first call, then its kept launch) and backward against torch, in torch's layout
    (contiguous), by the turned kernels alone."""
    monkeypatch.setattr(recipes, "_recipes", {})
    t = randn(*shape, dtype=dtype)
    t.view(-1)[::7] = float("-inf")
    x = make(t)
    assert turned.takes(dim % x.ndim, x) and not x.is_contiguous()
    long = x.shape[dim] > 1000  # sums of that many: the long dims' tolerance in fp32
    expected = torch.softmax(x, dim)
    for _ in range(2):
        torch.testing.assert_close(helpers.softmax_forward(x, dim), expected, equal_nan=True, check_stride=True,
                                   **(LONG_TOLERANCE if long else TOLERANCE)[dtype])
    y = turned_like(torch.softmax(x.double(), dim).nan_to_num(0.0).to(dtype), x)
    dy = turned_like(randn(*x.shape, dtype=dtype, scale=1.0), x)
    assert turned.takes(dim % x.ndim, y, dy)
    dx = helpers.softmax_backward(y, dy, dim)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, dim),
                               **(long_backward_tolerance if long else backward_tolerance)(y, dy, dim))
    assert dx.is_contiguous()
    assert launched() == {"softmax_turned_kernel", "softmax_backward_turned_kernel"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_turned_upcast(monkeypatch, dtype):
    """A 16-bit channels-last x to an fp32 result, cast by the turned kernel as it loads it; dx back in x's dtype."""
    monkeypatch.setattr(recipes, "_recipes", {})
    x = randn(4, 21, 6, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    expected = torch.softmax(x, 1, dtype=torch.float32)
    torch.testing.assert_close(helpers.softmax(x, 1, dtype=torch.float32), expected, check_stride=True,
                               **TOLERANCE[torch.float32])
    y, dy = turned_like(expected, x), turned_like(randn(*x.shape, scale=1.0), x)
    dx = helpers.softmax_backward(y, dy, 1, dtype=dtype)
    assert dx.dtype == dtype and dx.is_contiguous()
    torch.testing.assert_close(dx, torch_backward(y, dy, 1).to(dtype), **backward_tolerance(y, dy, 1, dtype))
    assert launched() == {"softmax_turned_kernel", "softmax_backward_turned_kernel"}


def test_turned_autograd():
    """The gradient of a channels-last x through ``softmax``: torch's values and layout."""
    x = randn(2, 21, 4, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    weights = torch.linspace(-1, 1, 3, device=x.device)
    (helpers.softmax(x, 1) * weights).sum().backward()
    (torch.softmax(x_torch, 1) * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **BACKWARD_TOLERANCE[torch.float32])
    assert x.grad.stride() == x_torch.grad.stride()


@pytest.mark.parametrize("make_input, dim", [
    (lambda: randn(2, turned.MAX_HELD + 1, 2, 3).contiguous(memory_format=torch.channels_last), 1),  # long
    (lambda: randn(2, columns.TURNED_MAX_HELD_FP64 + 1, 3, dtype=torch.float64).transpose(1, 2), 2),
    (lambda: randn(6, 5, 4).transpose(0, 2), 1),  # no run of either axis: the rows' copies
    (lambda: randn(5, 7)[:, :4], 1),  # rows whose elements lie next to each other: the rows
    (lambda: randn(5, 7, 1).transpose(1, 2), 2),  # one inner position: a row
    (lambda: randn(4, 5, 6, 7).permute(1, 0, 2, 3), 2),  # the dims before dim are not one stride apart
    (lambda: randn(5, 7), 0),  # contiguous: the column kernels
])
def test_other_calls_do_not_turn(make_input, dim):
    x = make_input()
    assert not turned.takes(dim, x)
    torch.testing.assert_close(helpers.softmax_forward(x, dim), torch.softmax(x, dim), check_stride=True,
                               **TOLERANCE[x.dtype])


def test_turned_view():
    """(outer, inner, R) sizes and strides; dims of 1 anywhere; dims that do not collapse; 32-bit spans."""
    x = torch.empty(4, 21, 6, 5, device="meta").contiguous(memory_format=torch.channels_last)
    assert turned.view(x, 1) == (4, 30, 630, 21, 1)
    assert turned.view(torch.empty(9, 40, device="meta").t(), 1) == (1, 40, 0, 1, 40)
    assert turned.view(torch.empty(3, 1, 5, 1, 7, device="meta"), 2) == (3, 7, 35, 1, 7)
    assert turned.view(torch.empty(4, 5, 6, device="meta").permute(1, 0, 2), 2) is None
    assert turned.view(torch.empty(2**20, 2**11 + 1, device="meta").t(), 1) is None
    assert turned.view(torch.empty(2**20, 2**11 - 1, device="meta").t(), 1) is not None
    # an x whose zero strides span little, into an output whose offsets would pass 32 bits
    assert turned.view(torch.empty(1, 4, 1, device="meta").expand(1, 4, 2**30), 1) == (1, 2**30, 0, 0, 1)
    assert not turned.takes(1, torch.empty(1, 4, 1, device="meta").expand(1, 4, 2**30))
    assert turned.takes(1, torch.empty(1, 4, 1, device="meta").expand(1, 4, 2**29))
