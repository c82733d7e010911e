"""Notebook 06's kernels: softmax at the memory limit for every row length, forward and backward.

Two shapes of kernel, both persistent (a grid sized to fill the GPU once, each program looping over its work):

- tile kernels: ``ROWS`` whole rows per program, for rows that fit on chip. Short rows get many rows per program so
  every program moves enough bytes; mid rows get one.
- split kernels: a row too long for one program is cut into ``SEGMENTS`` pieces held by as many programs, which
  exchange their partial statistics, (m, d) forward or the partial sum of y * dy backward, through global memory. Each
  piece of x stays in registers between the two halves, so x is read once.

The programs of a row must wait for each other. Each writes its partial as one 64-bit word into a slot, tagged with the
parity of the call (its launch's number on this exchange buffer, from the ticket counter below), and on a GPU (``PHASE``
2) readers poll the slots until every tag is this call's. Every call writes every slot, so a slot holds this call's
partial or the previous call's: the buffer never needs refilling between calls, and a plain call keeps its own
(``Recipe``). A wait must never be for a program the GPU has not started: programs take their place in a row by the
order they start (a ticket from one atomic counter), not by program id, so a row's programs are always started ahead of
anything that waits for them, and a split is launched only where a row's programs fit on the GPU together, with room to
spare (``split_grid``, from the compiled kernel's residency, ``compiled_resources``). Rows longer than that, and fp64
rows (their partials do not fit a 64-bit word), take the two-pass kernels: statistics, then finish, two launches in
which no program waits for another. Triton's interpreter runs programs one after another, where a wait would never end,
so there a split runs as two launches too: ``PHASE`` 0 writes the partials, ``PHASE`` 1 merges them and finishes
(re-reading x).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .device import DEVICE, INTERPRET
from .kernels import launch, upcast

# PHASE of a split kernel: partials only, merge-and-finish only, or both in one launch with a wait between.
STATISTICS, FINISH, FUSED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# A fresh exchange buffer's fill: the ticket counter at -1 (the first ticket is 0), and slots whose tag (bit 31) is 1,
# not the first call's 0.
EMPTY = tl.constexpr(-1)
LOG2E = tl.constexpr(1.4426950408889634)  # exp(z) = exp2(z * LOG2E): tl.exp2 skips tl.exp's subnormal guard
# The cache policy of every load of the fused kernels: its lines are the last the L2 cache evicts. Each element is
# read once, yet on the H100 this measured 0.01-0.03 of copy faster than the default policy, for tiles and splits,
# forward and backward, and "evict_first" as much slower (notebook 06).
KEEP_IN_L2 = tl.constexpr("evict_last")
# The two-pass kernels store their outputs streaming (evict first), so that they push out of L2 as little as possible
# of the row still to be read again (H100, one row of 2**22 + 3 fp32: forward 0.78 -> 0.83 of copy, GPU time).
STREAMING = tl.constexpr(".cs")
# ... and read what L2 cannot keep for the re-read with this policy, so that it does not push out what it can
# (``kept_programs``).
PASS_THROUGH_L2 = tl.constexpr("evict_first")


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
    32768-element row of y and dy then spills even at 32 warps, and a split holds fewer programs. x + 0.0 is a new
    value (not folded away: -0.0 + 0.0 is +0.0, the one change it makes), so the data stays 16-bit until this
    upcast."""
    if x.dtype == tl.float16 or x.dtype == tl.bfloat16:
        x = x + 0.0
    return upcast(x)


@triton.jit
def pack(high, low, parity):
    """Two fp32 values in one 64-bit word, a single store that publishes both at once, with ``parity`` in place of the
    sign bit of ``low`` (a sum of exponentials, or 0: a sign bit with nothing to say)."""
    high_bits = high.to(tl.uint32, bitcast=True).to(tl.uint64)
    low_bits = (low.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | (parity.to(tl.uint32) << 31)
    return ((high_bits << 32) | low_bits.to(tl.uint64)).to(tl.int64, bitcast=True)


@triton.jit
def unpack(word):
    """``pack``'s two values (``low`` non-negative)."""
    bits = word.to(tl.uint64, bitcast=True)
    high = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    low = (bits & 0x7FFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return high, low


@triton.jit
def read_partials(part_ptr, row, parts, SEGMENTS: tl.constexpr, valid, parity):
    """The SEGMENTS packed partials of ``row``, waiting until every one carries this call's ``parity``.

    Each slot is one 64-bit word, written by one store, so a reader sees either the previous call's partial or the
    whole of this one's: no counter, no fence. Volatile loads go to L2 each time instead of a stale L1 line.

    A program with more threads than slots holds copies of a slot in several threads, each loaded at its own moment,
    and the wait's sum counts one copy of each: it can end while another copy, which the merge may read, is still the
    previous call's (Triton 3.9, 64 slots and 128 threads: most calls). Once the wait has seen every slot written, a
    copy still stale loads again; L2 holds the write by then."""
    return read_slots(part_ptr + row * SEGMENTS + parts, parts < tl.where(valid, SEGMENTS, 0), parity)


@triton.jit
def read_slots(slots, mask, parity):
    """The packed words at the pointers ``slots`` under ``mask``, of any shape, once every one carries ``parity``
    (``read_partials``)."""
    words = tl.load(slots, mask=mask, other=0, volatile=True)
    while tl.sum(stale(words, parity, mask).to(tl.int32)) > 0:
        words = tl.load(slots, mask=mask, other=0, volatile=True)
    return tl.load(slots, mask=stale(words, parity, mask), other=words, volatile=True)


@triton.jit
def stale(words, parity, mask):
    """Which of the slots under ``mask`` do not yet hold this call's partial: their tag is not ``parity``."""
    return (((words.to(tl.uint64, bitcast=True) >> 31) & 1) != parity) & mask


@triton.jit
def take_ticket(counter_ptr, PHASE: tl.constexpr):
    """This program's place, 0 to num_programs - 1, in the order programs start, and the parity of its call. The
    counter starts at EMPTY (-1) and counts on from launch to launch: every launch over one exchange buffer has the
    same grid, so launch k takes tickets k * num_programs to (k + 1) * num_programs - 1. The interpreter's FINISH
    launch reads the partials of the STATISTICS launch before it: one call, one parity."""
    ticket = tl.atomic_add(counter_ptr, 1) + 1  # 64-bit, like the counter
    call = ticket // tl.num_programs(0)
    if PHASE == FINISH:
        call -= 1
    # 32-bit like a program id: 64-bit index math costs registers
    return (ticket % tl.num_programs(0)).to(tl.int32), (call % 2).to(tl.int32)


@triton.jit
def row_window(row, row_stride, n_cols, valid, ALIGN: tl.constexpr):
    """Where a split's pieces sit in a row, so that they load and store 16 bytes (ALIGN elements) at a time even when
    rows start off 16-byte boundaries (an odd row length). Positions count from ``start``, the multiple of ALIGN at or
    up to ``shift`` elements before the row. The chunks of ALIGN positions that lie wholly inside the row, from
    ``chunk_start`` to ``chunk_end``, are loaded and stored whole; the row's elements in the partial chunks at its two
    ends go element by element (``edge_positions``). With ALIGN = 1 the positions are the columns and every element is
    a whole chunk. A row past the end (not ``valid``) has nothing to load or store."""
    shift = ((row * row_stride) % ALIGN).to(tl.int32)
    start = row * row_stride - shift
    chunk_start = (shift + ALIGN - 1) // ALIGN * ALIGN
    chunk_end = tl.where(valid, (n_cols + shift) // ALIGN * ALIGN, 0)
    if ALIGN > 1:  # what the compiler cannot see for itself (a hint of 1 would hide what it can)
        start = tl.multiple_of(start, ALIGN)
        chunk_start, chunk_end = tl.multiple_of(chunk_start, ALIGN), tl.multiple_of(chunk_end, ALIGN)
    return start, shift, chunk_start, chunk_end


@triton.jit
def edge_positions(shift, chunk_start, chunk_end, n_cols, owner, ALIGN: tl.constexpr):
    """The positions of a row's elements outside its whole chunks: the head chunk's (before ``chunk_start``) in the
    first ALIGN slots, the tail chunk's (from ``chunk_end``) in the next ALIGN. Only the ``owner`` program has them."""
    edge = tl.arange(0, 2 * ALIGN)
    tail_start = tl.maximum(chunk_end, chunk_start)
    positions = tl.where(edge < ALIGN, edge, tail_start + edge - ALIGN)
    in_edge = tl.where(edge < ALIGN, positions < chunk_start, positions >= tail_start)
    return positions, in_edge & (positions >= shift) & (positions < tl.where(owner, n_cols + shift, 0))


@triton.jit
def load_window(in_ptr, row, row_stride, col_stride, n_cols, valid, segment, piece, other, ALIGN: tl.constexpr):
    """Load one piece of a row where ``row_window`` places it, in the tensor's dtype: its whole chunks, which never
    reach into a neighbouring row, and, for the row's first program, the elements of the partial end chunks one by one
    (``other`` everywhere else)."""
    start, shift, chunk_start, chunk_end = row_window(row, row_stride, n_cols, valid, ALIGN)
    offsets = piece if ALIGN > 1 else piece * col_stride  # aligned windows have unit column strides
    values = tl.load(in_ptr + start + offsets, mask=(piece >= chunk_start) & (piece < chunk_end), other=other,
                     eviction_policy=KEEP_IN_L2)
    edge_values = tl.full((2 * ALIGN,), other, in_ptr.dtype.element_ty)
    if ALIGN > 1:
        edge, in_edge = edge_positions(shift, chunk_start, chunk_end, n_cols, valid & (segment == 0), ALIGN)
        edge_values = tl.load(in_ptr + start + edge, mask=in_edge, other=other, eviction_policy=KEEP_IN_L2)
    return values, edge_values


@triton.jit
def store_window(out_ptr, row, row_stride, n_cols, valid, segment, piece, values, edge_values,
                 ALIGN: tl.constexpr):
    """Store one piece of a row where ``row_window`` places it, as ``load_window`` loads it."""
    start, shift, chunk_start, chunk_end = row_window(row, row_stride, n_cols, valid, ALIGN)
    tl.store(out_ptr + start + piece, values, mask=(piece >= chunk_start) & (piece < chunk_end))
    if ALIGN > 1:
        edge, in_edge = edge_positions(shift, chunk_start, chunk_end, n_cols, valid & (segment == 0), ALIGN)
        tl.store(out_ptr + start + edge, edge_values, mask=in_edge)


@triton.jit
def finish_forward_piece(y_ptr, part_ptr, row, valid, y_row_stride, n_cols, segment, piece, parts, parity, x, x_edge,
                         SEGMENTS: tl.constexpr, ALIGN: tl.constexpr):
    """y for one piece of ``row``, kept as loaded: merge the row's (m, d) partials, then y = exp(x - m) / d."""
    m_parts, d_parts = unpack(read_partials(part_ptr, row, parts, SEGMENTS, valid, parity))
    m_parts = tl.where(parts < SEGMENTS, m_parts, float("-inf"))  # padding slots: the merge identity
    m_row = tl.max(m_parts, axis=0)
    d_row = tl.sum(d_parts * tl.exp2((m_parts - tl.where(m_row == float("-inf"), 0.0, m_row)) * LOG2E), axis=0)
    d_inverse = 1.0 / d_row
    store_window(y_ptr, row, y_row_stride, n_cols, valid, segment, piece,
                 tl.exp2((upcast_again(x) - m_row) * LOG2E) * d_inverse,
                 tl.exp2((upcast_again(x_edge) - m_row) * LOG2E) * d_inverse, ALIGN)


@triton.jit
def softmax_split_kernel(
    y_ptr, x_ptr, part_ptr, x_row_stride, x_col_stride, y_row_stride, n_rows, n_cols,
    SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    PHASE: tl.constexpr,
):
    """Forward for long rows: SEGMENTS consecutive programs share each row, one BLOCK_N piece each, and merge their
    (m, d) (notebook 05's merge) through ``part_ptr``: one packed word per piece, tagged with the call's parity, and
    one ticket counter after the last row's. Groups of SEGMENTS programs walk the rows grid-stride. ALIGN > 1 places
    the pieces on 16-byte boundaries (``row_window``; it needs unit column strides and equal row strides).

    Each piece stays in registers as loaded, and finishing computes exp(x - m) again with the row's m: a second
    exponential per element costs less than keeping e = exp(x - m_piece), fp32 and twice the registers of a 16-bit
    piece, for which fewer programs fit on the GPU (notebook 06). In one launch (PHASE 2) a program publishes row r,
    then finishes row r - 1 of its group, whose partials have had a whole iteration to arrive. (Finishing row r - 1
    before publishing row r, to overlap it with row r's loads, measured far slower: each program's partial then waits
    on its wait for the others, and the slack of one row is lost.)
    """
    tl.static_assert(x_ptr.dtype.element_ty != tl.float64, "fp64 partials do not fit a packed word: looped kernel")
    program, parity = take_ticket(part_ptr + n_rows * SEGMENTS, PHASE)
    segment = program % SEGMENTS
    group, n_groups = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    piece = segment * BLOCK_N + tl.arange(0, BLOCK_N)  # positions in the row (columns when ALIGN = 1)
    parts = tl.arange(0, SEGMENTS_POW2)
    x_prev = tl.zeros((BLOCK_N,), x_ptr.dtype.element_ty)
    x_edge_prev = tl.zeros((2 * ALIGN,), x_ptr.dtype.element_ty)
    # one iteration past the group's last row, so that in PHASE 2 the last row is finished too
    for row_index in range(group, n_rows + n_groups, n_groups):
        row = tl.cast(row_index, tl.int64)  # 64-bit offsets: row * stride can pass 2**31
        valid = row < n_rows
        # the piece's elements, and in the row's first program the end chunks' elements too: the partial covers both
        x, x_edge = load_window(x_ptr, row, x_row_stride, x_col_stride, n_cols, valid, segment, piece, float("-inf"),
                                ALIGN)
        if PHASE != FINISH:
            m = tl.maximum(tl.max(upcast(x), axis=0), tl.max(upcast(x_edge), axis=0))
            m_finite = tl.where(m == float("-inf"), 0.0, m)  # all -inf: partial (-inf, 0)
            # upcast_again: no fp32 copy of the piece stays live from the max to the exponentials
            d = (tl.sum(tl.exp2((upcast_again(x) - m_finite) * LOG2E), axis=0)
                 + tl.sum(tl.exp2((upcast_again(x_edge) - m_finite) * LOG2E), axis=0))
            tl.store(part_ptr + row * SEGMENTS + segment, pack(m, d, parity), mask=valid)
        if PHASE == FUSED:
            finish_forward_piece(y_ptr, part_ptr, tl.maximum(row - n_groups, 0), row >= group + n_groups,
                                 y_row_stride, n_cols, segment, piece, parts, parity, x_prev, x_edge_prev, SEGMENTS,
                                 ALIGN)
            x_prev, x_edge_prev = x, x_edge
        elif PHASE == FINISH:
            finish_forward_piece(y_ptr, part_ptr, row, valid, y_row_stride, n_cols, segment, piece, parts, parity, x,
                                 x_edge, SEGMENTS, ALIGN)


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


@triton.jit
def finish_backward_piece(dx_ptr, part_ptr, row, valid, dx_row_stride, n_cols, segment, piece, parts, parity, y, dy,
                          y_edge, dy_edge, SEGMENTS: tl.constexpr, ALIGN: tl.constexpr):
    """dx for one piece of ``row``, y and dy kept as loaded: the row's sum(y * dy) from its partials, then
    y * (dy - sum)."""
    dot_parts, _ = unpack(read_partials(part_ptr, row, parts, SEGMENTS, valid, parity))
    dot = tl.sum(tl.where(parts < SEGMENTS, dot_parts, 0.0), axis=0)
    store_window(dx_ptr, row, dx_row_stride, n_cols, valid, segment, piece,
                 upcast_again(y) * (upcast_again(dy) - dot), upcast_again(y_edge) * (upcast_again(dy_edge) - dot),
                 ALIGN)


@triton.jit
def softmax_backward_split_kernel(
    dx_ptr, y_ptr, dy_ptr, part_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_rows,
    n_cols, SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    PHASE: tl.constexpr,
):
    """Backward for long rows: SEGMENTS programs share a row and exchange only their part of sum(y * dy) (packed
    with a 0 that carries the tag), with the forward's row window and one-row-behind pipeline;
    pieces of y and dy stay as loaded until dx."""
    tl.static_assert(y_ptr.dtype.element_ty != tl.float64, "fp64 partials do not fit a packed word: looped kernel")
    program, parity = take_ticket(part_ptr + n_rows * SEGMENTS, PHASE)
    segment = program % SEGMENTS
    group, n_groups = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    piece = segment * BLOCK_N + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, SEGMENTS_POW2)
    y_prev = tl.zeros((BLOCK_N,), y_ptr.dtype.element_ty)
    dy_prev = tl.zeros((BLOCK_N,), dy_ptr.dtype.element_ty)
    y_edge_prev = tl.zeros((2 * ALIGN,), y_ptr.dtype.element_ty)
    dy_edge_prev = tl.zeros((2 * ALIGN,), dy_ptr.dtype.element_ty)
    for row_index in range(group, n_rows + n_groups, n_groups):
        row = tl.cast(row_index, tl.int64)
        valid = row < n_rows
        y, y_edge = load_window(y_ptr, row, y_row_stride, y_col_stride, n_cols, valid, segment, piece, 0.0, ALIGN)
        dy, dy_edge = load_window(dy_ptr, row, dy_row_stride, dy_col_stride, n_cols, valid, segment, piece, 0.0, ALIGN)
        if PHASE != FINISH:
            dot_piece = (tl.sum(upcast(y) * upcast(dy), axis=0)
                         + tl.sum(upcast(y_edge) * upcast(dy_edge), axis=0))
            tl.store(part_ptr + row * SEGMENTS + segment, pack(dot_piece, tl.zeros_like(dot_piece), parity),
                     mask=valid)
        if PHASE == FUSED:
            finish_backward_piece(dx_ptr, part_ptr, tl.maximum(row - n_groups, 0), row >= group + n_groups,
                                  dx_row_stride, n_cols, segment, piece, parts, parity, y_prev, dy_prev, y_edge_prev,
                                  dy_edge_prev, SEGMENTS, ALIGN)
            y_prev, dy_prev, y_edge_prev, dy_edge_prev = y, dy, y_edge, dy_edge
        elif PHASE == FINISH:
            finish_backward_piece(dx_ptr, part_ptr, row, valid, dx_row_stride, n_cols, segment, piece, parts, parity, y,
                                  dy, y_edge, dy_edge, SEGMENTS, ALIGN)


# ``kept_programs`` is a bound on program ids, which nothing gains from Triton specialising on its divisibility by 16
# (a compile per case; and torch 2.11's torch.compile misreads an argument so specialised under Triton 3.9).
@triton.jit(do_not_specialize=["kept_programs"])
def softmax_two_pass_kernel(
    y_ptr, x_ptr, m_ptr, d_ptr, x_row_stride, x_col_stride, y_row_stride, n_cols, chunks, chunk_blocks, kept_programs,
    CHUNKS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Forward for rows too long for a split's programs to be resident together, in two launches in which no program
    waits for another. ``chunks`` programs share a row, each taking every ``chunks``-th block of BLOCK_N (up to
    ``chunk_blocks`` of them), so that together they sweep the row from its start to its end. STATISTICS reduces each
    program's blocks to a partial (m, d): one max per block, the sum kept per lane and rescaled when the max rises
    (notebook 05). FINISH merges the row's partials and writes y = exp(x - m) / d, reading x again, in the opposite
    order: programs and blocks from the last, so the re-read starts where STATISTICS ended, in what L2 still holds.
    Only the last ``kept_programs`` programs' blocks are loaded to stay in L2; the rest pass through it."""
    program = tl.program_id(0)
    if PHASE == FINISH:
        program = tl.num_programs(0) - 1 - program
    row, chunk = (program // chunks).to(tl.int64), program % chunks
    x_row = x_ptr + row * x_row_stride
    block = tl.arange(0, BLOCK_N)
    if PHASE == STATISTICS:
        d = upcast(tl.zeros((BLOCK_N,), x_ptr.dtype.element_ty))  # per lane, in the compute dtype
        m = tl.max(d, axis=0) - float("inf")
        for i in range(chunk_blocks):
            cols = (i * chunks + chunk).to(tl.int64) * BLOCK_N + block  # 64-bit: a row can pass 2**31 elements
            if program >= tl.num_programs(0) - kept_programs:
                x = upcast(tl.load(x_row + cols * x_col_stride, mask=cols < n_cols, other=float("-inf"),
                                   eviction_policy=KEEP_IN_L2))
            else:
                x = upcast(tl.load(x_row + cols * x_col_stride, mask=cols < n_cols, other=float("-inf"),
                                   eviction_policy=PASS_THROUGH_L2))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: nothing to rescale
            d = d * tl.exp2((m - m_shift) * LOG2E) + tl.exp2((x - m_shift) * LOG2E)
            m = m_new
        tl.store(m_ptr + program, m)
        tl.store(d_ptr + program, tl.sum(d, axis=0))
    else:
        parts = tl.arange(0, CHUNKS_POW2)
        m_parts = tl.load(m_ptr + row * chunks + parts, mask=parts < chunks, other=float("-inf"))
        d_parts = tl.load(d_ptr + row * chunks + parts, mask=parts < chunks, other=0.0)
        m_row = tl.max(m_parts, axis=0)
        d_row = tl.sum(d_parts * tl.exp2((m_parts - tl.where(m_row == float("-inf"), 0.0, m_row)) * LOG2E), axis=0)
        d_inverse = 1.0 / d_row
        for i_from_end in range(chunk_blocks):
            cols = ((chunk_blocks - 1 - i_from_end) * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            x = upcast(tl.load(x_row + cols * x_col_stride, mask=mask, other=float("-inf"),
                               eviction_policy=KEEP_IN_L2))
            tl.store(y_ptr + row * y_row_stride + cols, tl.exp2((x - m_row) * LOG2E) * d_inverse, mask=mask,
                     cache_modifier=STREAMING)


@triton.jit(do_not_specialize=["kept_programs"])
def softmax_backward_two_pass_kernel(
    dx_ptr, y_ptr, dy_ptr, dot_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_cols,
    chunks, chunk_blocks, kept_programs, CHUNKS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Backward in two launches, swept and cached like the forward: STATISTICS sums y * dy over a program's blocks,
    FINISH adds up the row's sums and writes dx = y * (dy - sum), in the opposite order."""
    program = tl.program_id(0)
    if PHASE == FINISH:
        program = tl.num_programs(0) - 1 - program
    row, chunk = (program // chunks).to(tl.int64), program % chunks
    y_row, dy_row = y_ptr + row * y_row_stride, dy_ptr + row * dy_row_stride
    block = tl.arange(0, BLOCK_N)
    if PHASE == STATISTICS:
        zeros = tl.zeros((BLOCK_N,), tl.float32)
        dot = upcast(zeros.to(y_ptr.dtype.element_ty)) * upcast(zeros.to(dy_ptr.dtype.element_ty))  # fp64 if either is
        for i in range(chunk_blocks):
            cols = (i * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            if program >= tl.num_programs(0) - kept_programs:
                y = tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
                dy = tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
            else:
                y = tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=PASS_THROUGH_L2)
                dy = tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=PASS_THROUGH_L2)
            dot += upcast(y) * upcast(dy)
        tl.store(dot_ptr + program, tl.sum(dot, axis=0))
    else:
        parts = tl.arange(0, CHUNKS_POW2)
        dot = tl.sum(tl.load(dot_ptr + row * chunks + parts, mask=parts < chunks, other=0.0), axis=0)
        for i_from_end in range(chunk_blocks):
            cols = ((chunk_blocks - 1 - i_from_end) * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            y = upcast(tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2))
            dy = upcast(tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2))
            tl.store(dx_ptr + row * dx_row_stride + cols, y * (dy - dot), mask=mask, cache_modifier=STREAMING)


# ---------------------------------------------------------------------------------------------------------------------
# Choosing a kernel and its shape for a row length, and sizing the persistent grid.


@dataclass(frozen=True)
class Plan:
    """How rows of one length are cut: ``segments`` programs per row (1: tile kernel) of ``block_n`` elements,
    ``rows`` rows per tile, ``num_warps`` warps per program, and whether a tile kernel runs a persistent grid (a split
    always does: its programs must all be resident) or one program per tile. A split places its pieces on 16-byte
    boundaries when ``align`` > 1 (elements per 16 bytes) and the tensors' layout allows it."""

    rows: int
    block_n: int
    segments: int
    num_warps: int
    persistent: bool = False
    align: int = 1


# The shapes below are read off the tuning sweep (``python -m helpers.tune``, results/*-tuning.csv; notebook 06) and
# side-by-side timings on the H100 (notebook 06 quotes them), choosing shapes that are good everywhere over ones that
# are best at one row length and fall off a cliff at another.
TILE_ELEMENTS = 1024  # short rows: whole rows per program until a tile holds this many elements
ELEMENTS_PER_THREAD = 16  # tile kernels: warps = elements / (32 * this), 1 to 16 ...
WIDEST_TILE = 32768  # ... and 32 for a tile this wide (16-bit forward: ahead of 16 with tl.exp, level since exp2)
# Rows up to ALWAYS_TILE_ROW take a whole-row tile, rows past MAX_TILE_ROW are split across programs, and between
# the two it depends (``takes_tile``).
ALWAYS_TILE_ROW = 16384
MAX_TILE_ROW = 32768
SEGMENT_ELEMENTS = 2048  # the piece of a long row each program of a split holds ...
WIDE_SEGMENT_ELEMENTS = 4096  # ... or, in 16 bits and in the fp32 forward, a piece twice as wide (``plan_for``)


def takes_tile(n_cols: int, phase: str, element_size: int) -> bool:
    """Whether rows of ``n_cols`` take a whole-row tile rather than a split, as measured on the H100 (notebook 06;
    results/*h100*-tuning-*.csv). Between ALWAYS_TILE_ROW and MAX_TILE_ROW, a tile of 32 warps:

    - wins where it loads 16 bytes at a time (rows a multiple of 16 long); one element per load takes more registers,
      and the tile falls behind or spills;
    - in the backward holds two rows, y and dy: in fp32 they spill, in 16 bits they fit (``upcast_again``);
    - in a 16-bit forward, only a row that fills it moves enough bytes per program (bf16, the best tile against the
      best split: 0.96 against 0.92 of copy at N = 32768, 0.77 against 0.91 at N = 20000). The H200 prefers the
      split even at 32768 (0.71 against 0.79 in a run with tl.exp): the H100 is the target.
    """
    block = triton.next_power_of_2(n_cols)
    if block <= ALWAYS_TILE_ROW:
        return True
    if block > MAX_TILE_ROW:
        return False
    if phase == "forward" and element_size == 2:
        return n_cols == block
    if phase == "backward" and element_size > 2:
        return False
    return n_cols % 16 == 0


def plan_for(n_cols: int, phase: str, element_size: int = 4, wide_pieces: bool = True) -> Plan:
    """The kernel shape for rows of ``n_cols`` elements of ``element_size`` bytes in ``phase``. ``wide_pieces=False``:
    splits keep pieces of SEGMENT_ELEMENTS (the launch falls back to them where a compiler gives the wide piece more
    registers than REGISTER_BUDGET).

    The shape is compiled into the kernel, so a symbolic row length (torch.compile's dynamic shapes) is made concrete
    here: the compiled graph is then specialised to it."""
    n_cols = int(n_cols)
    block = triton.next_power_of_2(n_cols)
    if takes_tile(n_cols, phase, element_size):
        rows = max(1, TILE_ELEMENTS // block)
        warps = 32 if rows * block >= WIDEST_TILE else max(1, min(16, rows * block // (32 * ELEMENTS_PER_THREAD)))
        return Plan(rows, block, 1, warps)
    # Rows of a length Triton cannot see is a multiple of 16 start off 16-byte boundaries; aligned pieces (a window up
    # to ALIGN - 1 elements wider than the row, ``row_window``) load 16 bytes at a time again. At N = 50257 on the
    # H100 that lifts the 16-bit backward from 0.84 to 0.96 of copy, the 16-bit forward from 0.78 to 0.90, fp32 by
    # 0.01-0.02 (the best shapes of each kind in results/*h100*-tuning-32768-50257.csv).
    align = 16 // element_size if n_cols % 16 else 1
    # Wide pieces, of WIDE_SEGMENT_ELEMENTS:
    # - 16-bit pieces are kept as loaded, half the registers of fp32 ones, so long 16-bit rows take pieces of twice
    #   the elements: the same bytes per program as fp32 (H100, bf16, N = 131072 to 262144: forward 0.92-0.94 of copy
    #   against 0.91-0.92, backward 0.97-0.98 against 0.96-0.97; at 50257 the wider pieces lose);
    # - fp32 forward rows past MAX_TILE_ROW, with 4 warps (H100, N = 50257 to 262144: 0.96-0.99 of copy against
    #   0.94-0.98 with pieces of 2048; results/nvidia-h100-80gb-hbm3-split-forward.md).
    if element_size == 2:
        wide = wide_pieces and n_cols >= 32 * WIDE_SEGMENT_ELEMENTS
    else:
        wide = wide_pieces and element_size == 4 and phase == "forward" and n_cols > MAX_TILE_ROW
    block_n = WIDE_SEGMENT_ELEMENTS if wide else SEGMENT_ELEMENTS
    segments = triton.cdiv(n_cols + align - 1, block_n)
    # Narrow fp32 forward pieces take 2 warps while a row has fewer than 32 pieces (fp32 N = 50257: 0.93 of copy
    # against 0.91 with 4 warps on the H100, 0.88 against 0.84 on the H200; from 32 pieces on, 4 warps win by
    # 0.15-0.2). 16-bit forward pieces take 1 warp, 2 when wide (H100, bf16 N = 50257: 0.90 against 0.89 with 2;
    # N = 30001: 0.88 against 0.86). 16-bit backward pieces take 2 warps (H100, N = 32768 to 262144: 0.94-0.96
    # against 0.90-0.94 with 4; aligned at N = 50257: 0.92 against 0.90), 4 when wide.
    if phase == "forward":
        warps = (2 if wide else 1) if element_size == 2 else (4 if wide or segments >= 32 else 2)
    else:
        warps = 2 if element_size == 2 and not wide else 4
    return Plan(1, block_n, segments, warps, persistent=True, align=align)


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def resident_programs(compiled, num_warps: int, device: int) -> int:
    """How many programs of a compiled kernel the whole GPU holds at once, as the CUDA driver's occupancy calculator
    counts them from its registers, threads and shared memory (with their allocation granularities and the shared
    memory each program reserves: a count of our own once came out one program per SM too high)."""
    compiled._init_handles()  # loads the binary, which fills in the function handle
    per_sm = ctypes.c_int()
    status = _cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(per_sm), ctypes.c_void_p(compiled.function), ctypes.c_int(32 * num_warps),
        ctypes.c_size_t(compiled.metadata.shared))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm.value


@dataclass(frozen=True)
class Resources:
    """What a compiled kernel takes: registers per thread, spilled registers, and programs resident on the GPU."""

    registers: int
    spills: int
    resident: int


CPU_PROGRAMS = 4  # under the interpreter: a small persistent grid, so every kernel's loop runs several times
# Triton's interpreter counts as a GPU that holds this many programs, so that on CPU long rows take the two-pass
# kernels as a small GPU would
CPU_RESIDENT_PROGRAMS = 64
REGISTER_BUDGET = 128  # per thread: 16 one-warp programs (8 two-warp ones) fit an SM's 65536 registers
_resources_cache: dict[tuple, Resources] = {}


def compiled_resources(kernel, args, constexprs, num_warps: int, device: torch.device) -> Resources:
    """The registers, spills and residency of ``kernel`` as compiled for these arguments, read off the compiled
    kernel on the GPU: they change with the Triton version (a piece of 141 registers on one, 128 on another)."""
    if INTERPRET:
        return Resources(0, 0, CPU_RESIDENT_PROGRAMS)
    # Compiled for the dtypes alone (no data pointers: under torch.compile the tensors are FakeTensors), with the
    # integers' specialisations (== 1, multiple of 16) kept: a unit column stride changes the code the most.
    signature = [a.dtype if isinstance(a, torch.Tensor) else a if isinstance(a, torch.dtype) else int(a) for a in args]
    key = (kernel.fn.__name__, num_warps, device.index, *sorted(constexprs.items()),
           *(a if isinstance(a, torch.dtype) else (a == 1, a % 16 == 0) for a in signature))
    if key not in _resources_cache:
        compiled = kernel.warmup(*signature, **constexprs, num_warps=num_warps, grid=(1,))
        resident = resident_programs(compiled, num_warps, device.index or 0)
        _resources_cache[key] = Resources(compiled.n_regs, compiled.n_spills, resident)
    return _resources_cache[key]


def most_resident(num_warps: int, device: torch.device) -> int:
    """The most programs of ``num_warps`` warps the GPU can hold at once, whatever they take of registers and shared
    memory: its threads per SM (2048 on an H100, 1024 on a T4) over a program's, times its SMs."""
    if INTERPRET:
        return CPU_RESIDENT_PROGRAMS
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count * (properties.max_threads_per_multi_processor // (32 * num_warps))


# A split waits only for programs that are resident beside it, with room to spare: the kernel a launch runs can be
# built with more registers than the one counted (another alignment, torch.compile's own build).
RESIDENCY_MARGIN = 2


def split_grid(segments: int, n_rows: int, resident: int) -> int:
    """Programs to launch for a split of ``segments`` programs per row on a GPU that holds ``resident`` of them at once:
    whole groups of a row's programs, at most one group per row and no more than the GPU holds. 0 when a group does
    not fit RESIDENCY_MARGIN times over: those rows take the two-pass kernels. A wait is then always for a program that
    is running or can start (programs take their place in start order, ``take_ticket``)."""
    if segments * RESIDENCY_MARGIN > resident:
        return 0
    return segments * min(n_rows, resident // segments)


# ---------------------------------------------------------------------------------------------------------------------
# Launching. What a call launches (kernels, grids, scratch buffers) depends only on its tensors' layout, so it is worked
# out once per layout into a Recipe and cached. A repeat call then launches the compiled kernels directly on scratch
# buffers it keeps: no planning, no allocation, and none of the argument binding Triton's JIT redoes on every call.


@dataclass(frozen=True)
class Buffer:
    """A call's scratch tensor: ``numel`` elements of ``dtype``, filled with ``fill`` (None: left uninitialised)."""

    numel: int
    dtype: torch.dtype
    fill: int | None = None

    def allocate(self, device: torch.device) -> torch.Tensor:
        if self.fill is None:
            return torch.empty(self.numel, dtype=self.dtype, device=device)
        return torch.full((self.numel,), self.fill, dtype=self.dtype, device=device)


@dataclass
class Step:
    """One launch of a call: ``kernel`` on ``grid`` programs. Its arguments are the call's tensors (its operands, then
    its buffers), then the integers ``ints``, then ``constexprs``."""

    kernel: triton.runtime.JITFunction
    grid: int
    ints: tuple
    constexprs: dict
    num_warps: int
    direct: object = None  # once prepared: a function of (addresses, stream) that launches (``_direct_launch``)

    def run(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Launch through ``kernels.launch``: traced tensors, or the interpreter."""
        launch(self.kernel, (self.grid,), *tensors, *self.ints, **self.constexprs, num_warps=self.num_warps)

    def prepare(self, tensors: tuple[torch.Tensor, ...]):
        """Compile for ``tensors`` (or find the kernel in Triton's cache) and make ``direct``."""
        compiled = self.kernel.warmup(*tensors, *self.ints, **self.constexprs, grid=(self.grid,),
                                      num_warps=self.num_warps)
        compiled[(self.grid, 1, 1)]  # loads the module: the kernel's function handle and launcher
        constants = tuple(self.constexprs[name] for name in self.kernel.arg_names[len(tensors) + len(self.ints):])
        self.direct = _direct_launch(compiled, self.grid, (*self.ints, *constants))
        return self.direct


def _direct_launch(compiled, grid: int, scalars: tuple):
    """A function of (addresses, stream) that launches ``compiled`` on ``grid`` programs, the addresses then
    ``scalars`` as its arguments: its C launch called as Triton's launcher calls it, without the launcher's Python
    (0.9-2.3 us a call on the H100's host; Triton's launch hooks are not called). The C launch's arguments differ by
    Triton version: from 3.7 the kernel's arguments come as a tuple with their signature, in 3.5 and 3.6 spread after
    the scratch buffers. Other versions, and kernels that need scratch memory, go through the launcher."""
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    c_launch = launcher.launch
    needs_scratch = launcher.global_scratch_size or getattr(launcher, "profile_scratch_size", 0)
    if needs_scratch or getattr(launcher, "gsan_enabled", False) or not hasattr(launcher, "profile_scratch_size"):
        return lambda pointers, stream: launcher(grid, 1, 1, stream, function, metadata, None, None, None, *pointers,
                                                 *scalars)
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    if hasattr(launcher, "kernel_signature"):
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature
        return lambda pointers, stream: c_launch(grid, 1, 1, stream, function, cooperative, pdl, metadata, None, None,
                                                 None, None, None, annotations, signature, (*pointers, *scalars))
    return lambda pointers, stream: c_launch(grid, 1, 1, stream, function, cooperative, pdl, None, None, metadata, None,
                                             None, None, *pointers, *scalars)


# Scratch buffers up to this size are kept by their recipe from call to call, one set per CUDA stream: a call then
# allocates nothing but its output. Larger ones come with calls long enough on the GPU that the host's time is hidden.
KEPT_BUFFER_BYTES = 1 << 20
LAUNCH_DIRECTLY = DEVICE.type == "cuda" and not INTERPRET  # compiled kernels on torch's CUDA stream (else: the JIT)
_current_stream = torch._C._cuda_getCurrentRawStream if LAUNCH_DIRECTLY else None  # torch's, on a device index
_capturing = torch._C._cuda_isCurrentStreamCapturing if LAUNCH_DIRECTLY else None


@dataclass
class Recipe:
    """Everything one call launches: its scratch buffers, and its steps in order."""

    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    kept: dict = field(default_factory=dict)  # stream -> this recipe's buffers on it, and their addresses

    def run(self, operands: tuple[torch.Tensor, ...]) -> None:
        """Launch every step on ``operands`` through ``kernels.launch``, on fresh buffers."""
        tensors = (*operands, *[buffer.allocate(operands[0].device) for buffer in self.buffers])
        for step in self.steps:
            step.run(tensors)

    def launch(self, operands: tuple[torch.Tensor, ...], pointers: tuple | list, device: int) -> None:
        """Launch every step directly on the current stream of GPU ``device``, handed the operands' addresses.

        A kept exchange buffer is ready for the next call as the kernels leave it (its tags), and calls on one stream
        run one after another. A call being captured into a CUDA graph takes buffers of its own, whose fill the graph
        replays: the graph may later run on another stream, beside calls on this one. Without a GPU: ``run``."""
        if not LAUNCH_DIRECTLY:
            self.run(operands)
            return
        stream = _current_stream(device)
        buffers = ()
        if self.buffers:
            if stream and _capturing():  # stream 0, CUDA's legacy default stream, cannot be captured
                buffers, buffer_pointers = self._allocate(operands[0].device, None)
            else:
                buffers, buffer_pointers = self.kept.get(stream) or self._allocate(operands[0].device, stream)
            pointers = (*pointers, *buffer_pointers)
        for step in self.steps:
            (step.direct or step.prepare((*operands, *buffers)))(pointers, stream)

    def _allocate(self, device: torch.device, stream: int | None) -> tuple:
        """Fresh buffers and their addresses, kept for ``stream`` if it is not None and they are small."""
        buffers = tuple(buffer.allocate(device) for buffer in self.buffers)
        allocated = buffers, tuple(buffer.data_ptr() for buffer in buffers)
        kept_bytes = sum(buffer.numel() * buffer.element_size() for buffer in buffers)
        if stream is not None and kept_bytes <= KEPT_BUFFER_BYTES:
            self.kept[stream] = allocated
        return allocated


_recipes: dict[tuple, Recipe] = {}
MAX_RECIPES = 4096  # layouts remembered before the cache starts over


def recipe_for(build, operands: tuple[torch.Tensor, ...], plan: Plan | int | None = None) -> Recipe:
    """``build(*operands, plan)``, cached per layout: shape, device, and each tensor's strides, dtype and whether it
    starts on 16 bytes (the compiled kernels are specialised on it). Traced tensors, whose sizes can be symbolic, are
    planned afresh: torch.compile traces a call once. (The column kernels pass their dim as ``plan``.)"""
    if not plain(operands):
        return build(*operands, plan)
    key = [build, plan, operands[0].shape, operands[0].get_device()]
    for t in operands:
        key += t.stride(), t.dtype, t.data_ptr() % 16 == 0
    key = tuple(key)
    recipe = _recipes.get(key)
    if recipe is None:
        if len(_recipes) >= MAX_RECIPES:
            _recipes.clear()
        recipe = _recipes[key] = build(*operands, plan)
    return recipe


def plain(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether every tensor is a torch.Tensor, not a subclass (a traced FakeTensor, ...)."""
    for t in tensors:  # a loop: cheaper than all() over a generator
        if type(t) is not torch.Tensor:
            return False
    return True


def run(build, operands: tuple[torch.Tensor, ...], plan: Plan | int | None) -> None:
    """Launch ``build``'s recipe for ``operands`` (``recipe_for``)."""
    recipe = recipe_for(build, operands, plan)
    if plain(operands):
        recipe.launch(operands, [t.data_ptr() for t in operands], operands[0].get_device())
    else:
        recipe.run(operands)


def launch_forward(x: torch.Tensor, y: torch.Tensor, plan: Plan | None = None) -> None:
    """Softmax of the rows of the 2-D ``x`` into the contiguous 2-D ``y`` with the fused kernels."""
    run(forward_recipe, (y, x), plan)


def launch_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, plan: Plan | None = None) -> None:
    """dx of the rows of the 2-D ``y`` and ``dy`` into the contiguous 2-D ``dx`` with the fused kernels."""
    run(backward_recipe, (dx, y, dy), plan)


# Few rows over a long row (sampling and decode: a handful of rows over a vocabulary) leave the default plan few
# programs, and a call then lasts as long as one program's loads. Pieces of FEW_ROWS_PIECE elements put more programs
# to work, up to FEW_PROGRAMS in all. On the H100, rows of 20000 to 262144 elements, 1 to 8 of them, GPU time per call
# (results/nvidia-h100-80gb-hbm3-few-rows.csv; every piece and warp count in *-decode-plans.csv):
# - forward and 16-bit backward: 6.1-8.4 us against 6.8-9.5 us with the default plan, 0.8 us less on average; 3 of 33
#   points slower, by at most 0.5 us (noise between runs is about that);
# - fp32 backward: no gain (5 of 11 points slower, by up to 0.8 us), so it keeps the default plan;
# - more programs than FEW_PROGRAMS lose: 32 and 64 rows of 20000 and 32000 took up to 2.4 us longer.
FEW_PROGRAMS = 256
FEW_ROWS_PIECE = 1024
FEW_ROWS_WARPS = 4


def few_rows_plan(n_rows: int, n_cols: int, phase: str, element_size: int) -> Plan | None:
    """A split of FEW_ROWS_PIECE pieces for ``n_rows`` rows past ALWAYS_TILE_ROW elements, if it gives them more pieces
    than the default plan and at most FEW_PROGRAMS in all; else None. Not for the fp32 backward. A symbolic row length
    is made concrete, as in ``plan_for``; a symbolic row count is only compared (torch.compile guards on the result)."""
    n_cols = int(n_cols)
    if n_cols <= ALWAYS_TILE_ROW or (phase == "backward" and element_size > 2):
        return None
    align = 16 // element_size if n_cols % 16 else 1
    segments = triton.cdiv(n_cols + align - 1, FEW_ROWS_PIECE)
    if n_rows * segments > FEW_PROGRAMS or segments <= plan_for(n_cols, phase, element_size).segments:
        return None
    return Plan(1, FEW_ROWS_PIECE, segments, FEW_ROWS_WARPS, persistent=True, align=align)


def forward_recipe(y: torch.Tensor, x: torch.Tensor, plan: Plan | None) -> Recipe:
    n_rows, n_cols = x.shape
    ints = (x.stride(0), x.stride(1), y.stride(0), n_rows, n_cols)
    few = plan is None and x.dtype != torch.float64 and few_rows_plan(n_rows, n_cols, "forward", x.element_size())
    if few and (recipe := _split_recipe(softmax_split_kernel, (y, x), ints, few)) is not None:
        return recipe  # else its pieces do not fit the GPU together: the default plan's may
    plan = plan or plan_for(n_cols, "forward", x.element_size())
    if plan.segments == 1:
        return _tile_recipe(softmax_tile_kernel, (y, x), ints, plan)
    if x.dtype != torch.float64:  # fp64 partials do not fit a packed word
        recipe = _split_recipe(softmax_split_kernel, (y, x), ints, plan)
        if recipe is not None:
            return recipe
    return _two_pass_recipe(softmax_two_pass_kernel, (y, x), ints[:3], n_rows, n_cols, partials=2)


def backward_recipe(dx: torch.Tensor, y: torch.Tensor, dy: torch.Tensor, plan: Plan | None) -> Recipe:
    n_rows, n_cols = y.shape
    ints = (y.stride(0), y.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), n_rows, n_cols)
    few = (plan is None and torch.float64 not in (y.dtype, dy.dtype)
           and few_rows_plan(n_rows, n_cols, "backward", y.element_size()))
    if few and (recipe := _split_recipe(softmax_backward_split_kernel, (dx, y, dy), ints, few)) is not None:
        return recipe
    plan = plan or plan_for(n_cols, "backward", y.element_size())
    if plan.segments == 1:
        return _tile_recipe(softmax_backward_tile_kernel, (dx, y, dy), ints, plan)
    if torch.float64 not in (y.dtype, dy.dtype):
        recipe = _split_recipe(softmax_backward_split_kernel, (dx, y, dy), ints, plan)
        if recipe is not None:
            return recipe
    return _two_pass_recipe(softmax_backward_two_pass_kernel, (dx, y, dy), ints[:5], n_rows, n_cols, partials=1)


def _tile_recipe(kernel, operands: tuple[torch.Tensor, ...], ints: tuple, plan: Plan) -> Recipe:
    n_rows = ints[-2]
    constexprs = dict(ROWS=plan.rows, BLOCK_N=plan.block_n)
    tiles = triton.cdiv(n_rows, plan.rows)
    if INTERPRET:
        grid = min(tiles, CPU_PROGRAMS)
    elif plan.persistent:
        resources = compiled_resources(kernel, (*operands, *ints), constexprs, plan.num_warps, operands[0].device)
        grid = min(tiles, resources.resident)
    else:
        grid = tiles
    return Recipe((), (Step(kernel, grid, ints, constexprs, plan.num_warps),))


PARTIALS = torch.int64  # a split's exchange buffer in its arguments before it is allocated: its dtype


def _align(plan: Plan, *tensors: torch.Tensor) -> int:
    """A split's ALIGN: the plan's, when all the tensors have one element size, unit column strides, one row stride
    (so one window fits every row of every tensor) and start on 16 bytes, so that a multiple of ALIGN elements from a
    tensor's start is a 16-byte boundary in memory; else 1."""
    row_stride, size = tensors[0].stride(0), tensors[0].element_size()
    fits = all(t.element_size() == size and t.stride(1) == 1 and t.stride(0) == row_stride and _on_16_bytes(t)
               for t in tensors)
    return plan.align if fits else 1


def _on_16_bytes(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:
        return t.data_ptr() % 16 == 0
    return t.storage_offset() * t.element_size() % 16 == 0  # traced: where it starts in storage (allocations do)


def needs_narrow_pieces(plan: Plan, registers: int, spills: int) -> bool:
    """Whether a split of wide pieces compiled to more than REGISTER_BUDGET registers a thread, or spilled (as it can
    with another Triton version): then it takes pieces of SEGMENT_ELEMENTS, which fit."""
    return plan.block_n == WIDE_SEGMENT_ELEMENTS and (registers > REGISTER_BUDGET or spills > 0)


def _split_recipe(kernel, operands: tuple[torch.Tensor, ...], ints: tuple, plan: Plan) -> Recipe | None:
    """A split, if a row's programs can be resident together (``exchange_recipe``); None if not."""
    n_rows, n_cols = ints[-2:]
    device = operands[0].device
    align = _align(plan, *operands)

    def constexprs_for(plan):
        return dict(SEGMENTS=plan.segments, SEGMENTS_POW2=triton.next_power_of_2(plan.segments), BLOCK_N=plan.block_n,
                    ALIGN=align, PHASE=FUSED.value)

    if split_grid(plan.segments, n_rows, most_resident(plan.num_warps, device)) == 0:
        return None  # more pieces than the GPU could ever hold: no need to compile the split to know
    args = (*operands, PARTIALS, *ints)
    resources = compiled_resources(kernel, args, constexprs_for(plan), plan.num_warps, device)
    if needs_narrow_pieces(plan, resources.registers, resources.spills):
        phase = "forward" if kernel is softmax_split_kernel else "backward"
        plan = plan_for(n_cols, phase, operands[1].element_size(), wide_pieces=False)
        resources = compiled_resources(kernel, args, constexprs_for(plan), plan.num_warps, device)
    return exchange_recipe(kernel, ints, constexprs_for(plan), plan.num_warps, plan.segments, n_rows, plan.segments,
                           resources.resident)


def exchange_recipe(kernel, ints: tuple, constexprs: dict, num_warps: int, segments: int, n_groups: int,
                    group_slots: int, resident: int) -> Recipe | None:
    """The launch of a kernel whose groups of ``segments`` programs exchange partials (a split row, or a split block
    of columns), or None if a group's programs cannot be resident together on a GPU that holds ``resident`` of them
    (``split_grid``). Its exchange buffer, ``group_slots`` EMPTY slots per group and the ticket counter after them
    (also EMPTY, -1), follows the operands in the kernel's arguments."""
    grid = split_grid(segments, n_groups, resident)
    if grid == 0:
        return None
    if INTERPRET:  # programs run one after another, where a wait would never end: two launches instead
        grid = segments * min(n_groups, CPU_PROGRAMS, grid // segments)
        phases = (STATISTICS, FINISH)
    else:
        phases = (FUSED,)
    partials = Buffer(n_groups * group_slots + 1, torch.int64, EMPTY.value)
    # PHASE as a plain int: torch.compile writes the launch out as Python source
    return Recipe((partials,), tuple(Step(kernel, grid, ints, dict(constexprs, PHASE=phase.value), num_warps)
                                     for phase in phases))


# The two-pass kernels share a row among at most MAX_CHUNKS programs, each taking blocks of TWO_PASS_BLOCK_BYTES with
# TWO_PASS_WARPS warps: the best of 2 block sizes, 2 warp counts and 2 chunk limits on the H100 for single rows of
# 2**22 + 3 and 2**24 elements, fp32 and bf16 (results/nvidia-h100-80gb-hbm3-long-rows-tuning.md).
TWO_PASS_BLOCK_BYTES = 16384
MAX_CHUNKS = 2048
TWO_PASS_WARPS = 8


def two_pass_chunks(n_cols: int, element_size: int) -> tuple[int, int, int]:
    """(block elements, chunks per row, blocks per chunk) of the two-pass kernels for rows of ``n_cols``."""
    block_n = TWO_PASS_BLOCK_BYTES // element_size
    blocks = triton.cdiv(n_cols, block_n)
    chunk_blocks = triton.cdiv(blocks, MAX_CHUNKS)
    return block_n, triton.cdiv(blocks, chunk_blocks), chunk_blocks


# How much of L2 the statistics launch asks to keep for the finish: the blocks its last programs read, which the finish
# reads first. Keeping everything keeps nothing once a row outgrows L2 (each new line evicts one still to be re-read);
# on the H100 (50 MB), of 0, 1/4, 1/3, 1/2, 2/3 and everything, a half was best or level with the best at one row of
# 2**24 elements (fp32 forward 0.67 of copy keeping everything, 0.70 a half; bf16 0.66 and 0.70) and two rows of 2**22
# (fp32 backward 0.66 and 0.70), and changed nothing at 2**22 + 3 and 2**27 (results/*-long-rows-tuning.md).
KEPT_L2_FRACTION = 1 / 2


def _two_pass_recipe(kernel, operands: tuple[torch.Tensor, ...], strides: tuple, n_rows: int, n_cols: int,
                     partials: int) -> Recipe:
    """STATISTICS then FINISH, sharing ``partials`` buffers of one partial per chunk, in the compute dtype (fp64 where
    an operand is fp64, else fp32); they follow the operands in the kernel's arguments."""
    block_n, chunks, chunk_blocks = two_pass_chunks(n_cols, operands[1].element_size())
    l2_bytes = 0 if INTERPRET else torch.cuda.get_device_properties(operands[0].device).L2_cache_size
    bytes_per_program = chunk_blocks * TWO_PASS_BLOCK_BYTES * (len(operands) - 1)  # x, or y and dy
    kept_programs = int(l2_bytes * KEPT_L2_FRACTION) // bytes_per_program
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in operands) else torch.float32
    buffers = tuple(Buffer(n_rows * chunks, dtype) for _ in range(partials))
    return Recipe(buffers, tuple(
        Step(kernel, n_rows * chunks, (*strides, n_cols, chunks, chunk_blocks, kept_programs),
             dict(CHUNKS_POW2=triton.next_power_of_2(chunks), BLOCK_N=block_n, PHASE=phase.value), TWO_PASS_WARPS)
        for phase in (STATISTICS, FINISH)))
