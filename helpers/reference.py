"""Plain PyTorch softmax, forward and backward: the oracles the notebooks and tests compare the kernels against.

Each line is one eager operation, so its memory traffic can be counted (notebook 01): for an M x N input,
``naive_softmax`` reads 5MN + 2M elements and writes 3MN + 2M.
"""

from __future__ import annotations

import torch


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Safe softmax, one eager op per line (each op reads its inputs from memory and writes its output back)."""
    m = x.amax(dim=dim, keepdim=True)  # read MN, write M
    z = x - m  # read MN + M, write MN
    e = torch.exp(z)  # read MN, write MN
    d = e.sum(dim=dim, keepdim=True)  # read MN, write M
    return e / d  # read MN + M, write MN


def unsafe_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The textbook formula exp(x) / sum(exp(x)), without the max: overflows for large x."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Jacobian-free backward: dx = y * (dy - sum(y * dy)), computed in at least fp32."""
    compute = torch.promote_types(y.dtype, torch.float32)
    y32, dy32 = y.to(compute), dy.to(compute)
    dot = (y32 * dy32).sum(dim=dim, keepdim=True)
    return (y32 * (dy32 - dot)).to(y.dtype)


def softmax_jacobian(y: torch.Tensor) -> torch.Tensor:
    """The Jacobian of softmax at one row with output ``y`` (1-D): J = diag(y) - y y^T, so J[i, j] = dy_i / dx_j."""
    if y.ndim != 1:
        raise ValueError(f"softmax_jacobian takes one row (1-D), got shape {tuple(y.shape)}")
    return torch.diag(y) - torch.outer(y, y)


def jacobian_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Backward through the explicit Jacobian, row by row: dx = J^T dy (J is symmetric). O(N^2) per row."""
    if y.ndim != 2 or y.shape != dy.shape:
        shapes = f"{tuple(y.shape)} and {tuple(dy.shape)}"
        raise ValueError(f"jacobian_backward takes two 2-D tensors of one shape, got {shapes}")
    return torch.stack([softmax_jacobian(y_row).T @ dy_row for y_row, dy_row in zip(y, dy, strict=True)])
