"""helpers.softmax_forward against torch.softmax: shapes, dims, strides, dtypes, special values, empty tensors."""

import concurrent.futures
import gc

import pytest
import torch
from conftest import (
    BACKWARD_TOLERANCE,
    DTYPES,
    ODD_SHAPE,
    TOLERANCE,
    backward_tolerance,
    launched,
    randn,
    torch_backward,
)

import helpers
from helpers import ops


def check_forward(x, dim=-1):
    x_before = x.clone()
    y = helpers.softmax_forward(x, dim)
    expected = torch.softmax(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    torch.testing.assert_close(y, expected, equal_nan=True, **TOLERANCE[x.dtype])
    assert y.is_contiguous() == expected.is_contiguous()  # torch's layout
    assert y._base is None  # a tensor of its own, as torch's, not a view: in-place ops such as detach_ work on it
    torch.testing.assert_close(x, x_before, rtol=0, atol=0, equal_nan=True)  # the input is never written
    return y


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_shape(dtype):
    y = check_forward(randn(*ODD_SHAPE, dtype=dtype))
    torch.testing.assert_close(y.double().sum(-1), torch.ones(ODD_SHAPE[0], dtype=torch.float64, device=y.device),
                               atol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6, rtol=0)


@pytest.mark.parametrize("n_cols", [1, 2, 3, 16, 17, 1000])
def test_row_lengths(n_cols):
    check_forward(randn(5, n_cols))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [1, 15, 16, 17, 100, 257])
def test_rows_split_into_small_pieces(looped, dtype, n_cols):
    """Under ``looped`` a row past 16 elements is split into pieces of 16-64, so odd lengths span several."""
    check_forward(randn(7, n_cols, dtype=dtype))


def test_long_rows():
    n_cols = helpers.plans.ALWAYS_TILE_ROW + 8315  # at the plans' own sizes: split among programs
    assert helpers.plans.plan_for(n_cols, "forward", 4).segments > 1
    check_forward(randn(3, n_cols))


@pytest.mark.parametrize("shape, dim", [((5, 7, 9), 0), ((5, 7, 9), 1), ((5, 7, 9), 2), ((5, 7, 9), -3),
                                        ((2, 3, 4, 5), 2), ((11,), 0), ((), 0), ((), -1), ((5, 1), 0),
                                        ((3, 5, 1), 1), ((3, 1, 4), 1)])
def test_any_rank_and_dim(shape, dim):
    check_forward(randn(*shape), dim)


@pytest.mark.parametrize("shape, dim, dtype", [((1100, 40), 0, torch.float32), ((5, 7), 0, torch.float64),
                                              ((5, 7, 9), 1, torch.float64)])
def test_contiguous_input_gives_torchs_layout(monkeypatch, shape, dim, dtype):
    """Where neither the column kernels nor turned tiles take the call, the rows' result is copied back into torch's
    layout, contiguous as the input, and so is the gradient."""
    monkeypatch.setattr(helpers.columns, "takes_columns", lambda *args: False)
    monkeypatch.setattr(helpers.turned, "takes", lambda *args: False)
    x = randn(*shape, dtype=dtype).requires_grad_()
    y = check_forward(x, dim)
    assert y.stride() == torch.softmax(x, dim).stride() == x.stride()
    y.backward(randn(*shape, dtype=dtype))
    assert x.grad.stride() == x.stride()


@pytest.mark.parametrize("shape, dim", [((), 0), ((5, 1), 0), ((3, 5, 1), 1), ((3, 1, 4), 1), ((2, 3, 4), 2)])
@pytest.mark.parametrize("transposed", [False, True])
def test_outputs_are_tensors_of_their_own(shape, dim, transposed):
    """Where a kernel's rows are its output's memory (a dim of size 1, or only such dims after it), the output is
    still the tensor it writes into, not a view of it, as torch's: in-place ops that refuse views work on y and dx
    (the forward's, the backward's and the graph kernel's), in torch's strides, on a layout's first call and a
    repeat."""
    for _ in range(2):
        x = randn(*reversed(shape)).permute(tuple(reversed(range(len(shape))))) if transposed else randn(*shape)
        y, dy = torch.softmax(x, dim), randn(*shape, scale=1.0)
        outputs = [helpers.softmax(x, dim), helpers.softmax_backward(y, dy, dim)]
        for softmax in (helpers.softmax, helpers.graph_softmax):
            x_in = x.clone().requires_grad_()
            outputs += torch.autograd.grad(softmax(x_in, dim), x_in, dy)
        for got in outputs:
            assert got._base is None and got.stride() == y.stride()
            got.detach_().unsqueeze_(0)  # each refuses a view


@pytest.mark.parametrize("make_view", [
    pytest.param(lambda x: x.t(), id="transposed"),
    pytest.param(lambda x: x[::2, 1::3], id="sliced"),
    pytest.param(lambda x: x[:, :1].expand(-1, 37), id="expanded"),
    pytest.param(lambda x: x.t()[5:20], id="transposed-sliced"),
    pytest.param(lambda x: x.reshape(10, 9, 13).permute(2, 0, 1), id="permuted-3d"),
])
@pytest.mark.parametrize("dim", [0, -1])
def test_strided_inputs(make_view, dim):
    x = make_view(randn(30, 39))
    assert not x.is_contiguous()
    check_forward(x, dim)


@pytest.mark.parametrize("dim", [0, -1])
def test_lazily_negated_views(dim):
    """``w.conj().imag`` is a view whose data is w's imaginary part and whose values are minus that (torch's negative
    bit). The kernels read data: softmax, softmax_backward (with such a y or dy) and the gradient still get torch's
    values, on a layout's first call and its repeats."""
    w = torch.complex(randn(5, 37), randn(5, 37))
    x = w.conj().imag
    assert x.is_neg()
    y = torch.softmax(randn(5, 37), dim)
    for _ in range(2):
        check_forward(x, dim)
        for y_in, dy in ((y, x), (x, y)):
            torch.testing.assert_close(helpers.softmax_backward(y_in, dy, dim), torch._softmax_backward_data(
                dy, y_in, dim, y_in.dtype), **backward_tolerance(y_in, dy, dim))
        x_grad, x_torch = (x.clone().requires_grad_() for _ in range(2))
        (dx,), (expected,) = (torch.autograd.grad(softmax(t, dim), t, x) for softmax, t in (
            (helpers.softmax, x_grad), (torch.softmax, x_torch)))
        torch.testing.assert_close(dx, expected, **backward_tolerance(torch.softmax(x, dim), x, dim, separate_y=True))


def test_calls_from_threads():
    """Calls from eight threads at once, of rows and columns, forward and backward, each with torch's values (Triton's
    interpreter keeps the grid it runs in one place for the process: ``kernels.launch`` runs one launch at a time)."""
    inputs = [randn(16, 300 + i) for i in range(16)]

    def call(i):
        x, dim = inputs[i], i % 2 - 1  # dims 0 and -1 in turn: columns and rows
        y = helpers.softmax(x, dim)
        dy = torch.ones_like(x).cumsum(dim)  # dx = y * (dy - sum(y * dy)): not zero
        return y, helpers.softmax_backward(y, dy, dim), torch.softmax(x, dim), dy, dim

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(16)))
    for y, dx, expected, dy, dim in results:
        torch.testing.assert_close(y, expected, **TOLERANCE[torch.float32])
        torch.testing.assert_close(dx.double(), torch_backward(expected, dy, dim),
                                   **backward_tolerance(expected, dy, dim))


def test_special_values():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([
        [0.0, -inf, 1.0, -inf],  # -inf entries get exactly 0
        [-inf, -inf, -inf, -inf],  # all -inf: NaN, as torch gives
        [1.0, inf, 2.0, 3.0],  # +inf: NaN
        [nan, 1.0, 2.0, 3.0],  # NaN spreads to the whole row
        [1000.0, 1001.0, 1002.0, 999.0],  # the naive formula overflows here; the safe one does not
        [3.0e38, -3.0e38, 0.0, 1.0],  # x - m overflows to -inf: exp gives 0
        [5.0, 5.0, 5.0, 5.0],  # ties
    ], device=helpers.DEVICE)
    for dtype in (torch.float32, torch.float64):
        check_forward(x.to(dtype))
    huge_half = torch.tensor([[65504.0, -65504.0, 0.0, 11.5]], device=helpers.DEVICE)  # exp(11.5) overflows fp16
    for dtype in (torch.float16, torch.bfloat16):
        check_forward(huge_half.to(dtype))


def test_special_values_in_long_rows(looped):
    """A split row (pieces of 32 under ``looped``) whose first piece is all -inf: its partial (m = -inf, d = 0) must not
    poison the merge."""
    inf = float("inf")
    x = randn(4, 50)
    x[0, :40] = -inf  # the first piece all -inf, finite values later
    x[1, :] = -inf
    x[2, 40] = inf
    x[3, 30] = float("nan")
    check_forward(x)


@pytest.mark.parametrize("shape, dim", [((0, 5), -1), ((5, 0), -1), ((5, 0), 0), ((2, 0, 3), 1), ((0,), 0)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float64])
def test_empty(shape, dim, transposed, out_dtype):
    """Nothing to compute, but torch's shape, dtype, device and strides: the output, its gradient through autograd,
    and softmax_backward's."""
    x = randn(*shape)
    x = (x.t() if transposed and x.ndim == 2 else x).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    y, expected = helpers.softmax(x, dim, out_dtype), torch.softmax(x_torch, dim, dtype=out_dtype)
    dy = randn(*x.shape, dtype=expected.dtype)
    results = [y, *torch.autograd.grad(y, x, dy), helpers.softmax_backward(expected.detach(), dy, dim)]
    expected_results = [expected, *torch.autograd.grad(expected, x_torch, dy),
                        torch._softmax_backward_data(dy, expected.detach(), dim, expected.dtype)]
    for got, want in zip(results, expected_results, strict=True):
        assert (got.shape, got.dtype, got.device, got.stride()) == (want.shape, want.dtype, want.device, want.stride())


@pytest.mark.parametrize("shape, dim", [((4, 8), 0), ((4, 8), -1), ((), 0), ((2, 0, 3), 1), ((2, 1, 3), 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_meta_tensors(shape, dim, dtype):
    """A model built on the meta device (shapes without data): softmax, its autograd and softmax_backward give
    torch's shapes, dtypes and strides, after a call of the same layout with data too; a bad dim is still refused."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    helpers.softmax(torch.empty(shape, dtype=dtype, device=helpers.DEVICE), dim)
    for out_dtype in (None, torch.float32, torch.float64):
        y, expected = helpers.softmax(x, dim, out_dtype), torch.softmax(x, dim, out_dtype)
        assert (y.device, y.shape, y.dtype, y.stride()) == (expected.device, expected.shape, expected.dtype,
                                                            expected.stride())
    dx, expected = helpers.softmax_backward(x, x, dim), torch._softmax_backward_data(x, x, dim, dtype)
    assert (dx.device, dx.shape, dx.dtype, dx.stride()) == (expected.device, expected.shape, expected.dtype,
                                                             expected.stride())
    leaf = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(helpers.softmax(leaf, dim), leaf, x)
    assert dx.is_meta and dx.shape == x.shape and dx.dtype == dtype
    with pytest.raises(IndexError, match="Dimension out of range"):
        helpers.softmax(x, x.ndim + 1)


def check_torchs_own(x, dim, dtype):
    """softmax, its gradient and softmax_backward of ``x``, where the kernels do not run: torch's own, to the bit."""
    x = x.clone().requires_grad_()
    y, expected = helpers.softmax(x, dim, dtype), torch.softmax(x, dim, dtype)
    assert torch.equal(y, expected) and y.stride() == expected.stride() and y.device == x.device
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (expected_dx,) = torch.autograd.grad(expected, x, dy)
    torch.testing.assert_close(dx, expected_dx, rtol=0, atol=0)
    y, dy = y.detach().to(x.dtype), dy.to(x.dtype)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    expected = torch._softmax_backward_data(dy.to(wide), y.to(wide), dim, wide).to(x.dtype)
    assert torch.equal(helpers.softmax_backward(y, dy, dim), expected)


@pytest.mark.parametrize("dtype", [None, torch.float32])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_another_device_is_torchs(monkeypatch, x_dtype, dtype):
    """A tensor on another device than the kernels' (a CPU tensor on a GPU machine) gets torch's own softmax, gradient
    and backward, as a meta tensor gets its meta result: a drop-in runs wherever torch.softmax runs. Here no tensor is
    on the kernels' device; test_cpu_tensors_on_a_gpu_machine takes real ones."""
    monkeypatch.setattr(ops, "_on_kernel_device", lambda t: False)
    for shape, dim in (((4, 50), -1), ((6, 5, 3), 1), ((7,), 0)):
        check_torchs_own(randn(*shape, dtype=x_dtype), dim, dtype)


@pytest.mark.skipif(helpers.INTERPRET, reason="the interpreter's kernels run on CPU tensors")
def test_cpu_tensors_on_a_gpu_machine():
    """CPU tensors on a GPU machine: torch's own softmax, gradient and backward (the kernels run on the GPU)."""
    for dtype in (torch.bfloat16, torch.float32):
        check_torchs_own(randn(33, 65, dtype=dtype).cpu(), 0, None)


def jagged(*lengths, inner=(6,), dtype=torch.float32):
    """A nested tensor of the jagged layout, (len(lengths), j, *inner), and its sequences as dense tensors."""
    sequences = [randn(length, *inner, dtype=dtype) for length in lengths]
    return torch.nested.nested_tensor(sequences, layout=torch.jagged), sequences


def check_jagged(x, sequences, dim, dtype=None, dense_softmax=torch.softmax):
    """softmax over ``dim`` of the jagged ``x``, its gradient and softmax_backward, against each of its ``sequences``
    (dense) by ``dense_softmax``; dy for softmax_backward with offsets of its own, of the same values."""
    dense_dim = dim - 1 if dim > 0 else dim
    leaves = [s.clone().requires_grad_(s.is_floating_point()) for s in sequences]
    expected = [dense_softmax(s, dense_dim, dtype) for s in leaves]
    dy = [torch.randn_like(e) for e in expected]
    y = helpers.softmax(x.requires_grad_(x.is_floating_point()), dim, dtype)
    assert y.is_nested and y.shape == x.shape and y.dtype == expected[0].dtype
    assert (y._maybe_min_seqlen, y._maybe_max_seqlen) == (x._maybe_min_seqlen, x._maybe_max_seqlen)  # kept cached
    tolerance = TOLERANCE[x.dtype if x.is_floating_point() and dtype is None else y.dtype]
    for got, want in zip(y.unbind(), expected, strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    if not x.is_floating_point():
        return
    expected_dx = torch.autograd.grad(expected, leaves, dy)
    dy_own_offsets = torch.nested.nested_tensor(dy, layout=torch.jagged)
    (dx,) = torch.autograd.grad(y, x, torch.nested.nested_tensor_from_jagged(torch.cat(dy), x.offsets()))
    for dx_nested in (dx, helpers.softmax_backward(y.detach(), dy_own_offsets, dim, x.dtype)):
        assert dx_nested.is_nested and dx_nested.shape == x.shape and dx_nested.dtype == x.dtype
        for got, want in zip(dx_nested.unbind(), expected_dx, strict=True):
            torch.testing.assert_close(got, want, **BACKWARD_TOLERANCE[x.dtype])


@pytest.mark.parametrize("dim", [-1, 2, 1, -2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_jagged_nested_tensors(monkeypatch, dim, dtype):
    """Sequences of any length in a nested tensor of the jagged layout, (batch, j, n): each sequence's softmax, over
    its columns (dim 2) from the tensor's values, over its own length (dim 1, the ragged dim) each sequence padded
    with -inf, forward, gradient and softmax_backward by the kernels: torch's softmax and backward are never called,
    and forward and backward kernels are launched. (torch 2.13's own gradient over the ragged dim is not each
    sequence's: it sums y * dy along each row, as for a softmax over the last dim.)"""
    x, sequences = jagged(3, 0, 5, 1, dtype=dtype)
    dense_softmax = torch.softmax
    monkeypatch.setattr(helpers.recipes, "_recipes", {})
    for name in ("softmax", "_softmax_backward_data"):  # the kernels, not torch
        monkeypatch.setattr(torch, name, None)
    check_jagged(x, sequences, dim, dense_softmax=dense_softmax)
    assert any("backward" in kernel for kernel in launched()) and any("backward" not in k for k in launched())


@pytest.mark.parametrize("inner, dim", [((3, 5), 1), ((3, 5), 2), ((3, 5), -1), ((), 1), ((), -1)])
def test_jagged_nested_tensors_of_other_ranks(inner, dim):
    """Jagged tensors of rank 4 (batch, j, 3, 5) and 2 (batch, j): every dim but the batch's."""
    check_jagged(*jagged(2, 4, 1, inner=inner), dim)


@pytest.mark.parametrize("x_dtype, dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float64),
                                            (torch.int64, torch.float32), (torch.bool, torch.float32)])
@pytest.mark.parametrize("dim", [1, 2])
def test_jagged_nested_tensors_with_a_dtype(x_dtype, dtype, dim):
    """``dtype`` as torch's: integers and bools cast before the padding (a padded uint8 or bool cannot hold -inf)."""
    sequences = [(randn(n, 4) > 0).to(x_dtype) if not x_dtype.is_floating_point else randn(n, 4, dtype=x_dtype)
                 for n in (3, 1, 2)]
    check_jagged(torch.nested.nested_tensor(sequences, layout=torch.jagged), sequences, dim, dtype)


def test_jagged_second_order_over_the_sequence_dim():
    """The gradient over the ragged dim is differentiable again (a gradient penalty), as each sequence's is."""
    x, sequences = jagged(3, 2, dtype=torch.float64)
    w = torch.randn(5, 6, dtype=torch.float64, device=helpers.DEVICE)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(helpers.softmax(x, 1), x, torch.nested.nested_tensor_from_jagged(w, x.offsets()),
                                create_graph=True)
    (ddx,) = torch.autograd.grad(dx.values().square().sum(), x)
    leaves = [s.clone().requires_grad_() for s in sequences]
    dense_dx = torch.autograd.grad([torch.softmax(s, 0) for s in leaves], leaves, list(w.split([3, 2])),
                                   create_graph=True)
    expected = torch.autograd.grad(sum(d.square().sum() for d in dense_dx), leaves)
    torch.testing.assert_close(ddx.values(), torch.cat(expected))


def test_jagged_empty_sequence_under_anomaly_detection():
    """An empty sequence leaves no NaN in the padded softmax over the sequence dim, which anomaly mode would flag."""
    x, sequences = jagged(3, 0, 2, dtype=torch.float64)
    with torch.autograd.detect_anomaly():
        y = helpers.softmax(x.requires_grad_(), 1)
        (dx,) = torch.autograd.grad(y.values().sum(), x)
    assert torch.isfinite(dx.values()).all()


def test_jagged_backward_needs_the_same_lengths():
    x, _ = jagged(3, 2)
    y = helpers.softmax(x, 1)
    with pytest.raises(ValueError, match="sequences of the same lengths"):
        helpers.softmax_backward(y, jagged(2, 3)[0], 1)


def test_jagged_on_another_device(monkeypatch):
    """A jagged tensor the kernels cannot reach (a CPU one on a GPU machine) takes the same values and padding paths,
    with torch's dense softmax: each sequence's gradient over the ragged dim too."""
    monkeypatch.setattr(ops, "_on_kernel_device", lambda t: False)
    for dim in (1, 2, -1):
        check_jagged(*jagged(3, 0, 5, dtype=torch.float64), dim)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_other_nested_tensors_are_torchs():
    """A nested tensor the kernels do not take is torch's: the strided layout's softmax and backward, and softmax
    over the batch dim, which torch refuses."""
    sequences = [randn(3, 6), randn(5, 6)]
    x = torch.nested.nested_tensor(sequences)
    y = helpers.softmax(x, -1)
    for got, want in zip(y.unbind(), (torch.softmax(s, -1) for s in sequences), strict=True):
        assert torch.equal(got, want)
    dx = helpers.softmax_backward(y, x, -1)
    for got, want in zip(dx.unbind(), torch._softmax_backward_data(x, y, -1, torch.float32).unbind(), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="batch dimension"):
        helpers.softmax(jagged(2, 3)[0], 0)


@pytest.mark.parametrize("make_input, dim", [
    pytest.param(lambda: randn(4, 50), -1, id="contiguous rows"),
    pytest.param(lambda: randn(2, 3, 50, dtype=torch.bfloat16), 2, id="contiguous, rank 3"),
    pytest.param(lambda: randn(50, 4).t(), -1, id="transposed"),
    pytest.param(lambda: randn(4, 50), 0, id="dim 0"),
    pytest.param(lambda: randn(0, 50), -1, id="empty"),
])
def test_repeat_calls_of_a_layout(monkeypatch, make_input, dim):
    """A plain call of a layout seen before skips the checks and the planning and goes to its launch: it still
    returns torch's softmax and gradient for new values, and a call that needs autograd still gets it."""
    x = make_input()
    check_forward(x, dim)
    dy = randn(*x.shape, dtype=x.dtype)
    helpers.softmax_backward(helpers.softmax_forward(x, dim), dy, dim)
    checks = []
    monkeypatch.setattr(ops, "_check_tensor", lambda *args, **kwargs: checks.append(args))
    for _ in range(2):  # new values, the same layouts
        x = make_input()
        y = check_forward(x, dim)
        dy = randn(*x.shape, dtype=x.dtype)
        dx = helpers.softmax_backward(y, dy, dim)
        torch.testing.assert_close(dx.double(), torch_backward(y, dy, dim), **backward_tolerance(y, dy, dim))
    assert checks == []  # every call went to the launch its layout left
    x = make_input().requires_grad_()
    helpers.softmax(x, dim).backward(dy)
    y = torch.softmax(x.detach(), dim)
    torch.testing.assert_close(x.grad.double(), torch_backward(y, dy, dim),
                               **backward_tolerance(y, dy, dim, separate_y=True))  # x.grad is from helpers' own y


def test_a_call_allocates_only_its_output(monkeypatch):
    """A plain call of contiguous rows, the first of its layout or a repeat, forward or backward, allocates its output
    and nothing else: the first plans with the output it then writes."""
    made = []

    def counted(like, dtype):
        made.append(like.shape)
        return torch.full_like(like, float("nan"), dtype=dtype)

    monkeypatch.setattr(ops, "_new_output", counted)
    monkeypatch.setattr(ops, "_new_rows", lambda *args, **kwargs: pytest.fail("a plain call of rows planned with "
                                                                                 "rows of its own"))
    monkeypatch.setattr(helpers.recipes, "_recipes", {})
    for _ in range(2):  # the layout's first call, then a repeat
        x, dy = randn(3, 1, 37), randn(3, 1, 37)
        y = check_forward(x, -1)
        dx = helpers.softmax_backward(y, dy, -1)
        torch.testing.assert_close(dx.double(), torch_backward(y, dy, -1), atol=1e-6, rtol=1e-5)
    assert made == [x.shape] * 4


@pytest.mark.skipif(not helpers.recipes.LAUNCH_DIRECTLY, reason="builds are kept for the GPU's direct launches")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_growing_lengths_share_builds(dtype):
    """A row length that grows call by call reuses the kernel builds of earlier lengths (``recipes._builds``), each
    only where Triton would specialise it alike: lengths and row starts that are multiples of 16 and those that are
    not, in turns, every call checked against torch."""
    lengths = [1000, 1001, 1008, 1009, 1024, 999, 1040, 1041, 1056, 1017]
    builds_before = len(helpers.recipes._builds)
    for n_cols in lengths:
        x = randn(3, n_cols + 5, dtype=dtype)
        check_forward(x[:, :n_cols])  # rows n_cols + 5 apart: a start on 16 bytes for every other row
        check_forward(x[:, 5:5 + n_cols])  # a start off 16 bytes
        check_forward(randn(3, n_cols, dtype=dtype))
    assert len(helpers.recipes._builds) - builds_before < 3 * len(lengths)


@pytest.mark.skipif(not helpers.recipes.LAUNCH_DIRECTLY, reason="builds are kept for the GPU's direct launches")
def test_direct_launches_keep_their_builds():
    """A prepared launch keeps its compiled kernel alive, though ``recipes._builds`` and Triton's cache let it go
    (from Triton 3.7 a freed build unloads its module: the launch would fail with "invalid resource handle")."""
    x = randn(7, 333)
    check_forward(x)  # the first call prepares its launches
    kernels = {step.kernel for recipe in helpers.recipes._recipes.values() for step in recipe.steps}
    helpers.recipes._builds.clear()
    for kernel in kernels:
        kernel.device_caches.clear()  # Triton's own references to its builds
    gc.collect()
    check_forward(x)  # the same layout: the prepared launches


class Tagged(torch.Tensor):
    """A tensor subclass that dispatches as a torch.Tensor, as nn.Parameter does."""


SUBCLASSES = {"parameter": lambda t, grad: torch.nn.Parameter(t, requires_grad=grad),
              "subclass": lambda t, grad: t.as_subclass(Tagged).requires_grad_(grad)}


@pytest.mark.parametrize("kind", SUBCLASSES)
@pytest.mark.parametrize("requires_grad", [True, False], ids=["trained", "frozen"])
@pytest.mark.parametrize("shape, dim, channels_last", [((8, 16), -1, False), ((3, 4, 37), 1, False),
                                                       ((2, 8, 3, 3), 1, True), ((4, 1500, 17), 1, False)],
                         ids=["rows", "held-columns", "turned", "split-columns"])
def test_tensor_subclasses(kind, requires_grad, shape, dim, channels_last):
    """Softmax of a weight (a model's mixing logits): the kernels run on a Parameter's own data, forward, backward
    through autograd, and ``softmax_backward`` of subclasses, each result of torch's type (a subclass's own, a
    Parameter's plain Tensor), first call and kept launch alike."""
    make = SUBCLASSES[kind]
    data = randn(*shape)
    data = data.to(memory_format=torch.channels_last) if channels_last else data
    x = make(data, requires_grad)
    expected_y = torch.softmax(data, dim)
    for _ in range(2):
        y = helpers.softmax(x, dim)
        torch.testing.assert_close(y, expected_y, **TOLERANCE[torch.float32])
        assert type(y) is type(torch.softmax(x, dim))
    dy = randn(*shape)
    expected_dx = torch_backward(expected_y, dy, dim).float()
    if requires_grad:
        (dx,) = torch.autograd.grad(y, x, dy)
        torch.testing.assert_close(dx, expected_dx, atol=1e-6, rtol=1e-4)
        assert type(dx) is type(torch.autograd.grad(torch.softmax(x, dim), x, dy)[0])
    y_sub, dy_sub = make(expected_y, False), make(dy, False)
    for _ in range(2):
        dx = helpers.softmax_backward(y_sub, dy_sub, dim)
        torch.testing.assert_close(dx, expected_dx, atol=1e-6, rtol=1e-4)
        assert type(dx) is type(torch._softmax_backward_data(dy_sub, y_sub, dim, y_sub.dtype))
