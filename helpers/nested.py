"""Nested tensors of the jagged layout on the course's kernels (``ops.softmax`` and ``ops.softmax_backward`` hand them
here with the dense op to run).

A jagged tensor, (batch, sequence, ...) with sequences of any length, holds its elements in one dense tensor,
``t.values()`` (sum of the lengths, ...), which softmax takes as any dense tensor (the kernels, or torch's softmax on
another device). Over a dim after the sequence dim, that is the values' softmax over their dim one lower. Over the
sequence dim, each sequence is padded to the longest (with -inf, whose exp adds 0 to every sum; y and dy with 0) and
taken back out, by indexing, which autograd differentiates (twice, too). torch 2.13's own gradient there is wrong: it
sums y * dy along each row, as for the last dim. Any other nested tensor (softmax over the batch dim, the strided
layout, holes, a transposed jagged tensor whose ragged dim moved) is torch's own softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nested._internal.nested_tensor import nested_view_from_values_offsets

Positions = tuple[torch.Tensor, torch.Tensor]


def takes_kernels(t: torch.Tensor, dim_index: int) -> bool:
    """Whether softmax of ``t`` over ``dim_index`` runs here: a jagged tensor whose sequence dim is dim 1 and whose
    values hold nothing but its sequences, over any dim but the batch dim."""
    return dim_index != 0 and t.layout == torch.jagged and t._ragged_idx == 1 and t.lengths() is None


def softmax(x: torch.Tensor, dim_index: int, dense_softmax: Callable) -> torch.Tensor:
    """``dense_softmax(t, dim)`` over the values (``dim_index`` after the sequence dim) or the padded sequences."""
    if dim_index == 1:
        positions = sequence_positions(x)
        return unpadded(dense_softmax(padded(x, float("-inf"), positions), 1), x, positions)
    return jagged_like(dense_softmax(x.values(), dim_index - 1), x)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim_index: int, dense_backward: Callable) -> torch.Tensor:
    """``dense_backward(y, dy, dim)`` as ``softmax`` runs the forward, for a ``y`` and ``dy`` of the same lengths."""
    if y.shape[0] != dy.shape[0] or y.shape[2:] != dy.shape[2:] or not torch.equal(y.offsets(), dy.offsets()):
        raise ValueError(f"y and dy must hold sequences of the same lengths and shapes, got {y.offsets().diff()} x "
                         f"{tuple(y.shape[2:])} and {dy.offsets().diff()} x {tuple(dy.shape[2:])}")
    if dim_index == 1:
        positions = sequence_positions(y)  # dy's too: the same offsets
        return unpadded(dense_backward(padded(y, 0.0, positions), padded(dy, 0.0, positions), 1), y, positions)
    return jagged_like(dense_backward(y.values(), dy.values(), dim_index - 1), y)


def jagged_like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The jagged tensor of ``like``'s sequences over ``values``: the view torch's own jagged ops build (its public
    ``nested_tensor_from_jagged`` logs a warning meant for torch.fx at its first call, in torch 2.13). It keeps the
    shortest and longest lengths ``like`` has cached, so that padding it later needs no sync, but not while
    torch.compile traces (AOTAutograd's record of the output's parts then disagrees with what runs, in torch 2.13)."""
    if torch.compiler.is_compiling():
        return nested_view_from_values_offsets(values, like.offsets())
    return nested_view_from_values_offsets(values, like.offsets(), min_seqlen=like._maybe_min_seqlen,
                                           max_seqlen=like._maybe_max_seqlen)


def sequence_positions(t: torch.Tensor) -> Positions:
    """Each of ``t.values()``'s rows' sequence and place in it (no host sync)."""
    offsets = t.offsets()
    n_values = t.values().shape[0]
    sequence = torch.repeat_interleave(torch.arange(t.shape[0], device=offsets.device), offsets.diff(),
                                       output_size=n_values)
    return sequence, torch.arange(n_values, device=offsets.device) - offsets[sequence]


def padded(t: torch.Tensor, fill: float, positions: Positions) -> torch.Tensor:
    """``t``'s sequences in a dense (batch, longest sequence, ...) tensor, ``fill`` past each one's end."""
    values = t.values()
    dense = values.new_full((t.shape[0], t._max_seqlen, *values.shape[1:]), fill)
    if fill == float("-inf") and dense.shape[1]:  # an empty sequence: one 0, not a column of -inf whose softmax,
        empty = (t.offsets().diff() == 0).view(-1, *[1] * (values.ndim - 1))  # unused, is NaN (anomaly mode's alarm)
        dense[:, 0] = torch.where(empty, 0.0, fill)
    return dense.index_put(positions, values)


def unpadded(dense: torch.Tensor, like: torch.Tensor, positions: Positions) -> torch.Tensor:
    """The jagged tensor of ``like``'s sequences, from ``dense`` (batch, longest sequence, ...)."""
    return jagged_like(dense[positions], like)
