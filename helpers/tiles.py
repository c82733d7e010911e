"""Tiles (notebook 06): whole rows per program, for rows that fit on chip. Short rows get many rows per program, so
that every program moves enough bytes; mid rows get one. Each program loops over its tiles, so a grid may be sized to
fill the GPU once (``Plan.persistent``); on a GPU the course's plans launch one program per tile, on CPU a few
programs loop. ``LOG2E``, ``KEEP_IN_L2`` and ``upcast_again`` serve every fused kernel."""

import triton
import triton.language as tl

from .kernels import upcast

LOG2E = tl.constexpr(1.4426950408889634)  # exp(z) = exp2(z * LOG2E): tl.exp2 skips tl.exp's subnormal guard
# The cache policy of every load of the fused kernels: its lines are the last the L2 cache evicts. Each element is
# read once, yet on the H100, over rows of 32768 to 151936 forward and backward, the default policy measured up to 0.015
# of copy slower and "evict_first" 0.03-0.05 slower (results/nvidia-h100-80gb-hbm3-split-forward.md, notebook 06).
KEEP_IN_L2 = tl.constexpr("evict_last")


@triton.jit
def softmax_tile_kernel(
    y_ptr, x_ptr, x_row_stride, x_col_stride, y_row_stride, n_rows, n_cols,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward, persistent: each program takes tiles of ROWS whole rows, grid-stride, until none are left."""
    rows_in_tile = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    for tile in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = (tile * ROWS + rows_in_tile).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = upcast(tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask,
                           other=float("-inf"), eviction_policy=KEEP_IN_L2))
        m = tl.max(x, axis=1)
        e = tl.exp2((x - m[:, None]) * LOG2E)  # exp(x - m) in three instructions, not six (notebook 06)
        d_inverse = 1.0 / tl.sum(e, axis=1)  # one division per row, then a multiply per element
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], e * d_inverse[:, None], mask=mask)


@triton.jit
def upcast_again(x):
    """``upcast(x)`` for a use of x after a reduction over it. The compiler merges two upcasts of one value, so a
    16-bit tile or piece would stay live as its fp32 copy, twice the registers, across the reduction: a
    32768-element row of y and dy then spills, and a split holds fewer programs. x + 0.0 is a new
    value (not folded away: -0.0 + 0.0 is +0.0, the one change it makes), so the data stays 16-bit until this
    upcast."""
    if x.dtype == tl.float16 or x.dtype == tl.bfloat16:
        x = x + 0.0
    return upcast(x)


@triton.jit
def softmax_backward_tile_kernel(
    dx_ptr, y_ptr, dy_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_rows, n_cols,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Backward, persistent: tiles of ROWS whole rows, dx = y * (dy - sum(y * dy)) row by row, y and dy kept as
    loaded (``upcast_again``)."""
    rows_in_tile = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    for tile in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = (tile * ROWS + rows_in_tile).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        y = tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :] * y_col_stride, mask=mask, other=0.0,
                    eviction_policy=KEEP_IN_L2)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0,
                     eviction_policy=KEEP_IN_L2)
        dot = tl.sum(upcast(y) * upcast(dy), axis=1)
        dx = upcast_again(y) * (upcast_again(dy) - dot[:, None])
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx, mask=mask)
