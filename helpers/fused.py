"""Notebook 06's kernels: softmax at the memory limit for every row length, forward and backward.

Two shapes of kernel, both persistent (a grid sized to fill the GPU once, each program looping over its work):

- tile kernels: ``ROWS`` whole rows per program, for rows that fit on chip. Short rows get many rows per program so
  every program moves enough bytes; mid rows get one.
- split kernels: a row too long for one program is cut into ``SEGMENTS`` pieces held by as many programs, which
  exchange their partial statistics, (m, d) forward or the partial sum of y * dy backward, through global memory. Each
  piece of x stays in registers between the two halves, so x is read once.

The programs of a row must wait for each other. Each writes its partial as one 64-bit word into a slot that starts
EMPTY, and on a GPU (``PHASE`` 2) readers poll the slots until none is EMPTY. A wait must never be for a program the GPU
has not started: programs take their place in a row by the order they start (a ticket from one atomic counter), not by
program id, so a row's programs are always started ahead of anything that waits for them, and the grid is sized to
what the GPU holds at once (``resident_programs``) so that all of them run together. Triton's
interpreter runs programs one after another, where a wait would never end, so there the same kernel runs as two
launches: ``PHASE`` 0 writes the partials, ``PHASE`` 1 merges them and finishes (re-reading x). fp64 partials do not
fit a 64-bit word; fp64 rows too long for a tile take notebook 05's looped kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import kernels
from .device import INTERPRET
from .kernels import launch, upcast

# PHASE of a split kernel: partials only, merge-and-finish only, or both in one launch with a wait between.
STATISTICS, FINISH, FUSED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# A partial slot not written yet. Written slots hold two fp32 bit patterns; all ones is a negative NaN with a payload
# that GPU arithmetic never produces (its NaNs are 0x7fffffff), so no real partial can look EMPTY.
EMPTY = tl.constexpr(-1)


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
                           other=float("-inf")))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        d_inverse = 1.0 / tl.sum(e, axis=1)  # one division per row, then a multiply per element
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], e * d_inverse[:, None], mask=mask)


@triton.jit
def pack(high, low):
    """Two fp32 values in one 64-bit word: a single store publishes both at once."""
    high_bits = high.to(tl.uint32, bitcast=True).to(tl.uint64)
    low_bits = low.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((high_bits << 32) | low_bits).to(tl.int64, bitcast=True)


@triton.jit
def unpack(word):
    bits = word.to(tl.uint64, bitcast=True)
    high = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    low = (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return high, low


@triton.jit
def read_partials(part_ptr, row, parts, SEGMENTS: tl.constexpr, valid):
    """The SEGMENTS packed partials of ``row``, waiting until every one has been written (no slot still EMPTY).

    Each slot is one 64-bit word, written by one store, so a reader sees either EMPTY or the whole partial: no
    counter, no fence. Volatile loads go to L2 each time instead of a stale L1 line."""
    mask = parts < tl.where(valid, SEGMENTS, 0)
    words = tl.load(part_ptr + row * SEGMENTS + parts, mask=mask, other=0, volatile=True)
    while tl.sum((words == EMPTY).to(tl.int32), axis=0) > 0:
        words = tl.load(part_ptr + row * SEGMENTS + parts, mask=mask, other=0, volatile=True)
    return words


@triton.jit
def take_ticket(counter_ptr):
    """This program's place, 0 to num_programs - 1, in the order programs start. The counter starts at EMPTY (-1); a
    second launch over the same counter (the interpreter's FINISH phase) counts on and takes the same places again."""
    ticket = tl.atomic_add(counter_ptr, 1) + 1  # 64-bit, like the counter
    return (ticket % tl.num_programs(0)).to(tl.int32)  # 32-bit like a program id: 64-bit index math costs registers


@triton.jit
def softmax_split_kernel(
    y_ptr, x_ptr, part_ptr, x_row_stride, x_col_stride, y_row_stride, n_rows, n_cols,
    SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Forward for long rows: SEGMENTS consecutive programs share each row, one BLOCK_N piece each, and merge their
    (m, d) (notebook 05's merge) through ``part_ptr``: one packed word per piece, EMPTY until written, and one ticket
    counter after the last row's. Groups of SEGMENTS programs walk the rows grid-stride.

    Each piece keeps e = exp(x - m_piece) in registers, so finishing is one multiply by exp(m_piece - m) / d. In one
    launch (PHASE 2) a program publishes row r, then finishes row r - 1 of its group, whose partials have had a whole
    iteration to arrive: the wait hides behind the loads of the next row.
    """
    program = take_ticket(part_ptr + n_rows * SEGMENTS)
    segment = program % SEGMENTS
    group, n_groups = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    cols = segment * BLOCK_N + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, SEGMENTS_POW2)
    e_prev = tl.zeros((BLOCK_N,), tl.float32)
    m_prev = tl.max(e_prev, axis=0)
    # one iteration past the group's last row, so that in PHASE 2 the last row is finished too
    for row_index in range(group, n_rows + n_groups, n_groups):
        row = tl.cast(row_index, tl.int64)  # 64-bit offsets: row * stride can pass 2**31
        valid = row < n_rows
        mask = cols < tl.where(valid, n_cols, 0)  # a row past the end has no columns
        x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        e = tl.exp(x - tl.where(m == float("-inf"), 0.0, m))  # a piece of all -inf: e = 0, partial (-inf, 0)
        if PHASE != FINISH:
            tl.store(part_ptr + row * SEGMENTS + segment, pack(m, tl.sum(e, axis=0)), mask=valid)
        if PHASE == FUSED:
            finish_row, finish_valid, e_finish, m_finish = row - n_groups, row >= group + n_groups, e_prev, m_prev
            e_prev, m_prev = e, m
        else:
            finish_row, finish_valid, e_finish, m_finish = row, valid, e, m
        if PHASE != STATISTICS:
            m_parts, d_parts = unpack(read_partials(part_ptr, tl.maximum(finish_row, 0), parts, SEGMENTS,
                                                    finish_valid))
            m_parts = tl.where(parts < SEGMENTS, m_parts, float("-inf"))  # padding slots: the merge identity
            m_row = tl.max(m_parts, axis=0)
            d_row = tl.sum(d_parts * tl.exp(m_parts - tl.where(m_row == float("-inf"), 0.0, m_row)), axis=0)
            scale = tl.where(m_finish == float("-inf"), 0.0, tl.exp(m_finish - m_row)) / d_row
            tl.store(y_ptr + finish_row * y_row_stride + cols, e_finish * scale,
                     mask=cols < tl.where(finish_valid, n_cols, 0))


@triton.jit
def softmax_backward_tile_kernel(
    dx_ptr, y_ptr, dy_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_rows, n_cols,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Backward, persistent: tiles of ROWS whole rows, dx = y * (dy - sum(y * dy)) row by row."""
    rows_in_tile = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    for tile in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = (tile * ROWS + rows_in_tile).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        y = upcast(tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :] * y_col_stride, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask,
                            other=0.0))
        dot = tl.sum(y * dy, axis=1)
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], y * (dy - dot[:, None]), mask=mask)


@triton.jit
def softmax_backward_split_kernel(
    dx_ptr, y_ptr, dy_ptr, part_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_rows,
    n_cols, SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Backward for long rows: SEGMENTS programs share a row and exchange only their part of sum(y * dy) (packed
    with a 0 beside it, so a written slot is never EMPTY), with the same one-row-behind pipeline as the forward."""
    program = take_ticket(part_ptr + n_rows * SEGMENTS)
    segment = program % SEGMENTS
    group, n_groups = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    cols = segment * BLOCK_N + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, SEGMENTS_POW2)
    y_prev = tl.zeros((BLOCK_N,), tl.float32)
    dy_prev = y_prev
    for row_index in range(group, n_rows + n_groups, n_groups):
        row = tl.cast(row_index, tl.int64)
        valid = row < n_rows
        mask = cols < tl.where(valid, n_cols, 0)  # a row past the end has no columns
        y = tl.load(y_ptr + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        if PHASE != FINISH:
            dot_piece = tl.sum(y * dy, axis=0)
            tl.store(part_ptr + row * SEGMENTS + segment, pack(dot_piece, tl.zeros_like(dot_piece)), mask=valid)
        if PHASE == FUSED:
            finish_row, finish_valid, y_finish, dy_finish = row - n_groups, row >= group + n_groups, y_prev, dy_prev
            y_prev, dy_prev = y, dy
        else:
            finish_row, finish_valid, y_finish, dy_finish = row, valid, y, dy
        if PHASE != STATISTICS:
            dot_parts, _ = unpack(read_partials(part_ptr, tl.maximum(finish_row, 0), parts, SEGMENTS, finish_valid))
            dot = tl.sum(tl.where(parts < SEGMENTS, dot_parts, 0.0), axis=0)
            tl.store(dx_ptr + finish_row * dx_row_stride + cols, y_finish * (dy_finish - dot),
                     mask=cols < tl.where(finish_valid, n_cols, 0))


# ---------------------------------------------------------------------------------------------------------------------
# Choosing a kernel and its shape for a row length, and sizing the persistent grid.


@dataclass(frozen=True)
class Plan:
    """How rows of one length are cut: ``segments`` programs per row (1: tile kernel) of ``block_n`` elements,
    ``rows`` rows per tile, ``num_warps`` warps per program, and whether a tile kernel runs a persistent grid (a split
    always does: its programs must all be resident) or one program per tile."""

    rows: int
    block_n: int
    segments: int
    num_warps: int
    persistent: bool = False


# The shapes below are read off the tuning sweep (``python -m helpers.tune``, results/*-tuning.csv; notebook 06),
# choosing shapes that are good everywhere over ones that are best at one row length and fall off a cliff at another.
TILE_ELEMENTS = 1024  # short rows: whole rows per program until a tile holds this many elements
ELEMENTS_PER_THREAD = 16  # tile kernels: warps = elements / (32 * this), 1 to 16
MAX_TILE_ROW = {"forward": 32768, "backward": 16384}  # longer rows are split across programs (fp32, fp64)
# fp16/bf16. At a forward row of 32768 the whole-row tile beats the split on the H100 (0.90 of copy against at most
# 0.85, results/*h100*-tuning-32768-50257.csv), though not on the H200 (0.71 against 0.79): the H100 is the target.
MAX_TILE_ROW_2_BYTES = {"forward": 32768, "backward": 16384}
SEGMENT_ELEMENTS = 2048  # the piece of a long row each program of a split holds


def plan_for(n_cols: int, phase: str, element_size: int = 4) -> Plan:
    """The kernel shape for rows of ``n_cols`` elements of ``element_size`` bytes in ``phase``.

    The shape is compiled into the kernel, so a symbolic row length (torch.compile's dynamic shapes) is made concrete
    here: the compiled graph is then specialised to it."""
    n_cols = int(n_cols)
    block = triton.next_power_of_2(n_cols)
    max_tile = (MAX_TILE_ROW_2_BYTES if element_size == 2 else MAX_TILE_ROW)[phase]
    if block <= max_tile:
        rows = max(1, TILE_ELEMENTS // block)
        return Plan(rows, block, 1, max(1, min(16, rows * block // (32 * ELEMENTS_PER_THREAD))))
    segments = triton.cdiv(n_cols, SEGMENT_ELEMENTS)
    # Forward pieces take 2 warps when 16-bit, and also in fp32 while a row has fewer than 32 pieces (fp32 N = 50257:
    # 0.91 of copy against 0.885 with 4 warps on the H100, 0.88 against 0.84 on the H200; from 32 pieces on, 4 warps
    # win by 0.15-0.2 in fp32).
    warps = 2 if phase == "forward" and (element_size == 2 or segments < 32) else 4
    return Plan(1, SEGMENT_ELEMENTS, segments, warps, persistent=True)


@functools.cache
def _device_limits(index: int) -> tuple[int, int, int, int]:
    props = torch.cuda.get_device_properties(index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads, shared = props.max_threads_per_multi_processor, props.shared_memory_per_multiprocessor
    return props.multi_processor_count, regs, threads, shared


def resident_programs(compiled, num_warps: int) -> int:
    """How many programs of a compiled kernel the whole GPU holds at once (registers, threads, shared memory)."""
    n_sm, regs_per_sm, threads_per_sm, smem_per_sm = _device_limits(torch.cuda.current_device())
    compiled._init_handles()  # loads the binary, which fills in n_regs (as Triton's softmax tutorial does)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # registers are handed out per warp, 256 at a time
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_threads = threads_per_sm // (32 * num_warps)
    by_smem = smem_per_sm // compiled.metadata.shared if compiled.metadata.shared else by_threads
    return n_sm * max(1, min(by_regs, by_threads, by_smem, 32))


CPU_PROGRAMS = 4  # under the interpreter: a small persistent grid, so every kernel's loop runs several times
_resident_cache: dict[tuple, int] = {}


def _grid_size(kernel, args, constexprs, num_warps: int, work_items: int, group: int, persistent: bool = True) -> int:
    """Programs to launch: never more than the GPU holds at once (a split needs every program of a row resident),
    in whole groups of ``group`` programs, never more than there is work for. Not persistent: one per work item."""
    if not persistent:
        return work_items
    if INTERPRET:
        return group * min(work_items, CPU_PROGRAMS)
    # Compiled for the dtypes alone (no data pointers: under torch.compile the tensors are FakeTensors), with the
    # integers' specialisations (== 1, multiple of 16) kept: a unit column stride changes the code the most.
    signature = [a.dtype if isinstance(a, torch.Tensor) else int(a) for a in args]
    key = (kernel.fn.__name__, num_warps, *sorted(constexprs.items()),
           *(a if isinstance(a, torch.dtype) else (a == 1, a % 16 == 0) for a in signature))
    if key not in _resident_cache:
        compiled = kernel.warmup(*signature, **constexprs, num_warps=num_warps, grid=(1,))
        _resident_cache[key] = resident_programs(compiled, num_warps)
    return group * max(1, min(work_items, _resident_cache[key] // group))


def launch_forward(x: torch.Tensor, y: torch.Tensor, plan: Plan | None = None) -> None:
    """Softmax of the rows of the 2-D ``x`` into the contiguous 2-D ``y`` with the fused kernels."""
    n_rows, n_cols = x.shape
    plan = plan or plan_for(n_cols, "forward", x.element_size())
    strides = (x.stride(0), x.stride(1), y.stride(0), n_rows, n_cols)
    if plan.segments == 1:
        constexprs = dict(ROWS=plan.rows, BLOCK_N=plan.block_n)
        args = (y, x, *strides)
        grid = _grid_size(softmax_tile_kernel, args, constexprs, plan.num_warps, triton.cdiv(n_rows, plan.rows), 1,
                          plan.persistent or INTERPRET)
        launch(softmax_tile_kernel, (grid,), *args, **constexprs, num_warps=plan.num_warps)
    elif x.dtype == torch.float64:  # fp64 partials do not fit a 64-bit word: notebook 05's looped kernel
        kernels.launch_forward(x, y, kernels.softmax_online_kernel)
    else:
        _launch_split(softmax_split_kernel, (y, x, _partials(n_rows, plan, x.device), *strides), plan, n_rows)


def launch_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, plan: Plan | None = None) -> None:
    """dx of the rows of the 2-D ``y`` and ``dy`` into the contiguous 2-D ``dx`` with the fused kernels."""
    n_rows, n_cols = y.shape
    plan = plan or plan_for(n_cols, "backward", y.element_size())
    strides = (y.stride(0), y.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), n_rows, n_cols)
    if plan.segments == 1:
        constexprs = dict(ROWS=plan.rows, BLOCK_N=plan.block_n)
        args = (dx, y, dy, *strides)
        grid = _grid_size(softmax_backward_tile_kernel, args, constexprs, plan.num_warps,
                          triton.cdiv(n_rows, plan.rows), 1, plan.persistent or INTERPRET)
        launch(softmax_backward_tile_kernel, (grid,), *args, **constexprs, num_warps=plan.num_warps)
    elif y.dtype == torch.float64 or dy.dtype == torch.float64:
        kernels.launch_backward(y, dy, dx, kernels.softmax_backward_looped_kernel)
    else:
        _launch_split(softmax_backward_split_kernel, (dx, y, dy, _partials(n_rows, plan, y.device), *strides), plan,
                      n_rows)


def _partials(n_rows: int, plan: Plan, device: torch.device) -> torch.Tensor:
    """A split's exchange buffer: ``segments`` EMPTY slots per row, then the ticket counter (also EMPTY, -1)."""
    return torch.full((n_rows * plan.segments + 1,), EMPTY.value, dtype=torch.int64, device=device)


def _launch_split(kernel, args, plan: Plan, n_rows: int) -> None:
    constexprs = dict(SEGMENTS=plan.segments, SEGMENTS_POW2=triton.next_power_of_2(plan.segments), BLOCK_N=plan.block_n)
    phases = (STATISTICS, FINISH) if INTERPRET else (FUSED,)
    grid = _grid_size(kernel, args, dict(constexprs, PHASE=phases[-1]), plan.num_warps, n_rows, plan.segments)
    for phase in phases:
        launch(kernel, (grid,), *args, **constexprs, PHASE=phase, num_warps=plan.num_warps)
