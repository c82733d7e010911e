"""Rows of any length never hang: a split (programs that wait for each other) is launched only where a row's programs
fit on the GPU together; longer rows take the two-pass kernels, where no program waits.

On CPU the rule is checked against the residency of small GPUs, and the two-pass kernels against torch; on a GPU,
rows of 2**22 + 3, 2**24 and 2**27 elements, and many calls of splits, run in subprocesses whose timeout fails the
test instead of hanging it.
"""

import dataclasses

import pytest
import torch
from conftest import ON_GPU, TOLERANCE, backward_tolerance, randn, run_with_timeout, torch_backward

import helpers
from helpers import bench, fused, plans, recipes, residency, split_rows, two_pass

# Programs a small GPU holds at once: 8 SMs with one program each, a T4 (40 SMs) with 1, 4 and 16 per SM.
SMALL_GPUS = {"8 SMs x 1": 8, "T4 x 1": 40, "T4 x 4": 160, "T4 x 16": 640}


@pytest.mark.parametrize("resident", SMALL_GPUS.values(), ids=SMALL_GPUS.keys())
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("element_size", [2, 4])
def test_split_waits_only_for_resident_programs(resident, phase, element_size):
    """Every row length up to 2**28, as planned: a split's grid is whole groups of a row's programs, all of them
    resident together with room to spare, or nothing (the two-pass kernels take the row)."""
    for n_cols in [2**k + extra for k in range(14, 29) for extra in (-1, 0, 3)]:
        plan = plans.plan_for(n_cols, phase, element_size)
        for n_rows in (1, 2, 7, 1000):
            grid = residency.split_grid(plan.segments, n_rows, resident)
            assert grid % plan.segments == 0 and grid <= resident, (n_cols, n_rows, grid)
            if grid:
                assert plan.segments * residency.RESIDENCY_MARGIN <= resident
                assert grid // plan.segments <= n_rows


def test_split_fits_what_the_gpu_holds_whatever_the_registers():
    """A group that fits the GPU only once over still launches where the GPU holds that many programs whatever
    registers a build of them takes (``assured``): 128 pieces on a GPU of 132 programs of 8 warps, one an SM."""
    assert residency.split_grid(128, 5, 132) == 0
    assert residency.split_grid(128, 5, 132, assured=132) == 128
    assert residency.split_grid(133, 5, 140, assured=132) == 0
    assert residency.split_grid(64, 5, 132, assured=132) == 128  # two groups, as the margin alone allows


@pytest.fixture
def small_gpu(monkeypatch, looped, request):
    """A GPU (or the interpreter) that holds ``request.param`` programs, with splits of 16-element pieces and two-pass
    blocks of 16 fp32 elements, at most 4 chunks a row: launches are recorded as (kernel name, grid, SEGMENTS)."""
    resources = residency.compiled_resources
    monkeypatch.setattr(residency, "compiled_resources", lambda *args: dataclasses.replace(
        resources(*args), resident=request.param, assured=0))
    monkeypatch.setattr(two_pass, "TWO_PASS_BLOCK_BYTES", 64)
    monkeypatch.setattr(two_pass, "MAX_CHUNKS", 4)
    launches = []

    def record(step):
        launches.append((step.kernel.fn.__name__, step.grid, step.constexprs.get("SEGMENTS")))

    def recording_run(step, tensors):  # a launch through the JIT (the interpreter)
        record(step)
        return run(step, tensors)

    def recording_launch(recipe, *args):  # launches of compiled kernels (a GPU), or through Step.run
        if recipes.LAUNCH_DIRECTLY:
            for step in recipe.steps:
                record(step)
        return launch(recipe, *args)

    run, launch = recipes.Step.run, recipes.Recipe.launch
    monkeypatch.setattr(recipes.Step, "run", recording_run)
    monkeypatch.setattr(recipes.Recipe, "launch", recording_launch)
    return request.param, launches


def check(x, dim=-1):
    """Forward and backward against torch in float64."""
    y = helpers.softmax_forward(x, dim)
    # against fp64, at TOLERANCE (which allows for two roundings, torch's and ours, where this has one)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), dim), equal_nan=True, **TOLERANCE[x.dtype])
    dy = randn(*x.shape, dtype=x.dtype, scale=1.0)
    dx = helpers.softmax_backward(y, dy, dim)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, dim), equal_nan=True,
                               **backward_tolerance(y, dy, dim))


@pytest.mark.parametrize("small_gpu", [8, 40], indirect=True, ids=["8 programs", "40 programs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n_cols", [33, 100, 257, 700])
def test_long_rows_on_a_small_gpu(small_gpu, dtype, n_cols):
    resident, launches = small_gpu
    x = randn(5, n_cols, dtype=dtype)
    check(x)
    for name, grid, segments in launches:
        if "split" in name:
            assert grid <= resident and grid % segments == 0 and segments * residency.RESIDENCY_MARGIN <= resident
    for phase in ("forward", "backward"):
        names = {name for name, *_ in launches if ("backward" in name) == (phase == "backward")}
        segments = plans.plan_for(n_cols, phase, x.element_size()).segments
        # fp64 partials never fit a packed word: fp64 rows past a tile always take two passes
        two_pass = dtype == torch.float64 or segments * residency.RESIDENCY_MARGIN > resident
        assert len(names) == 1 and ("two_pass" in names.pop()) == two_pass, (phase, names, segments)


@pytest.mark.parametrize("small_gpu", [8], indirect=True)
def test_two_pass_special_values_and_strides(small_gpu):
    """A chunk of all -inf, an all -inf row, +inf, NaN; transposed rows and zero-stride gradients."""
    inf = float("inf")
    x = randn(5, 150)
    x[0, :70] = -inf  # the first chunks all -inf, finite values later
    x[1, :] = -inf
    x[2, 140] = inf
    x[3, 30] = float("nan")
    check(x)
    check(randn(150, 12)[:, ::2].t())  # rows 12 elements apart (a plain transpose takes turned tiles)
    check(randn(130, 18)[:, ::2], 0)  # rows 18 elements apart (a contiguous tensor's other dim takes the columns)
    y, dy = (t[:, ::2] for t in (torch.softmax(randn(130, 18), 0), randn(130, 18, scale=1.0)))  # the backward's too
    torch.testing.assert_close(helpers.softmax_backward(y, dy, 0).double(), torch_backward(y, dy, 0), atol=1e-6,
                               rtol=1e-6)
    y = helpers.softmax_forward(randn(3, 150))
    dx = helpers.softmax_backward(y, torch.ones((), device=y.device).expand_as(y))
    torch.testing.assert_close(dx, torch.zeros_like(dx), atol=1e-6, rtol=0)  # sum(y) = 1: dx = y * (1 - 1)
    # every row took two passes; the strided forward's output is contiguous, as torch's, so its backward (in check)
    # took the column kernel
    assert {name for name, *_ in small_gpu[1]} == {"softmax_two_pass_kernel", "softmax_backward_two_pass_kernel",
                                                   "softmax_backward_column_kernel"}


def test_rows_that_span_2_to_the_31_elements(monkeypatch):
    """Three columns of a (1025, 2**21 + 1) fp16 tensor (4 GB, of which this touches 1025 x 3 elements) over dim 0:
    each row's offsets pass 32 bits, which tiles and splits would wrap (reading outside the tensor) and the two passes
    compute in 64. The backward's dy is such a view too."""
    monkeypatch.setattr(recipes, "_recipes", {})
    storage = torch.empty(1025, 2**21 + 1, dtype=torch.float16, device=helpers.DEVICE)
    x, dy = storage[:, :3], storage[:, 3:6]
    x.copy_(randn(1025, 3, dtype=torch.float16))
    dy.copy_(randn(1025, 3, dtype=torch.float16, scale=1.0))
    assert fused.wide_columns(1025, x.t())
    y = helpers.softmax_forward(x, 0)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), 0), **TOLERANCE[torch.float16])
    dx = helpers.softmax_backward(y, dy, 0)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, 0), **backward_tolerance(y, dy, 0))
    kernels = {step.kernel.fn.__name__ for recipe in recipes._recipes.values() for step in recipe.steps}
    assert kernels == {"softmax_two_pass_kernel", "softmax_backward_two_pass_kernel"}


def test_two_pass_chunks_cover_the_row():
    for element_size in (2, 4, 8):
        for n_cols in (1, 4095, 4096, 4097, 2**22 + 3, 2**24, 2**27, 2**31 + 5):
            block_n, chunks, chunk_blocks = two_pass.two_pass_chunks(n_cols, element_size)
            assert chunks <= two_pass.MAX_CHUNKS
            assert chunks * chunk_blocks * block_n >= n_cols > (chunks - 1) * chunk_blocks * block_n


# A GPU subprocess: rows far past what a split holds, against torch in float64 (normwise relative error), and their
# sums. A hang would stop the subprocess at its timeout and fail the test.
GPU_LONG_ROWS = r"""
import sys
import torch
import helpers

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def error(ours, reference):
    assert ours.isfinite().all()
    return ((ours.double() - reference).norm() / reference.norm()).item()


for case in sys.argv[1:]:
    dtype, rows, n_cols = getattr(torch, case.split("x")[0]), *map(int, case.split("x")[1:])
    x = (torch.randn(rows, n_cols, device="cuda") * 4).to(dtype)
    y = helpers.softmax_forward(x)
    reference = torch.softmax(x.double(), -1)
    assert error(y, reference) < TOLERANCE[dtype], (case, error(y, reference))
    assert (y.double().sum(-1) - 1).abs().max() < 64 * TOLERANCE[dtype], case
    dy = torch.randn_like(y)
    dx = helpers.softmax_backward(y, dy)
    expected = torch._softmax_backward_data(dy.double(), y.double(), -1, torch.float64)
    assert error(dx, expected) < TOLERANCE[dtype], (case, error(dx, expected))
    print(case, "ok", flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the split kernels wait for each other only there")
@pytest.mark.parametrize("cases", [
    ["float32x1x4194307", "bfloat16x2x4194304", "float16x1x4194307", "bfloat16x1x4194307"],
    ["float32x1x16777216", "bfloat16x1x16777216", "float16x1x16777216", "float32x3x16777216"],
    ["float32x1x134217728", "bfloat16x1x134217728"],
], ids=["2**22", "2**24", "2**27"])
def test_long_rows_on_the_gpu(cases):
    stdout = run_with_timeout(GPU_LONG_ROWS, *cases)
    assert stdout.count(" ok") == len(cases), stdout


# A GPU subprocess: many calls of splits whose programs have more threads than a row has partial slots, so that a
# slot is loaded by several threads, each against torch. A partial read EMPTY (a NaN) or a hang fails the test.
GPU_REPEATED_SPLITS = r"""
import sys
import torch
import triton
import helpers

for case in sys.argv[1:]:
    dtype, rows, n_cols = getattr(torch, case.split("x")[0]), *map(int, case.split("x")[1:])
    plans = [helpers.plans.plan_for(n_cols, phase, dtype.itemsize) for phase in ("forward", "backward")]
    assert any(32 < triton.next_power_of_2(plan.segments) < 32 * plan.num_warps for plan in plans), (case, plans)
    x = torch.randn(rows, n_cols, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    y_expected = torch.softmax(x.double(), -1)
    dx_expected = torch._softmax_backward_data(dy.double(), y_expected, -1, torch.float64)
    y = helpers.softmax_forward(x)
    for call in range(40):
        y = helpers.softmax_forward(x)
        dx = helpers.softmax_backward(y, dy)
        torch.testing.assert_close(y.double(), y_expected, atol=1e-6, rtol=2e-2, msg=lambda m: f"{case} {call}: {m}")
        torch.testing.assert_close(dx.double(), dx_expected, atol=1e-6, rtol=2e-2, msg=lambda m: f"{case} {call}: {m}")
    print(case, "ok", flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the split kernels wait for each other only there")
def test_every_call_of_a_split_with_copies_of_its_slots():
    """``read_partials`` under Triton 3.9 once merged a copy of a slot still EMPTY in most calls of these shapes."""
    cases = ["float32x64x151936", "float32x64x262144", "bfloat16x16x524288"]
    stdout = run_with_timeout(GPU_REPEATED_SPLITS, *cases)
    assert stdout.count(" ok") == len(cases), stdout


def test_no_split_is_compiled_for_rows_no_gpu_could_hold(monkeypatch, looped):
    """Rows cut into more pieces than the GPU has threads for go to the two-pass kernels without compiling the split
    first: a row of 2**27 fp32 elements would be a split of 65537 pieces, compiled only to be refused."""
    monkeypatch.setattr(residency, "most_resident", lambda num_warps, device: 8)  # a GPU of 8 programs at most

    def compile_nothing(*args):
        raise AssertionError(f"compiled a split that cannot fit: {args[2]}")

    monkeypatch.setattr(residency, "compiled_resources", compile_nothing)
    check(randn(3, 200))


# A GPU subprocess: one split layout called again and again on new data, on two streams and inside a CUDA graph. The
# kernels leave their exchange buffer ready for the next call (tags of the call's parity), which a recipe keeps per
# stream: a tag read wrongly would wait forever, or merge a previous call's partials.
GPU_REPEATED_CALLS = r"""
import torch
import helpers
from helpers import recipes


def check(x, dy):
    y = helpers.softmax_forward(x)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=1e-2)
    dx = helpers.softmax_backward(y, dy)
    expected = torch._softmax_backward_data(dy.float(), y.float(), -1, torch.float32)
    torch.testing.assert_close(dx.float(), expected, atol=1e-6, rtol=1e-2)


for dtype in (torch.float32, torch.bfloat16):
    for shape in ((1, 50257), (8, 131072), (64, 32000)):
        for _ in range(3):
            check(torch.randn(shape, device="cuda").to(dtype) * 4, torch.randn(shape, device="cuda").to(dtype))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(3):
                check(torch.randn(shape, device="cuda").to(dtype) * 4, torch.randn(shape, device="cuda").to(dtype))
        torch.cuda.synchronize()
        x = torch.randn(shape, device="cuda").to(dtype)
        helpers.softmax_forward(x)  # planned and compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = helpers.softmax_forward(x)
        for _ in range(3):
            x.copy_(torch.randn(shape, device="cuda").to(dtype) * 4)
            graph.replay()
            torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=1e-2)
            check(x, torch.randn(shape, device="cuda").to(dtype))  # plain calls between replays
        print(dtype, shape, "ok", flush=True)
splits = [r for r in recipes._recipes.values() if "split" in r.steps[0].kernel.fn.__name__]
assert splits and all(len(r.kept) == 2 for r in splits), [len(r.kept) for r in splits]  # two streams each
print("kept", len(splits), flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the exchange buffer is kept between plain calls only there")
def test_repeated_calls_reuse_the_exchange_buffer():
    stdout = run_with_timeout(GPU_REPEATED_CALLS)
    assert stdout.count(" ok") == 6 and "kept" in stdout, stdout


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_repeated_splits_match_torch(monkeypatch, phase):
    """Calls of one split layout one after another: each merges its own partials, never a previous call's (on CPU,
    two launches per call, the second reading the first's)."""
    monkeypatch.setattr(recipes, "_recipes", {})
    shape = (3, 40000) if helpers.INTERPRET else (8, 131072)
    for _ in range(3):
        x = randn(*shape, dtype=torch.bfloat16)
        y = helpers.softmax_forward(x)
        if phase == "forward":
            torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=2e-2)
            continue
        dy = randn(*shape, dtype=torch.bfloat16, scale=1.0)
        torch.testing.assert_close(helpers.softmax_backward(y, dy).double(), torch_backward(y, dy, -1),
                                   atol=1e-6, rtol=2e-2)
    names = {step.kernel.fn.__name__ for recipe in recipes._recipes.values() for step in recipe.steps}
    assert any("split" in name for name in names), names


@pytest.mark.parametrize("resident, pieces", [(4096, plans.FEW_ROWS_PIECE), (60, None)], ids=["fits", "does not fit"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_few_rows_take_small_pieces(monkeypatch, resident, pieces, phase):
    """One bf16 row of 40000 elements has few programs with the default plan: it takes pieces of FEW_ROWS_PIECE, unless
    those do not fit the GPU together (on a GPU holding 60 programs, not 4096), when it keeps the default plan's. The
    fp32 backward always keeps the default plan."""
    resources = residency.compiled_resources
    monkeypatch.setattr(residency, "compiled_resources",
                        lambda *args: dataclasses.replace(resources(*args), resident=resident, assured=0))
    monkeypatch.setattr(residency, "most_resident", lambda *args: resident)
    monkeypatch.setattr(recipes, "_recipes", {})
    x = randn(1, 40000, dtype=torch.bfloat16)
    y = helpers.softmax_forward(x)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=2e-2)
    if phase == "backward":
        dy = randn(1, 40000, dtype=torch.bfloat16, scale=1.0)
        torch.testing.assert_close(helpers.softmax_backward(y, dy).double(), torch_backward(y, dy, -1),
                                   atol=1e-6, rtol=2e-2)
    kernel = split_rows.softmax_split_kernel if phase == "forward" else split_rows.softmax_backward_split_kernel
    (step,) = [step for recipe in recipes._recipes.values() for step in recipe.steps[:1] if step.kernel is kernel]
    pieces = pieces or plans.plan_for(40000, phase, 2).block_n  # None: the default plan's
    assert step.constexprs["BLOCK_N"] == pieces and step.constexprs["SEGMENTS"] == -(-40000 // pieces)
    assert plans.few_rows_plan(1, 40000, "backward", 4) is None


# A GPU subprocess: 16-bit forward splits of several lengths against torch, then the plain calls' launches: every one
# a wide piece (4096, or 8192 where those come out full) under the register cap, and every split kernel compiled
# within it, without spills.
GPU_CAPPED_PIECES = r"""
import torch
import helpers
from helpers import plans, recipes, residency, split_rows

for dtype in (torch.bfloat16, torch.float16):
    for n_cols in (20000, 50257, 65536):
        x = torch.randn(64, n_cols, device="cuda", dtype=dtype) * 4
        y = helpers.softmax_forward(x)
        torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=2e-2)
steps = [step for recipe in recipes._recipes.values() for step in recipe.steps
         if step.kernel is split_rows.softmax_split_kernel]
assert len(steps) == 6 and all(step.max_registers == residency.REGISTER_BUDGET for step in steps), steps
assert {step.constexprs["BLOCK_N"] for step in steps} == {plans.WIDE_SEGMENT_ELEMENTS, plans.WIDEST_SEGMENT_ELEMENTS}
compiled = [r for r in residency.spill_report() if r["kernel"] == "softmax_split_kernel"]
assert compiled and all(r["num_warps"] in (2, 4) and r["n_regs"] <= residency.REGISTER_BUDGET and r["n_spills"] == 0
                        for r in compiled), compiled  # 2 or 4 warps: pieces of 4096 or 8192 (narrow ones take 1)
print(len(compiled), "ok")
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the register cap is a compiler option")
def test_16_bit_forward_pieces_run_under_the_register_cap():
    """The 16-bit forward's wide pieces take 136-155 registers uncapped under Triton 3.6, so fewer programs fit;
    ``plan_for`` caps them at REGISTER_BUDGET, which the launches and the residency count must both carry."""
    assert run_with_timeout(GPU_CAPPED_PIECES).endswith(" ok\n")


def test_a_growing_row_of_few_rows_reuses_its_builds():
    """The even share is compiled into the split kernels. A call of few pieces rounds it up to whole COARSE_SHARE
    elements (``plans.piece_length``), so a loop whose 8 rows grow by one element a call needs a few builds in 600
    calls, not one every 4 x SEGMENTS lengths; bandwidth-bound calls, the benchmark grid's among them, keep the exact
    share. Every share covers the row and leaves no piece empty."""

    def shapes_built(n_rows, lengths, element_size=4):
        built = set()
        for n in lengths:
            plan = plans.plan_for(n, "forward", element_size)
            piece = plans.piece_length(n, plan, plan.align, element_size, n_rows)
            assert plan.segments * piece >= n + plan.align - 1 > (plan.segments - 1) * piece
            built.add((plan.segments, plan.align, piece))
        return built

    lengths = range(41000, 41600)
    assert len(shapes_built(8, lengths)) <= 4 and len(shapes_built(2670, lengths)) >= 15
    for n in bench.GRID_N:
        for phase in ("forward", "backward"):
            for element_size in (2, 4):
                plan = plans.plan_for(n, phase, element_size)
                exact = plans.piece_length(n, plan, plan.align, element_size)
                assert plans.piece_length(n, plan, plan.align, element_size, 2**27 // n) == exact, (n, phase)
