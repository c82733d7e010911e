"""Programs that exchange partials (notebook 06): the programs sharing a row (or a block of columns) each publish
one partial, (m, d) forward or a part of sum(y * dy) backward, then wait for the others' and merge them.

Each partial is one 64-bit word written into a slot, tagged with the parity of the call (its launch's number on this
exchange buffer, from a ticket counter after the slots), and on a GPU (``PHASE`` 2) readers poll the slots until every
tag is this call's. Every call writes every slot, so a slot holds this call's partial or the previous call's: the
buffer never needs refilling between calls, and a plain call keeps its own (``recipes.Recipe``). A wait must never be
for a program the GPU has not started: programs take their place by the order they start (a ticket from one atomic
counter), not by program id, and a group is launched only where its programs fit on the GPU together, with room to
spare (``residency.split_grid``). Triton's interpreter runs programs one after another, where a wait would never end,
so there an exchange runs as a launch per phase: ``PHASE`` 0 writes the partials, ``PHASE`` 1 merges them and
finishes (a merge in two levels, ``column_split``'s, puts ``PHASE`` 3 between them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import residency
from .device import INTERPRET
from .recipes import Buffer, Recipe, Step

# PHASE of a split kernel: partials only, merge-and-finish only, or both in one launch with a wait between; and for a
# merge in two levels (``column_split``), the middle launch that merges the partials into finals.
STATISTICS, FINISH, FUSED, MERGE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
# A fresh exchange buffer's fill: the ticket counter at -1 (the first ticket is 0), and slots whose tag (bit 31) is 1,
# not the first call's 0.
EMPTY = tl.constexpr(-1)


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
    whole of this one's: no counter, no fence. Volatile loads skip the SM's own cache (L1), which could hold an old
    copy, and read L2 each time.

    A program with more threads than slots holds copies of a slot in several threads, each loaded at its own moment,
    and the wait's sum counts one copy of each: it can end while another copy, which the merge may read, is still the
    previous call's. Once the wait has seen every slot written, a copy still stale loads again; L2 holds the write by
    then."""
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
    """This program's place, 0 to num_programs - 1, in the order programs start, the parity of its call, and the
    number k of its launch on this exchange buffer. The counter starts at EMPTY (-1) and counts on from launch to
    launch: every launch over one exchange buffer has the same grid, so launch k takes tickets k * num_programs to
    (k + 1) * num_programs - 1. The interpreter's launches (STATISTICS, then MERGE or FINISH) run one after another,
    each reading what the one before it wrote in full, so they need no parity to tell calls apart: theirs is 0."""
    ticket = tl.atomic_add(counter_ptr, 1) + 1  # 64-bit, like the counter
    launch = ticket // tl.num_programs(0)
    parity = launch % 2 if PHASE == FUSED else tl.zeros_like(ticket)
    # 32-bit like a program id: 64-bit index math costs registers
    return (ticket % tl.num_programs(0)).to(tl.int32), parity.to(tl.int32), launch


PARTIALS = torch.int64  # a split's exchange buffer in its arguments before it is allocated: its dtype


def exchange_recipe(kernel, ints: tuple, constexprs: dict, num_warps: int, segments: int, n_groups: int,
                    group_slots: int, resources: residency.Resources, max_registers: int | None = None,
                    interpreted: tuple = (STATISTICS, FINISH), counters: int = 0) -> Recipe | None:
    """The launch of a kernel whose groups of ``segments`` programs exchange partials (a split row, or a split block
    of columns), or None if a group's programs cannot be resident together, as the compiled kernel's ``resources``
    count them (``split_grid``). Its exchange buffer, ``group_slots`` EMPTY slots per group, the ticket counter after
    them and ``counters`` more counters after that (a split row's, ``split_rows.claim_row``), all EMPTY (-1), follows
    the operands in the kernel's arguments. ``max_registers``: the kernel's register cap; ``interpreted``: the phases
    the interpreter launches in turn."""
    grid = residency.split_grid(segments, n_groups, resources.resident, resources.assured)
    if grid == 0:
        return None
    if INTERPRET:  # programs run one after another, where a wait would never end: a launch per phase instead
        grid = segments * min(n_groups, residency.CPU_PROGRAMS, grid // segments)
        phases = interpreted
    else:
        phases = (FUSED,)
    partials = Buffer(n_groups * group_slots + 1 + counters, torch.int64, EMPTY.value)
    # PHASE as a plain int: torch.compile writes the launch out as Python source
    return Recipe((partials,), tuple(Step(kernel, grid, ints, dict(constexprs, PHASE=phase.value), num_warps,
                                          max_registers) for phase in phases))
