"""Hypothesis-generated shapes, dims, dtypes and values (special values included) against torch; on a GPU, seeded
random calls at full size through every kernel."""

import inspect
import math

import pytest
import torch
from conftest import BACKWARD_TOLERANCE, ON_GPU, TOLERANCE, backward_tolerance, run_with_timeout, torch_backward
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers

SPECIAL = [0.0, 1.0, -1.0, 88.7, -88.7, 1e4, -1e4, 3e38, -3e38, math.inf, -math.inf, math.nan]
DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])


@st.composite
def tensors(draw, special=True, longest=9, most_elements=None):
    shape = draw(st.lists(st.integers(0, longest), min_size=0, max_size=3).map(tuple)
                 .filter(lambda shape: most_elements is None or math.prod(shape) <= most_elements))
    dim = draw(st.integers(-max(len(shape), 1), max(len(shape), 1) - 1))
    dtype = draw(DTYPES)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))  # values hypothesis can replay
    x = torch.randn(shape, dtype=torch.float64, generator=generator) * draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    if special and x.numel():
        n_special = draw(st.integers(0, min(3, x.numel())))
        for _ in range(n_special):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()) and x.ndim >= 2:
        x = x.permute(draw(st.permutations(range(x.ndim))))  # non-contiguous, or other strides at dims of size 0 or 1
    return x.to(dtype=dtype, device=helpers.DEVICE), dim


@settings(max_examples=80, deadline=None)
@given(tensors())
def test_forward_matches_torch(case):
    x, dim = case
    torch.testing.assert_close(helpers.softmax_forward(x, dim), torch.softmax(x, dim), equal_nan=True,
                               check_stride=True, **TOLERANCE[x.dtype])  # torch's layout: its strides too


@settings(max_examples=60, deadline=None)
@given(tensors(special=False), st.booleans(), st.integers(0, 2**32 - 1))
def test_backward_matches_torch(case, broadcast_grad, seed):
    x, dim = case
    y = torch.softmax(x, dim)
    generator = torch.Generator().manual_seed(seed)
    dy = torch.randn(x.shape, dtype=torch.float64, generator=generator).to(dtype=x.dtype, device=x.device)
    if broadcast_grad and x.ndim and x.shape[dim]:
        dy = dy.select(dim, 0).unsqueeze(dim).expand_as(x)  # a zero stride along the softmax dim
    dx = helpers.softmax_backward(y, dy, dim)
    expected = torch_backward(y, dy, dim)
    torch.testing.assert_close(dx.double(), expected, **backward_tolerance(y, dy, dim))
    assert dx.stride() == expected.stride()  # torch's layout


@pytest.mark.skipif(ON_GPU, reason="on a GPU every kernel is met at full size (GPU_RANDOM_CALLS, below)")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors(longest=100, most_elements=800), st.integers(0, 2**32 - 1))
def test_split_rows_match_torch(looped, case, seed):
    """The cases above with dims up to 100 long, cut into pieces of 16 (``looped``): on CPU the shapes above take only
    whole-row tiles and held columns, these also the split rows, whose merge meets the special values across
    pieces."""
    x, dim = case
    y = helpers.softmax_forward(x, dim)
    torch.testing.assert_close(y, torch.softmax(x, dim), equal_nan=True, check_stride=True, **TOLERANCE[x.dtype])
    dy = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(x.dtype)
    dx = helpers.softmax_backward(y, dy.to(x.device), dim)
    expected = torch_backward(y, dy.to(x.device), dim)
    torch.testing.assert_close(dx.double(), expected, equal_nan=True, **backward_tolerance(y, dy, dim))


# A GPU subprocess: seeded random calls at sizes where every kernel runs (tiles, splits, two passes, column kernels
# held and split, turned tiles), in random layouts, dtypes and dims with special values, forward and backward against
# torch in fp64. Each layout is called twice: its first call, then its kept launch (a split's exchange on the other
# parity).
# A few shapes first make sure each kernel family is met; the kernels that ran are asserted at the end.
# The tolerances are conftest's (backward_tolerance's source is part of the script), but for an fp32 dx of rows up to
# 2**22 + 3, whose sum of y * dy rounds at every block: twice BACKWARD_TOLERANCE's atol.
RANDOM_CALLS_BACKWARD_TOLERANCE = {**BACKWARD_TOLERANCE, torch.float32: dict(atol=2e-6, rtol=1e-5)}
GPU_RANDOM_CALLS = f"""
import math, random
import torch
import helpers
from helpers import recipes

TOLERANCE = {TOLERANCE!r}
BACKWARD_TOLERANCE = {RANDOM_CALLS_BACKWARD_TOLERANCE!r}
{inspect.getsource(backward_tolerance)}
""" + r"""
random.seed(0)
torch.manual_seed(0)
SIZES = [1, 2, 3, 7, 16, 17, 31, 64, 100, 257, 1000, 1023, 1025, 2048, 4097, 5000, 20000, 40000, 65537, 151936]
SPECIAL = [-math.inf, math.inf, math.nan, 1e4]
FIRST = [((3, 1000), -1, "contiguous"), ((4, 151936), -1, "contiguous"), ((2, 2**22 + 3), -1, "contiguous"),
         ((8, 21, 64, 64), 1, "contiguous"), ((16384, 4096), 0, "contiguous"), ((8, 21, 64, 64), 1, "channels last")]
kernels_run = set()


def random_case():
    shape = [random.choice(SIZES) for _ in range(random.choice([1, 2, 2, 3, 3, 4]))]
    while math.prod(shape) > 2**25:
        shape[random.randrange(len(shape))] = random.choice(SIZES[:8])
    return tuple(shape), random.randrange(-len(shape), len(shape))


def check(shape, dim, dtype, layout, special):
    x64 = torch.randn(shape, dtype=torch.float64, device="cuda") * random.choice([1, 4, 30])
    if layout == "transposed" and len(shape) >= 2:
        i, j = random.sample(range(len(shape)), 2)
        x64 = x64.transpose(i, j).contiguous().transpose(i, j)
    x = x64.to(dtype)
    for value in special:
        x[tuple(random.randrange(n) for n in shape)] = value
    if layout == "sliced" and shape[-1] > 2:
        x = x[..., 1:]
    elif layout == "expanded" and len(shape) >= 2:
        x = x.narrow(0, 0, 1).expand(*x.shape)
    elif layout == "channels last" and len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "off 16 bytes":
        x = torch.cat([x.reshape(-1)[:1], x.reshape(-1)])[1:].view(x.shape)
    y_finite = torch.softmax(x.double().nan_to_num(0.0, 0.0, 0.0), dim).to(dtype)
    dy = torch.randn(x.shape, dtype=torch.float64, device="cuda").to(dtype)
    if layout == "channels last" and x.ndim == 4:  # y and dy too, as a channels-last model's autograd may pass them
        y_finite, dy = (t.contiguous(memory_format=torch.channels_last) for t in (y_finite, dy))
    case = f"{tuple(x.shape)} strides {x.stride()} {dtype} dim {dim}, special {special}"
    for _ in range(2):
        y = helpers.softmax(x, dim)
        torch.testing.assert_close(y.double(), torch.softmax(x.double(), dim), equal_nan=True, **TOLERANCE[dtype],
                                   msg=lambda m: f"forward {case}: {m}")
        assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous(), case
        dx = helpers.softmax_backward(y_finite, dy, dim)
        expected = torch._softmax_backward_data(dy.double(), y_finite.double(), dim, torch.float64)
        torch.testing.assert_close(dx.double(), expected, **backward_tolerance(y_finite, dy, dim),
                                   msg=lambda m: f"backward {case}: {m}")
    kernels_run.update(step.kernel.fn.__name__ for recipe in recipes._recipes.values() for step in recipe.steps)


for shape, dim, layout in FIRST:
    for dtype in (torch.float32, torch.bfloat16):
        check(shape, dim, dtype, layout, [])
for _ in range(150):
    shape, dim = random_case()
    dtype = random.choice([torch.float16, torch.bfloat16, torch.float32, torch.float32, torch.float64])
    layout = random.choice(["contiguous"] * 4 + ["transposed", "sliced", "expanded", "off 16 bytes", "channels last"])
    special = random.sample(SPECIAL, 2) if random.random() < 0.3 else []
    check(shape, dim, dtype, layout, special)
for family in ("tile", "split", "two_pass", "column", "column_split", "turned"):
    for phase in ("softmax", "softmax_backward"):
        assert f"{phase}_{family}_kernel" in kernels_run, (phase, family, sorted(kernels_run))
print("ok", len(FIRST) * 2 + 150, "layouts,", sorted(kernels_run), flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the sizes where every kernel runs, and splits that wait")
def test_random_calls_at_full_size_on_the_gpu():
    assert run_with_timeout(GPU_RANDOM_CALLS, timeout=600).startswith("ok")
