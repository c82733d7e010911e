"""``helpers.attention``: the FlashAttention kernels of ``flash_attention`` as an autograd-aware PyTorch operator,
``torch.ops.softmax_course.attention``, registered as ``ops`` registers softmax (notebook 08), so that
torch.compile(fullgraph=True) traces through it (notebook 10). The operator checks its inputs itself, so that called
by name it refuses what ``attention`` refuses."""

from __future__ import annotations

import functools
import math
import numbers

import torch

from . import recipes
from .device import DEVICE, INTERPRET
from .flash_attention import DTYPES, HEAD_DIMS, attention_backward, attention_forward
from .ops import _forward_mode_on, _on_kernel_device, _operator, _watched


@functools.cache
def _before_ampere(index: int) -> bool:
    return torch.cuda.get_device_capability(index) < (8, 0)


def _check_device(name: str, t: torch.Tensor) -> None:
    if not _on_kernel_device(t):
        where = "cpu" if INTERPRET else DEVICE.type
        raise ValueError(f"{name} is on {t.device}, but the kernels run on {where}: move it with .to({where!r})")


def _check(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16 or float32 tensors")
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
        _check_device(name, t)
        if t.layout != torch.strided or t.is_nested:
            raise NotImplementedError(f"{name} is a {'nested' if t.is_nested else t.layout} tensor; the kernels take "
                                      f"dense (strided) tensors")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v must share batch, heads and head_dim, and k and v their seq length: got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[3]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a power of two from 16 to 128 (one tile wide), got {head_dim}")
    if k.shape[2] == 0 and q.numel() > 0:
        raise ValueError("k and v have no keys (seq length 0): softmax over no scores is undefined")
    if q.is_cuda and not torch.compiler.is_compiling() and _before_ampere(q.get_device()):
        raise RuntimeError("attention needs a GPU of compute capability 8.0 or newer: tl.dot is broken on older ones "
                           "(sm_75, the T4 of free Colab) with Triton >= 3.3")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """The scores' scale: 1 / sqrt(head_dim) by default, else any finite number (0 and negative ones too, as SDPA)."""
    if scale is None:
        return q.shape[3] ** -0.5
    if not -math.inf < scale < math.inf:
        raise ValueError(f"scale must be a finite number, got {scale}")
    return scale


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's body: (O, L) of checked inputs, L each row's base-2 log-sum-exp (fp32). A lazily negated view
    (w.conj().imag) is negated first: the kernels read its data as it is stored."""
    _check(q, k, v)
    return attention_forward(q.resolve_neg(), k.resolve_neg(), v.resolve_neg(), causal, _scale(q, scale))


def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, L: torch.Tensor,
              causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward operator's body: (dQ, dK, dV) from the forward's inputs, its saved O and L, and dO."""
    _check(q, k, v)
    for name, t, shape, dtype in (("dO", do, q.shape, q.dtype), ("O", o, q.shape, q.dtype),
                                  ("L", L, q.shape[:3], torch.float32)):
        _check_device(name, t)
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, as the forward returns it: "
                             f"got {tuple(t.shape)} and {t.dtype}")
    do, q, k, v, o = (t.resolve_neg() for t in (do, q, k, v, o))
    return attention_backward(do, q, k, v, o, L, causal, _scale(q, scale))


_attention_op = _operator("softmax_course::attention", _forward)
_attention_backward_op = _operator("softmax_course::attention_backward", _backward)


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)  # O and L: the backward recomputes P from them, never stores it
    ctx.mark_non_differentiable(output[1])  # L: the operator returns it for the backward, not for a loss


def _backward_autograd(ctx, do: torch.Tensor, dL: torch.Tensor | None) -> tuple:
    q, k, v, o, L = ctx.saved_tensors  # L is a statistic: its gradient (dL) is not propagated
    return (*_attention_backward(do, q, k, v, o, L, ctx.causal, ctx.scale), None, None)


torch.library.register_autograd("softmax_course::attention", _backward_autograd, setup_context=_setup_context)


def _not_differentiable(ctx, *grads: torch.Tensor) -> tuple:
    raise NotImplementedError("attention's backward is not differentiable: a gradient of its gradients (double "
                              "backward, a gradient penalty, a Hessian) needs F.scaled_dot_product_attention")


torch.library.register_autograd("softmax_course::attention_backward", _not_differentiable)


def _vmapped(fn, info, in_dims: tuple, tensors: tuple[torch.Tensor, ...], *rest) -> tuple:
    """``fn`` over a torch.func.vmap batch as more batch rows: each tensor's vmap dim moved first (expanded where it
    has none) and merged with the batch dim after it. Returns the outputs and their vmap dims (0)."""
    batched = [t.movedim(b, 0) if b is not None else t.expand(info.batch_size, *t.shape)
               for t, b in zip(tensors, in_dims[:len(tensors)], strict=True)]
    outputs = fn(*(t.flatten(0, 1) for t in batched), *rest)
    rows = batched[0].shape[1]  # each sample's batch
    return tuple(t.unflatten(0, (info.batch_size, rows)) for t in outputs), (0,) * len(outputs)


FORWARD_MODE_REFUSED = ("forward-mode AD (forward_ad, torch.func.jvp, jacfwd, hessian) through attention: its kernels "
                        "have no forward rule; F.scaled_dot_product_attention has one")


class Attention(torch.autograd.Function):
    """The operator's autograd (the same context and backward) for torch.func's transforms (grad, vjp, jacrev, vmap),
    which a ``register_autograd`` rule does not reach, and a clear refusal of forward mode, which that rule would
    answer with zero tangents."""

    forward = staticmethod(_forward)  # the body: under torch.func the operator would meet its own autograd rule
    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward_autograd)

    @staticmethod
    def jvp(ctx, *tangents) -> tuple:
        raise NotImplementedError(FORWARD_MODE_REFUSED)

    @staticmethod
    def vmap(info, in_dims: tuple, q, k, v, causal: bool, scale: float | None) -> tuple:
        return _vmapped(_attention, info, in_dims, (q, k, v), causal, scale)


class AttentionBackward(torch.autograd.Function):
    """The backward operator's body under autograd and torch.func: not differentiable again, and batched by vmap
    (jacrev runs the backward under vmap)."""

    forward = staticmethod(_backward)
    backward = jvp = staticmethod(_not_differentiable)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        pass  # nothing to save: its backward only refuses

    @staticmethod
    def vmap(info, in_dims: tuple, do, q, k, v, o, L, causal: bool, scale: float | None) -> tuple:
        return _vmapped(_attention_backward, info, in_dims, (do, q, k, v, o, L), causal, scale)


def _traced(*tensors: torch.Tensor) -> bool:
    """Whether the operators must run, for a tracer or a tensor subclass to see them: torch.compile, a dispatch mode,
    torch.jit.trace, tensors without data (a subclass with its own dispatch, FakeTensors), or torch.func.functionalize,
    whose wrappers autograd.Functions do not take."""
    return (torch.compiler.is_compiling() or _watched() or not recipes.plain(tensors)
            or any(torch._is_functional_tensor(t) for t in tensors))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L): the operator where a tracer must see it, else its body through ``Attention``."""
    if not _traced(q, k, v):
        if torch.is_inference_mode_enabled() and not _forward_mode_on():
            return _forward(q, k, v, causal, scale)  # autograd records nothing, and Attention would save O: refused
        return Attention.apply(q, k, v, causal, scale)
    if _forward_mode_on():  # the operator's autograd rule would give zero tangents
        raise NotImplementedError(FORWARD_MODE_REFUSED)
    return _attention_op(q, k, v, causal, scale)


def _attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        L: torch.Tensor, causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    """(dQ, dK, dV): the backward operator where a tracer must see it, else its body through ``AttentionBackward``."""
    if _traced(do, q, k, v, o, L):
        return _attention_backward_op(do, q, k, v, o, L, causal, scale)
    if torch.is_inference_mode_enabled():
        return _backward(do, q, k, v, o, L, causal, scale)  # as in _attention: autograd records nothing
    return AttentionBackward.apply(do, q, k, v, o, L, causal, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V by the Triton kernels, autograd-aware, as the operator
    ``torch.ops.softmax_course.attention`` (which also returns L): torch.compile(fullgraph=True) does not break on it.

    q: (batch, heads, seq_q, head_dim); k, v: (batch, heads, seq_k, head_dim); head_dim 16, 32, 64 or 128 (the
    kernels' tiles; SDPA takes others), batch and heads shared (no broadcast, no grouped keys); any strides; float16,
    bfloat16 or float32, accumulated in fp32 (16-bit inputs: P is rounded to their dtype for the P V product, as in
    FlashAttention). ``scale`` defaults to 1 / sqrt(head_dim). ``causal``: query i sees keys j <= i only. Gradients
    work under autograd and torch.func (grad, vjp, jacrev, vmap); forward mode and double backward are refused.
    """
    _check(q, k, v)  # before autograd.Function takes the arguments: its own errors would name none of them
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal)}")  # numpy 2 names its bool 'bool' too
    if not (scale is None or isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    return _attention(q, k, v, causal, None if scale is None else float(scale))[0]
