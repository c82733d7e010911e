"""Choosing a kernel and its shape for a row length (notebook 06): a tile of whole rows, or a split into pieces, and
for a few rows over a long row, more pieces."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .residency import REGISTER_BUDGET


# Host arithmetic of the plans. Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions,
# usable inside kernels too, and cost the host 2-4 us a call through their wrapper: a new row length's plan took
# several of them.
def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two at or above ``n`` (>= 1)."""
    return 1 << (n - 1).bit_length()

# A split's last piece holds the rest of the row. Where that leaves more than EVEN_PADDING of the row's pieces empty (a
# row just past a multiple of the piece), every piece takes an even share instead, so no program idles while the
# others set the pace; elsewhere the full pieces compile leaner. The backward's pieces of 16 KB take even shares at
# any padding, where the plan gives them that shape (WIDE_BACKWARD_PADDING below; results/README.md, "Even pieces").
EVEN_PADDING = 1 / 32


@dataclass(frozen=True)
class Plan:
    """How rows of one length are cut: ``segments`` programs per row (1: tile kernel) of ``block_n`` elements,
    ``rows`` rows per tile, ``num_warps`` warps per program, and whether a tile kernel runs a persistent grid (a split
    always does: its programs must all be resident) or one program per tile. A split places its pieces on 16-byte
    boundaries when ``align`` > 1 (elements per 16 bytes) and the tensors' layout allows it. ``max_registers``
    caps the registers a thread of its kernel may take (Triton's ``maxnreg``; None: the compiler's choice).
    ``full_padding`` is the most of a split's pieces that may be left empty before each program takes an even share
    of the row instead (``piece_length``)."""

    rows: int
    block_n: int
    segments: int
    num_warps: int
    persistent: bool = False
    align: int = 1
    max_registers: int | None = None
    full_padding: float = EVEN_PADDING


# Shapes read off the tuning sweeps and side-by-side H100 timings: good at every length rather than best at one and
# poor at the next. The measurements behind each choice: results/README.md, "Appendix: why the plan's numbers are
# what they are".
TILE_ELEMENTS = 1024  # short rows: whole rows per program until a tile holds this many elements
ELEMENTS_PER_THREAD = 16  # tile kernels: warps = elements / (32 * this), 1 to 16 (a row of 32768: 64 a thread)
# Rows up to ALWAYS_TILE_ROW take a whole-row tile, rows past MAX_TILE_ROW are split across programs, and between
# the two it depends (``takes_tile``).
ALWAYS_TILE_ROW = 16384
MAX_TILE_ROW = 32768
SEGMENT_ELEMENTS = 2048  # the narrowest piece of a long row each program of a split holds ...
WIDE_SEGMENT_ELEMENTS = 4096  # ... a piece twice as wide ...
WIDEST_SEGMENT_ELEMENTS = 8192  # ... and twice again (``plan_for`` says which rows take which)
# The fp32 backward's wide pieces (4096 each of y and dy, held one row behind) take about 160 registers a thread on 4
# warps. Capped at this, three programs fit an SM's 65536: 396 on an H100, which rows of 38 pieces (151936) fill with
# 10 groups, where pieces on 8 warps fit 6 groups and leave an eighth of the GPU idle (results/README.md, "Wider
# pieces"). The 16-bit backward's pieces of 8192 hold as many bytes and take the same shape where a row leaves more
# than WIDE_BACKWARD_PADDING of them empty: even shares win back about the padding (0.005-0.03 of copy at 2.1-2.4%),
# and 4 warps cost about 0.01 where the pieces come out (nearly) full, so there they keep 8 warps and full pieces.
WIDE_BACKWARD_REGISTERS = 168
WIDE_BACKWARD_PADDING = 1 / 64


def takes_tile(n_cols: int, phase: str, element_size: int) -> bool:
    """Whether rows of ``n_cols`` take a whole-row tile rather than a split. Between ALWAYS_TILE_ROW and MAX_TILE_ROW
    a whole-row tile wins only where it loads 16 bytes at a time (rows a multiple of 16) and holds what it loads
    without spilling (not the fp32 backward's two rows), and never in a 16-bit forward, whose split is ahead even of
    a full tile (the H100's tuning; tests/test_steps.py checks it against the recorded sweeps)."""
    block = next_power_of_2(n_cols)
    if block <= ALWAYS_TILE_ROW:
        return True
    if block > MAX_TILE_ROW or (phase == "forward" and element_size == 2):
        return False
    if phase == "backward" and element_size > 2:
        return False
    return n_cols % 16 == 0


def tile_plan(n_cols: int) -> Plan:
    """A tile of whole rows of ``n_cols``: rows until the tile holds TILE_ELEMENTS, warps by its size."""
    block = next_power_of_2(n_cols)
    rows = max(1, TILE_ELEMENTS // block)
    warps = max(1, min(16, rows * block // (32 * ELEMENTS_PER_THREAD)))
    return Plan(rows, block, 1, warps)


# A call of few short rows fills few tiles: a tile of TILE_ELEMENTS leaves 64 rows of 10 one program on one SM, whose
# 16 loads and exps a thread then set the time (a 3.2 us kernel against torch's 1.5 on an H100, under the profiler),
# and 100000 rows of 3 391 programs of 2 warps, 6 warps an SM to wait on DRAM. Where a call has fewer than TILES_PER_SM
# tiles for each SM, its tiles take fewer rows, halved until it has that many or a tile is one row, on at least
# SPREAD_WARPS warps (notebook 07; results/README.md, "Small calls": 2 or 8 tiles an SM did less well). A tile of one
# row keeps its plan: more warps there measured no better (an H200, rows of 1000).
TILES_PER_SM = 4
SPREAD_WARPS = 4


def spread_tiles(plan: Plan, n_rows: int, sms: int) -> Plan:
    """``plan``'s tile for a call of ``n_rows`` rows on a GPU of ``sms`` SMs: as planned where the call has at least
    TILES_PER_SM tiles an SM or a tile is one row, else fewer rows a tile on at least SPREAD_WARPS warps."""
    rows, enough = plan.rows, TILES_PER_SM * sms
    if rows == 1 or cdiv(n_rows, rows) >= enough:
        return plan
    while rows > 1 and cdiv(n_rows, rows) < enough:
        rows //= 2
    return replace(plan, rows=rows, num_warps=max(plan.num_warps, SPREAD_WARPS))


def widest_piece(n_cols: int, phase: str, element_size: int, align: int) -> int:
    """The widest piece a split of rows of ``n_cols`` takes. Rows from MAX_TILE_ROW on: 16-bit pieces of
    WIDEST_SEGMENT_ELEMENTS where those come out full (``full_pieces``; else WIDE_SEGMENT_ELEMENTS), fp32 pieces of
    WIDE_SEGMENT_ELEMENTS. Shorter split rows: 16-bit forward pieces of WIDE_SEGMENT_ELEMENTS, the rest
    SEGMENT_ELEMENTS. 16-bit pieces are kept as loaded (half the registers of fp32), so they take twice the
    elements of fp32 for the same bytes a program holds."""
    if n_cols >= MAX_TILE_ROW:
        if element_size == 2:
            full = full_pieces(n_cols + align - 1, WIDEST_SEGMENT_ELEMENTS)
            return WIDEST_SEGMENT_ELEMENTS if full else WIDE_SEGMENT_ELEMENTS
        return WIDE_SEGMENT_ELEMENTS if element_size == 4 else SEGMENT_ELEMENTS
    return WIDE_SEGMENT_ELEMENTS if phase == "forward" and element_size == 2 else SEGMENT_ELEMENTS


def plan_for(n_cols: int, phase: str, element_size: int = 4, max_piece: int | None = None) -> Plan:
    """The kernel shape for rows of ``n_cols`` elements of ``element_size`` bytes in ``phase``: a whole-row tile, or a
    split into pieces of ``widest_piece`` elements, or of at most ``max_piece`` (the launch takes narrower pieces where
    a compiler gives the wider ones more registers than their cap or REGISTER_BUDGET, or where their groups leave part
    of the GPU idle: ``fused``'s ``ROW_FILL``).

    The shape is compiled into the kernel, so a symbolic row length (torch.compile's dynamic shapes) is made concrete
    here: the compiled graph is then specialised to it."""
    n_cols = int(n_cols)
    if takes_tile(n_cols, phase, element_size):
        return tile_plan(n_cols)
    # Rows of a length that is not a multiple of 16 start off 16-byte boundaries; aligned pieces (a window up to
    # align - 1 elements wider than the row, ``split_rows.row_window``) load 16 bytes at a time again (notebook 06).
    align = 16 // element_size if n_cols % 16 else 1
    block_n = widest_piece(n_cols, phase, element_size, align)
    block_n = min(block_n, max(max_piece or block_n, SEGMENT_ELEMENTS))
    segments = cdiv(n_cols + align - 1, block_n)
    # Warps: a forward warp for each 4 KB of its piece, a backward warp for each 2 KB of each of y and dy; few per
    # piece keep many pieces resident. The fp32 forward's narrow pieces take 2, and 4 once a row has 32.
    wide = block_n > SEGMENT_ELEMENTS
    if phase == "forward" and element_size == 4 and not wide:
        warps = 4 if segments >= 32 else 2
    else:
        warps = max(1, block_n * element_size // (4096 if phase == "forward" else 2048))
    # The 16-bit forward's wide pieces under a cap of REGISTER_BUDGET registers: left to itself the compiler takes
    # 136-155 for a piece of 4096 and fewer programs fit. Backward pieces of 16 KB of each of y and dy (fp32 4096,
    # 16-bit 8192 where the row leaves more than WIDE_BACKWARD_PADDING; not fp64's 2048, whose rows take two passes) on
    # 4 warps under WIDE_BACKWARD_REGISTERS, with even shares at any padding (``piece_length``).
    cap = None
    full_padding = EVEN_PADDING
    if wide and element_size == 2 and phase == "forward":
        cap = REGISTER_BUDGET
    elif phase == "backward" and block_n * element_size == 4 * WIDE_SEGMENT_ELEMENTS and (element_size == 4 or (
            element_size == 2 and not full_pieces(n_cols + align - 1, block_n, WIDE_BACKWARD_PADDING))):
        warps, cap, full_padding = 4, WIDE_BACKWARD_REGISTERS, 0.0
    return Plan(1, block_n, segments, warps, persistent=True, align=align, max_registers=cap,
                full_padding=full_padding)


def narrower(plan: Plan, n_cols: int, phase: str, element_size: int) -> Plan | None:
    """The split of rows of ``n_cols`` in pieces half as wide as ``plan``'s, None if its pieces are the narrowest."""
    if plan.block_n <= SEGMENT_ELEMENTS:
        return None
    return plan_for(n_cols, phase, element_size, max_piece=plan.block_n // 2)


# The even share is compiled into the split kernels, so a loop whose row grows by one a call (a decode loop's scores)
# builds a kernel wherever it changes: in whole 16-byte chunks, every 4 x SEGMENTS lengths in fp32 (30 builds in 600
# calls at 41000; results/README.md, "A length that grows by one a call"). A call of at most COARSE_SHARE_PIECES
# pieces in all runs every row at once, or nearly, and is latency-bound: there the share is rounded up to whole
# COARSE_SHARE elements (BLOCK_N if smaller) instead, a build every COARSE_SHARE x SEGMENTS lengths, for pieces at most
# COARSE_SHARE - 1 elements longer. Bandwidth-bound calls keep the exact share.
COARSE_SHARE = 64
COARSE_SHARE_PIECES = 1024


def piece_length(n_cols: int, plan: Plan, align: int, element_size: int, n_rows: int | None = None) -> int:
    """The elements of a row each program of ``plan``'s split holds, of a row window of ``n_cols`` + ``align`` - 1
    positions (``split_rows.row_window``): ``plan.block_n``, the last program taking the rest, or an even share of
    the window where the rest would leave more than ``plan.full_padding`` of the pieces empty: in whole 16-byte
    chunks, or COARSE_SHARE elements for a call of ``n_rows`` rows with at most COARSE_SHARE_PIECES pieces."""
    window = int(n_cols) + align - 1
    coarse = n_rows is not None and n_rows * plan.segments <= COARSE_SHARE_PIECES
    multiple = min(COARSE_SHARE, plan.block_n) if coarse else 16 // element_size
    assert plan.block_n % multiple == 0, "an even share rounded up to whole multiples must stay within BLOCK_N"
    if full_pieces(window, plan.block_n, plan.full_padding):
        return plan.block_n
    return cdiv(cdiv(window, plan.segments), multiple) * multiple


def full_pieces(window: int, block_n: int, full_padding: float = EVEN_PADDING) -> bool:
    """Whether a row window of ``window`` positions cut into pieces of ``block_n`` leaves at most ``full_padding`` of
    its pieces' positions empty (``piece_length``)."""
    pieces = cdiv(window, block_n) * block_n
    return pieces - window <= full_padding * pieces


# Few rows over a long row (sampling and decode: a handful of rows over a vocabulary) leave the default plan few
# programs, and a call then lasts as long as one program's loads. Pieces of FEW_ROWS_PIECE elements put more programs
# to work, up to FEW_PROGRAMS in all (notebook 07; no gain in the fp32 backward, which keeps the default plan).
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
    segments = cdiv(n_cols + align - 1, FEW_ROWS_PIECE)
    if n_rows * segments > FEW_PROGRAMS or segments <= plan_for(n_cols, phase, element_size).segments:
        return None
    return Plan(1, FEW_ROWS_PIECE, segments, FEW_ROWS_WARPS, persistent=True, align=align)
