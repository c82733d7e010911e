"""``helpers.attention``: the FlashAttention kernels of ``flash_attention`` as an autograd-aware PyTorch operator,
``torch.ops.softmax_course.attention``, registered as ``ops`` registers softmax (notebook 08), so that
torch.compile(fullgraph=True) traces through it (notebook 10)."""

from __future__ import annotations

import functools

import torch

from .device import DEVICE, INTERPRET
from .flash_attention import DTYPES, HEAD_DIMS, attention_backward, attention_forward
from .ops import _on_kernel_device, _operator

_attention_op = _operator("softmax_course::attention", attention_forward)
_attention_backward_op = _operator("softmax_course::attention_backward", attention_backward)


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)  # O and L: the backward recomputes P from them, never stores it


def _backward_autograd(ctx, do: torch.Tensor, dL: torch.Tensor | None) -> tuple:
    q, k, v, o, L = ctx.saved_tensors  # L is a statistic: its gradient (dL) is not propagated
    return (*_attention_backward_op(do, q, k, v, o, L, ctx.causal, ctx.scale), None, None)


torch.library.register_autograd("softmax_course::attention", _backward_autograd, setup_context=_setup_context)


@functools.cache
def _before_ampere(index: int) -> bool:
    return torch.cuda.get_device_capability(index) < (8, 0)


def _check(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16 or float32 tensors")
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
        if not _on_kernel_device(t):
            where = "cpu" if INTERPRET else DEVICE.type
            raise ValueError(f"{name} is on {t.device}, but the kernels run on {where}: move it with .to({where!r})")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v must share batch, heads and head_dim, and k and v their seq length: got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[3]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a power of two from 16 to 128 (one tile wide), got {head_dim}")
    if k.shape[2] == 0 and q.shape[2] > 0:
        raise ValueError("k and v have no keys (seq length 0): softmax over no scores is undefined")
    if q.is_cuda and not torch.compiler.is_compiling() and _before_ampere(q.get_device()):
        raise RuntimeError("attention needs a GPU of compute capability 8.0 or newer: tl.dot is broken on older ones "
                           "(sm_75, the T4 of free Colab) with Triton >= 3.3")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V by the Triton kernels, autograd-aware, as the operator
    ``torch.ops.softmax_course.attention`` (which also returns L): torch.compile(fullgraph=True) does not break on it.

    q: (batch, heads, seq_q, head_dim); k, v: (batch, heads, seq_k, head_dim); any strides; float16, bfloat16 or
    float32, accumulated in fp32 (16-bit inputs: P is rounded to their dtype for the P V product, as in
    FlashAttention). ``scale`` defaults to 1 / sqrt(head_dim). ``causal``: query i sees keys j <= i only.
    """
    _check(q, k, v)
    o, _ = _attention_op(q, k, v, bool(causal), q.shape[-1] ** -0.5 if scale is None else float(scale))
    return o
