"""Plain PyTorch softmax, forward and backward: the eager baseline the benchmark times (``naive_softmax``), and the
backward and Jacobian the notebooks and tests compare the kernels against.

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


def assert_close_on_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """``torch.testing.assert_close`` with the absolute tolerance set by ``expected``'s own scale: ``rtol`` times its
    largest magnitude. A softmax's outputs and gradients over a row of N elements are about 1/N, so over long rows
    the default absolute tolerance (1e-5 in fp32) would pass any values of that size, the wrong ones too."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


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


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V in plain PyTorch, in the inputs' dtype: the whole (seq_q, seq_k) score matrix."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if causal:  # key j visible to query i when j <= i (top-left aligned)
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, block: int = 16,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel's algorithm as a loop over key blocks: (O, lse), lse the natural log-sum-exp of each row.

    Notebook 05's merge of (m, d) with an output accumulator: when a block raises a row's max from m to m_new, what
    was summed so far, d and o alike, is rescaled by exp(m - m_new). Computed in fp32 or better."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=compute, device=q.device)
    d = torch.zeros_like(m)
    o = torch.zeros_like(q)
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    for start in range(0, k.shape[-2], block):
        s = q @ k[..., start:start + block, :].transpose(-2, -1) * scale
        if causal:
            s = s.masked_fill(torch.arange(start, start + s.shape[-1], device=q.device) > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: exp(-inf) = 0
        alpha, p = torch.exp(m - m_shift), torch.exp(s - m_shift)
        d = d * alpha + p.sum(dim=-1, keepdim=True)
        o = o * alpha + p @ v[..., start:start + block, :]
        m = m_new
    return o / d, (m + torch.log(d)).squeeze(-1)
