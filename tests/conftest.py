"""Shared test setup: sizes that fit the device, and outputs poisoned with NaN so unwritten elements show."""

import subprocess
import sys
import zlib
from importlib.metadata import requires, version

import pytest
import torch

import helpers
from helpers import ops

ON_GPU = not helpers.INTERPRET
# torch's CUDA builds pin the Triton they are built for; torch.compile reads Triton kernels (wrap_triton) with that
# version's internals. Under another (torch 2.11 with Triton 3.9) it cannot parse a kernel called with an integer that
# is a multiple of 16 (it passes the integer as a constant, which Triton 3.9 makes a constexpr) and traces it as if it
# wrote every input: the tests marked with this break in torch's partitioner. pip never installs such a pair.
PINNED_TRITON = next((r.split("==")[1].split(";")[0].strip() for r in requires("torch") or []
                      if r.startswith("triton==")), None)
traced_by_torch = pytest.mark.skipif(
    ON_GPU and PINNED_TRITON not in (None, version("triton")),
    reason=f"torch {torch.__version__} is built for Triton {PINNED_TRITON}, not {version('triton')}: torch.compile "
           "cannot read Triton kernels across versions")
ODD_SHAPE = helpers.ODD_SHAPE
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Forward outputs are compared with torch.softmax's own result in the same dtype: apart by a rounding of the output
# (rtol: one unit in the last place of fp16, two of bf16), with an atol only for outputs near 0. Most outputs of a
# 16-bit row are below 1e-3 (1 / N), so an atol of that order would pass any value of theirs.
TOLERANCE = {
    torch.float16: dict(atol=1e-6, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-6, rtol=1.6e-2),
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}
# dx where y * dy is of order 1 (backward_tolerance scales the atol to the data): a few roundings of y's dtype in
# absolute terms, since dx = y * (dy - <y, dy>) cancels where dy is near <y, dy>, and two implementations' y (each
# rounded) move <y, dy> by a rounding of y * dy. From one y, <y, dy> errs by the sum's roundings only: fp32's atol.
BACKWARD_TOLERANCE = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}


def backward_tolerance(y, dy, dim, dtype=None, tolerances=BACKWARD_TOLERANCE, separate_y=False):
    """The tolerance of dx = y * (dy - <y, dy>) against torch's, for the rounding of ``dtype`` (y's unless given): the
    rtol of ``tolerances`` (BACKWARD_TOLERANCE unless given) for dx's own rounding, and an atol for the error of
    <y, dy>, which dx_i takes times y_i. Against torch's dx from the same y, that error is the kernels' sum, in fp32
    (fp64 if y or dy is); with ``separate_y`` (gradients of x, each implementation's from a y it rounded to ``dtype``)
    it is a few roundings of ``dtype``. The atol is that dtype's in ``tolerances`` times the data's scale, the largest
    max_i |y_i| * sum_j |y_j dy_j| of any row: a long row's y is far below 1 and its atol with it, down to the spacing
    of the dtype's subnormals (where a long fp16 row's dx lies). Special values are left to ``equal_nan``."""
    dtype = dtype or y.dtype
    tolerance = tolerances[dtype]
    if y.numel() == 0:
        return tolerance
    summed_in = dtype if separate_y else torch.float64 if torch.float64 in (y.dtype, dy.dtype) else torch.float32
    y, dy = (t.double().nan_to_num(0.0, 0.0, 0.0) for t in (y, dy))
    scale = (y.abs().amax(dim) * (y * dy).abs().sum(dim)).max().item()
    subnormal_spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return dict(atol=max(tolerances[summed_in]["atol"] * scale, subnormal_spacing), rtol=tolerance["rtol"])


@pytest.fixture(autouse=True)
def seeded(request):
    """torch's generator seeded from the test's id: each test draws the same inputs on every run, so a failure
    replays, and no test's inputs depend on which tests ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output the ops allocate starts as NaN: an element a kernel forgets to write cannot pass a comparison."""

    def poisoned(allocate):  # the ops' own allocation (its type and layout), filled with NaN
        return lambda *args, **kwargs: allocate(*args, **kwargs).fill_(float("nan"))

    for name in ("_new_rows", "_new_output", "_new_contiguous_output"):
        monkeypatch.setattr(ops, name, poisoned(getattr(ops, name)))
    monkeypatch.setattr(ops, "_plain_calls", {})  # each test's first call of a layout is checked and planned


@pytest.fixture
def looped(monkeypatch):
    """Send every row of more than 16 elements down the long-row paths (looped teaching kernels, split fused
    kernels), in pieces of 16 (32 or 64 where ``plan_for`` takes wider pieces), so odd row lengths span several
    pieces."""
    monkeypatch.setattr(helpers.kernels, "ROW_BLOCK_LIMIT", 16)
    monkeypatch.setattr(helpers.kernels, "LOOP_BLOCK_SIZE", 16)
    monkeypatch.setattr(helpers.plans, "ALWAYS_TILE_ROW", 8)
    monkeypatch.setattr(helpers.plans, "MAX_TILE_ROW", 16)
    monkeypatch.setattr(helpers.plans, "SEGMENT_ELEMENTS", 16)
    monkeypatch.setattr(helpers.plans, "WIDE_SEGMENT_ELEMENTS", 32)
    monkeypatch.setattr(helpers.plans, "WIDEST_SEGMENT_ELEMENTS", 64)
    monkeypatch.setattr(helpers.recipes, "_recipes", {})  # launches planned with the sizes above stay in this test


def randn(*shape, dtype=torch.float32, scale=3.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=helpers.DEVICE)


def torch_backward(y, dy, dim):
    """torch's own softmax backward in float64, from the same y."""
    return torch._softmax_backward_data(dy.double(), y.double(), dim, torch.float64)


# helpers.softmax (the registered operator, notebook 08) and notebook 04's torch.autograd.Function around the same ops
AUTOGRAD_SOFTMAXES = [
    pytest.param(helpers.softmax, id="operator"),
    pytest.param(lambda x, dim=-1, dtype=None: ops.Softmax.apply(x, dim, dtype), id="autograd.Function"),
]


# fp32 layouts that take each path of the kernels (fp64 takes turned tiles or rows where fp32 takes the columns): shape,
# dim, channels-last.
LAYOUT_PATHS = {"rows": ((8, 16), -1, False), "held-columns": ((3, 4, 37), 1, False),
                "turned": ((2, 8, 3, 3), 1, True), "split-columns": ((4, 1500, 17), 1, False), "0-d": ((), 0, False)}


def layout_inputs(path: str, count: int) -> list:
    """``count`` fp32 tensors of ``path``'s layout (``LAYOUT_PATHS``), then its dim."""
    shape, dim, channels_last = LAYOUT_PATHS[path]
    tensors = [randn(*shape, scale=1.0) for _ in range(count)]
    return [t.to(memory_format=torch.channels_last) if channels_last else t for t in tensors] + [dim]


def assert_path(path: str, dim: int, *tensors: torch.Tensor) -> None:
    """That a call over ``dim`` of ``tensors`` takes ``path``'s kernels (``LAYOUT_PATHS``)."""
    assert helpers.columns.takes_columns(dim, *tensors) == (path in ("held-columns", "split-columns"))
    assert helpers.turned.takes(dim, *tensors) == (path == "turned")
    t = tensors[0]
    assert (t.ndim > 0 and t.shape[dim] > helpers.columns.MAX_HELD) == (path == "split-columns")


def split_wherever_it_fits(monkeypatch) -> None:
    """The column split on shapes too small for it to pay (``columns.SplitLaunch.pays``): its pieces and merges."""
    monkeypatch.setattr(helpers.columns, "FULL_FILL", 0)
    monkeypatch.setattr(helpers.columns, "FORWARD_MIN_ROUNDS", 0)


def launched() -> set[str]:
    """The kernels of the launches planned in this test (a test that asks starts with ``recipes._recipes`` empty)."""
    return {step.kernel.fn.__name__ for recipe in helpers.recipes._recipes.values() for step in recipe.steps}


def run_with_timeout(script: str, *args: str, timeout: int = 300) -> str:
    """``script`` run in a fresh Python with ``args``; its stdout. Programs that wait for each other could hang: the
    timeout fails the test instead of stopping the run, and a non-zero exit fails it with the output's end."""
    try:
        out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung: no answer in {expired.timeout} s; finished: {expired.stdout!r}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout
