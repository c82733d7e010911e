"""Turned tiles (notebook 07): softmax over a dim held whole whose elements lie next to each other in one tensor and
``inner`` apart in another, as channels-last activations (N, C, H, W) hold their classes next to each other while
torch.softmax returns them contiguous, or a transposed x over its last dim.

Every tensor is seen as (outer, inner, R) with a stride each (``view``), and a program holds BLOCK_C inner positions
of one outer index, each whole along R: the compiler lays each load and store out along whichever of the two its
tensor holds next to each other, so both are whole runs, and the block changes layout on chip in between. No
transposing copy, before or after. ``ops`` takes this path where the column kernels (``columns``) do not.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import columns, plans, recipes
from .kernels import upcast
from .tiles import LOG2E

# A block is COLUMNS inner positions (runs of 32 bytes and more of a 16-bit tensor), LONG_COLUMNS where R pads to LONG
# or more, with a forward warp per FORWARD_ROWS of R's padded length (four times as many rows in long blocks; fp64 a
# quarter as many) and a backward warp per BACKWARD_ROWS, 2 to 8. A dim up to MAX_HELD elements is held
# (``columns.TURNED_MAX_HELD_FP64`` of fp64, which the column kernels leave to these). Measured: results/README.md,
# "Turned tiles".
COLUMNS = 16
LONG_COLUMNS = 8
LONG = 2048
FORWARD_ROWS = 128
BACKWARD_ROWS = 64
MAX_HELD = 4096


@triton.jit
def block(ptr, outer, strides, n_inner, n_reduced, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Addresses and mask of a turned program's block of the tensor at ``ptr`` with (outer, inner, R) ``strides``:
    inner positions along axis 0 (32-bit offsets from a 64-bit start: ``view`` keeps one outer index's span
    under 2**31), R along axis 1."""
    outer_stride, inner_stride, reduced_stride = strides
    i = (tl.program_id(0) % tl.cdiv(n_inner, BLOCK_C)) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    return ptr + outer * outer_stride + (i * inner_stride + r * reduced_stride), (i < n_inner) & (r < n_reduced)


@triton.jit
def softmax_turned_kernel(y_ptr, x_ptr, n_inner, n_reduced, y_outer_stride, y_inner_stride, y_reduced_stride,
                          x_outer_stride, x_inner_stride, x_reduced_stride, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Forward: each of the block's inner positions' max m and denominator d along R, then y = exp(x - m) / d."""
    outer = tl.program_id(0).to(tl.int64) // tl.cdiv(n_inner, BLOCK_C)
    x_at, mask = block(x_ptr, outer, (x_outer_stride, x_inner_stride, x_reduced_stride), n_inner, n_reduced, BLOCK_R,
                       BLOCK_C)
    x = upcast(tl.load(x_at, mask=mask, other=float("-inf")))
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all -inf: exp gives 0s, and 0 / 0 the NaNs torch gives
    e = tl.exp2((x - m[:, None]) * LOG2E)
    y_at, _ = block(y_ptr, outer, (y_outer_stride, y_inner_stride, y_reduced_stride), n_inner, n_reduced, BLOCK_R,
                    BLOCK_C)
    tl.store(y_at, e * (1.0 / tl.sum(e, axis=1))[:, None], mask=mask)


@triton.jit
def softmax_backward_turned_kernel(dx_ptr, y_ptr, dy_ptr, n_inner, n_reduced, dx_outer_stride, dx_inner_stride,
                                   dx_reduced_stride, y_outer_stride, y_inner_stride, y_reduced_stride,
                                   dy_outer_stride, dy_inner_stride, dy_reduced_stride, BLOCK_R: tl.constexpr,
                                   BLOCK_C: tl.constexpr):
    """Backward: dx = y * (dy - sum(y * dy)), the sum along R."""
    outer = tl.program_id(0).to(tl.int64) // tl.cdiv(n_inner, BLOCK_C)
    y_at, mask = block(y_ptr, outer, (y_outer_stride, y_inner_stride, y_reduced_stride), n_inner, n_reduced, BLOCK_R,
                       BLOCK_C)
    dy_at, _ = block(dy_ptr, outer, (dy_outer_stride, dy_inner_stride, dy_reduced_stride), n_inner, n_reduced,
                     BLOCK_R, BLOCK_C)
    y = upcast(tl.load(y_at, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_at, mask=mask, other=0.0))
    s = tl.sum(y * dy, axis=1)
    dx_at, _ = block(dx_ptr, outer, (dx_outer_stride, dx_inner_stride, dx_reduced_stride), n_inner, n_reduced,
                     BLOCK_R, BLOCK_C)
    tl.store(dx_at, y * (dy - s[:, None]), mask=mask)


def _collapsed(sizes, strides) -> tuple[int, int] | None:
    """(size, stride) of dims that walk memory as one dim does (dims of size 1 ignored; no dims: (1, 0)), else
    None."""
    size, stride = 1, 0
    for n, s in reversed(list(zip(sizes, strides, strict=True))):
        if n == 1:
            continue
        if size > 1 and s != stride * size:
            return None
        stride = stride if size > 1 else s
        size *= n
    return size, stride if size > 1 else 0


def view(t: torch.Tensor, dim: int) -> tuple[int, int, int, int, int] | None:
    """``t`` seen as (outer, inner, R) around ``dim`` (R): (n_outer, n_inner, outer stride, inner stride, R's
    stride), inner the dims after ``dim``, or the dims before where there are none after; None where either group
    of dims is not one stride apart, or one outer index spans 2**31 elements (the kernels' offsets are 32-bit)."""
    before = _collapsed(t.shape[:dim], t.stride()[:dim])
    after = _collapsed(t.shape[dim + 1:], t.stride()[dim + 1:])
    if before is None or after is None:
        return None
    (n_outer, outer_stride), (n_inner, inner_stride) = (after, before) if after[0] == 1 else (before, after)
    reduced_stride = t.stride(dim) if t.shape[dim] > 1 else 1
    if (n_inner - 1) * inner_stride + (t.shape[dim] - 1) * reduced_stride >= 2**31:
        return None
    return n_outer, n_inner, outer_stride, inner_stride, reduced_stride


def takes(dim: int, *tensors: torch.Tensor) -> bool:
    """Whether softmax over ``dim`` of these tensors (x, or y and dy) runs as turned tiles where the column kernels
    do not take it (``columns.takes_columns``): a dim held whole (MAX_HELD, ``columns.TURNED_MAX_HELD_FP64`` in
    fp64), every tensor one (outer, inner, R) ``view`` with more than one inner position and its inner positions or
    R's elements next to each other, and either a dim that is not the last, whose output torch lays out with R's
    elements apart, or inputs that each hold their inner positions next to each other and R's elements apart (a
    transposed x)."""
    t = tensors[0]
    if not 0 <= dim < t.ndim or columns.takes_columns(dim, *tensors):
        return False
    views = [view(u, dim) for u in tensors]
    if None in views or views[0][1] == 1 or views[0][1] * t.shape[dim] > 2**31:
        return False  # the last: the output's offsets within one outer index would pass 32 bits
    if t.shape[dim] > (columns.TURNED_MAX_HELD_FP64 if torch.float64 in [u.dtype for u in tensors] else MAX_HELD):
        return False
    if not all(1 in (v[3], v[4]) for v in views):
        return False  # no run along either axis of a block: the rows' copies read and write whole runs
    last = math.prod(t.shape[dim + 1:]) == 1
    return not last or all(v[3] == 1 and v[4] != 1 for v in views)


def block_plan(n_reduced: int, n_inner: int, element_size: int, n_inputs: int) -> columns.ColumnPlan:
    """A turned program's block: R whole, COLUMNS or LONG_COLUMNS inner positions (fewer where there are fewer)."""
    block_r = plans.next_power_of_2(n_reduced)
    long = block_r >= LONG
    if n_inputs == 1:
        warps = block_r // (FORWARD_ROWS * (4 if long else 1)) * (4 if element_size == 8 else 1)
    else:
        warps = max(2, min(8, block_r // BACKWARD_ROWS))
    block_c = min(LONG_COLUMNS if long else COLUMNS, plans.next_power_of_2(n_inner))
    return columns.ColumnPlan(block_r, block_c, max(1, min(16, warps)))


def _recipe(kernel, operands: tuple[torch.Tensor, ...], dim: int) -> recipes.Recipe:
    """The launch of a turned ``kernel`` on ``operands`` (the contiguous output first), in ``block_plan``'s
    blocks."""
    views = [view(t, dim) for t in operands]
    n_outer, n_inner = views[0][:2]
    n_reduced = operands[0].shape[dim]
    inputs = operands[1:]
    plan = block_plan(n_reduced, n_inner, max(t.element_size() for t in inputs), len(inputs))
    ints = (n_inner, n_reduced, *[stride for v in views for stride in v[2:]])
    return recipes.Recipe((), (recipes.Step(kernel, n_outer * plans.cdiv(n_inner, plan.block_c), ints,
                                            dict(BLOCK_R=plan.block_r, BLOCK_C=plan.block_c), plan.num_warps),))


def forward_recipe(y: torch.Tensor, x: torch.Tensor, dim: int) -> recipes.Recipe:
    return _recipe(softmax_turned_kernel, (y, x), dim)


def backward_recipe(dx: torch.Tensor, y: torch.Tensor, dy: torch.Tensor, dim: int) -> recipes.Recipe:
    return _recipe(softmax_backward_turned_kernel, (dx, y, dy), dim)


def launch_forward(x: torch.Tensor, y: torch.Tensor, dim: int) -> None:
    """y = softmax(x, dim) into the contiguous y, for an x that turned tiles take (``takes``)."""
    recipes.run(forward_recipe, (y, x), dim)


def launch_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, dim: int) -> None:
    """dx into the contiguous dx, for y and dy that turned tiles take (``takes``)."""
    recipes.run(backward_recipe, (dx, y, dy), dim)
