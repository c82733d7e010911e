"""Choosing a kernel and its shape for a row length (notebook 06): a tile of whole rows, or a split into pieces, and
for a few rows over a long row, more pieces."""

from __future__ import annotations

from dataclasses import dataclass

import triton


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


def tile_plan(n_cols: int) -> Plan:
    """A tile of whole rows of ``n_cols``: rows until the tile holds TILE_ELEMENTS, warps by its size."""
    block = triton.next_power_of_2(n_cols)
    rows = max(1, TILE_ELEMENTS // block)
    warps = 32 if rows * block >= WIDEST_TILE else max(1, min(16, rows * block // (32 * ELEMENTS_PER_THREAD)))
    return Plan(rows, block, 1, warps)


def plan_for(n_cols: int, phase: str, element_size: int = 4, wide_pieces: bool = True) -> Plan:
    """The kernel shape for rows of ``n_cols`` elements of ``element_size`` bytes in ``phase``. ``wide_pieces=False``:
    splits keep pieces of SEGMENT_ELEMENTS (the launch falls back to them where a compiler gives the wide piece more
    registers than REGISTER_BUDGET).

    The shape is compiled into the kernel, so a symbolic row length (torch.compile's dynamic shapes) is made concrete
    here: the compiled graph is then specialised to it."""
    n_cols = int(n_cols)
    if takes_tile(n_cols, phase, element_size):
        return tile_plan(n_cols)
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
