"""Split rows (notebook 06): a row too long for one program is cut into ``SEGMENTS`` pieces held by as many programs,
which exchange their partials (``exchange``), so each piece is read once and stays in registers until it is written.
Pieces sit on 16-byte boundaries even where rows do not (``row_window``), and programs take rows as they come for
them (``claim_row``)."""

import triton
import triton.language as tl

from .exchange import FINISH, FUSED, pack, read_partials, take_ticket, unpack
from .kernels import upcast
from .tiles import KEEP_IN_L2, LOG2E, upcast_again


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
def in_piece(piece, chunk_start, chunk_end, PIECE: tl.constexpr):
    """Which of a piece's positions to load and store: those of the window's whole chunks, and of the piece's PIECE
    (``plans.piece_length``) where that is fewer than its BLOCK_N lanes."""
    mask = (piece >= chunk_start) & (piece < chunk_end)
    if PIECE < piece.shape[0]:
        mask &= tl.arange(0, piece.shape[0]) < PIECE
    return mask


@triton.jit
def load_window(in_ptr, row, row_stride, col_stride, n_cols, valid, segment, piece, other, ALIGN: tl.constexpr,
                PIECE: tl.constexpr):
    """Load one piece of a row where ``row_window`` places it, in the tensor's dtype: its whole chunks, which never
    reach into a neighbouring row, and, for the row's first program, the elements of the partial end chunks one by one
    (``other`` everywhere else)."""
    start, shift, chunk_start, chunk_end = row_window(row, row_stride, n_cols, valid, ALIGN)
    offsets = piece if ALIGN > 1 else piece * col_stride  # aligned windows have unit column strides
    values = tl.load(in_ptr + start + offsets, mask=in_piece(piece, chunk_start, chunk_end, PIECE), other=other,
                     eviction_policy=KEEP_IN_L2)
    edge_values = tl.full((2 * ALIGN,), other, in_ptr.dtype.element_ty)
    if ALIGN > 1:
        edge, in_edge = edge_positions(shift, chunk_start, chunk_end, n_cols, valid & (segment == 0), ALIGN)
        edge_values = tl.load(in_ptr + start + edge, mask=in_edge, other=other, eviction_policy=KEEP_IN_L2)
    return values, edge_values


@triton.jit
def store_window(out_ptr, row, row_stride, n_cols, valid, segment, piece, values, edge_values,
                 ALIGN: tl.constexpr, PIECE: tl.constexpr):
    """Store one piece of a row where ``row_window`` places it, as ``load_window`` loads it."""
    start, shift, chunk_start, chunk_end = row_window(row, row_stride, n_cols, valid, ALIGN)
    tl.store(out_ptr + start + piece, values, mask=in_piece(piece, chunk_start, chunk_end, PIECE))
    if ALIGN > 1:
        edge, in_edge = edge_positions(shift, chunk_start, chunk_end, n_cols, valid & (segment == 0), ALIGN)
        tl.store(out_ptr + start + edge, edge_values, mask=in_edge)


@triton.jit
def claim_row(counter_ptr, first_claim, programs, n_rows, claiming):
    """The next row a program of a split takes. A segment's ``programs`` programs (those holding piece s of a row)
    start on rows 0 to ``programs`` - 1, program j on row j, with no wait; the segment's counter hands out the rows
    after those in order, one to each program that asks: a program that is done early takes the next row instead of
    waiting for its turn, so no program idles while others finish their share. The counter counts on from launch to
    launch: each launch takes n_rows numbers from it (one for each row a program finishes: a program asks once past
    the last row, and stops), so launch k's claims start at ``first_claim`` = k * n_rows. A program that has stopped
    (not ``claiming``) asks nothing and gets n_rows."""
    claimed = tl.atomic_add(counter_ptr, 1, mask=claiming, sem="relaxed") + 1
    return tl.where(claiming, programs + claimed - first_claim, n_rows).to(tl.int32)


@triton.jit
def finish_forward_piece(y_ptr, part_ptr, row, valid, y_row_stride, n_cols, segment, piece, parts, parity, x, x_edge,
                         SEGMENTS: tl.constexpr, ALIGN: tl.constexpr, PIECE: tl.constexpr):
    """y for one piece of ``row``, kept as loaded: merge the row's (m, d) partials, then y = exp(x - m) / d."""
    m_parts, d_parts = unpack(read_partials(part_ptr, row, parts, SEGMENTS, valid, parity))
    m_parts = tl.where(parts < SEGMENTS, m_parts, float("-inf"))  # padding slots: the merge identity
    m_row = tl.max(m_parts, axis=0)
    d_row = tl.sum(d_parts * tl.exp2((m_parts - tl.where(m_row == float("-inf"), 0.0, m_row)) * LOG2E), axis=0)
    d_inverse = 1.0 / d_row
    store_window(y_ptr, row, y_row_stride, n_cols, valid, segment, piece,
                 tl.exp2((upcast_again(x) - m_row) * LOG2E) * d_inverse,
                 tl.exp2((upcast_again(x_edge) - m_row) * LOG2E) * d_inverse, ALIGN, PIECE)


@triton.jit
def softmax_split_kernel(
    y_ptr, x_ptr, part_ptr, x_row_stride, x_col_stride, y_row_stride, n_rows, n_cols,
    SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    PIECE: tl.constexpr, PHASE: tl.constexpr,
):
    """Forward for long rows: SEGMENTS programs share each row, a piece of PIECE elements each in BLOCK_N lanes
    (``plans.piece_length``), and merge their (m, d) (notebook 05's merge) through ``part_ptr``: one packed word per
    piece, tagged with the call's parity, then the ticket counter and a row counter per segment (``claim_row``).
    ALIGN > 1 places the pieces on 16-byte boundaries (``row_window``; it needs unit column strides and equal row
    strides).

    Each piece stays in registers as loaded, and finishing computes exp(x - m) again with the row's m: a second
    exponential per element costs less than keeping e = exp(x - m_piece), fp32 and twice the registers of a 16-bit
    piece, for which fewer programs fit on the GPU (notebook 06). In one launch (PHASE 2) a program publishes its row,
    then finishes the row it published before, whose partials have had a whole iteration to arrive. No wait is for a
    row that cannot come: a program waits only on a row it has published itself, and each segment hands its rows out
    in order, so the lowest row waited on is taken, in every segment, by programs that wait on nothing lower (while
    every segment has a program on the GPU: ``residency.split_grid``).
    """
    tl.static_assert(x_ptr.dtype.element_ty != tl.float64, "fp64 partials do not fit a packed word: two-pass kernel")
    program, parity, launch = take_ticket(part_ptr + n_rows * SEGMENTS, PHASE)
    segment = program % SEGMENTS
    counter = part_ptr + n_rows * SEGMENTS + 1 + segment
    programs = tl.num_programs(0) // SEGMENTS  # in each segment
    first_claim = launch * n_rows
    piece = segment * PIECE + tl.arange(0, BLOCK_N)  # positions in the row (columns when ALIGN = 1)
    parts = tl.arange(0, SEGMENTS_POW2)
    x_prev = tl.zeros((BLOCK_N,), x_ptr.dtype.element_ty)
    x_edge_prev = tl.zeros((2 * ALIGN,), x_ptr.dtype.element_ty)
    previous = tl.full((), -1, tl.int32)  # the row published one iteration ago: none yet
    next_row = program // SEGMENTS  # the first row needs no claim: a call of few rows waits on no atomic
    # one iteration past the program's last row, so that in PHASE 2 its last row is finished too
    while previous < n_rows:
        valid = next_row < n_rows
        row = next_row.to(tl.int64)  # 64-bit offsets: row * stride can pass 2**31
        next_row = claim_row(counter, first_claim, programs, n_rows, valid)  # asked now: answered by the next iteration
        # the piece's elements, and in the row's first program the end chunks' elements too: the partial covers both
        x, x_edge = load_window(x_ptr, row, x_row_stride, x_col_stride, n_cols, valid, segment, piece, float("-inf"),
                                ALIGN, PIECE)
        if PHASE != FINISH:
            m = tl.maximum(tl.max(upcast(x), axis=0), tl.max(upcast(x_edge), axis=0))
            m_finite = tl.where(m == float("-inf"), 0.0, m)  # all -inf: partial (-inf, 0)
            # upcast_again: no fp32 copy of the piece stays live from the max to the exponentials
            d = (tl.sum(tl.exp2((upcast_again(x) - m_finite) * LOG2E), axis=0)
                 + tl.sum(tl.exp2((upcast_again(x_edge) - m_finite) * LOG2E), axis=0))
            tl.store(part_ptr + row * SEGMENTS + segment, pack(m, d, parity), mask=valid)
        if PHASE == FUSED:
            finish_forward_piece(y_ptr, part_ptr, tl.maximum(previous, 0).to(tl.int64), previous >= 0, y_row_stride,
                                 n_cols, segment, piece, parts, parity, x_prev, x_edge_prev, SEGMENTS, ALIGN, PIECE)
            x_prev, x_edge_prev = x, x_edge
        elif PHASE == FINISH:
            finish_forward_piece(y_ptr, part_ptr, row, valid, y_row_stride, n_cols, segment, piece, parts, parity, x,
                                 x_edge, SEGMENTS, ALIGN, PIECE)
        previous = row.to(tl.int32)


@triton.jit
def finish_backward_piece(dx_ptr, part_ptr, row, valid, dx_row_stride, n_cols, segment, piece, parts, parity, y, dy,
                          y_edge, dy_edge, SEGMENTS: tl.constexpr, ALIGN: tl.constexpr, PIECE: tl.constexpr):
    """dx for one piece of ``row``, y and dy kept as loaded: the row's sum(y * dy) from its partials, then
    y * (dy - sum)."""
    dot_parts, _ = unpack(read_partials(part_ptr, row, parts, SEGMENTS, valid, parity))
    dot = tl.sum(tl.where(parts < SEGMENTS, dot_parts, 0.0), axis=0)
    store_window(dx_ptr, row, dx_row_stride, n_cols, valid, segment, piece,
                 upcast_again(y) * (upcast_again(dy) - dot), upcast_again(y_edge) * (upcast_again(dy_edge) - dot),
                 ALIGN, PIECE)


@triton.jit
def softmax_backward_split_kernel(
    dx_ptr, y_ptr, dy_ptr, part_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_rows,
    n_cols, SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    PIECE: tl.constexpr, PHASE: tl.constexpr,
):
    """Backward for long rows: SEGMENTS programs share a row and exchange only their part of sum(y * dy) (packed
    with a 0 that carries the tag), with the forward's row window, row counters and one-row-behind pipeline; pieces
    of y and dy stay as loaded until dx."""
    tl.static_assert(y_ptr.dtype.element_ty != tl.float64, "fp64 partials do not fit a packed word: two-pass kernel")
    program, parity, launch = take_ticket(part_ptr + n_rows * SEGMENTS, PHASE)
    segment = program % SEGMENTS
    counter = part_ptr + n_rows * SEGMENTS + 1 + segment
    programs = tl.num_programs(0) // SEGMENTS  # in each segment
    first_claim = launch * n_rows
    piece = segment * PIECE + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, SEGMENTS_POW2)
    y_prev = tl.zeros((BLOCK_N,), y_ptr.dtype.element_ty)
    dy_prev = tl.zeros((BLOCK_N,), dy_ptr.dtype.element_ty)
    y_edge_prev = tl.zeros((2 * ALIGN,), y_ptr.dtype.element_ty)
    dy_edge_prev = tl.zeros((2 * ALIGN,), dy_ptr.dtype.element_ty)
    previous = tl.full((), -1, tl.int32)
    next_row = program // SEGMENTS
    while previous < n_rows:
        valid = next_row < n_rows
        row = next_row.to(tl.int64)
        next_row = claim_row(counter, first_claim, programs, n_rows, valid)
        y, y_edge = load_window(y_ptr, row, y_row_stride, y_col_stride, n_cols, valid, segment, piece, 0.0, ALIGN,
                                PIECE)
        dy, dy_edge = load_window(dy_ptr, row, dy_row_stride, dy_col_stride, n_cols, valid, segment, piece, 0.0, ALIGN,
                                  PIECE)
        if PHASE != FINISH:
            dot_piece = (tl.sum(upcast(y) * upcast(dy), axis=0)
                         + tl.sum(upcast(y_edge) * upcast(dy_edge), axis=0))
            tl.store(part_ptr + row * SEGMENTS + segment, pack(dot_piece, tl.zeros_like(dot_piece), parity),
                     mask=valid)
        if PHASE == FUSED:
            finish_backward_piece(dx_ptr, part_ptr, tl.maximum(previous, 0).to(tl.int64), previous >= 0, dx_row_stride,
                                  n_cols,
                                  segment, piece, parts, parity, y_prev, dy_prev, y_edge_prev, dy_edge_prev, SEGMENTS,
                                  ALIGN, PIECE)
            y_prev, dy_prev, y_edge_prev, dy_edge_prev = y, dy, y_edge, dy_edge
        elif PHASE == FINISH:
            finish_backward_piece(dx_ptr, part_ptr, row, valid, dx_row_stride, n_cols, segment, piece, parts, parity, y,
                                  dy, y_edge, dy_edge, SEGMENTS, ALIGN, PIECE)
        previous = row.to(tl.int32)
