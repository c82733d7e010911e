"""Shared code of the softmax-in-Triton course.

Import this before triton: it picks the device and, on a machine with no GPU, switches on Triton's interpreter,
which must happen before triton is first imported.

Public API:
    DEVICE, INTERPRET        where kernels run (a torch.device) and whether that is Triton's CPU interpreter
    sized(gpu, cpu), ODD_SHAPE   sizes for this device: real on a GPU, small under the interpreter
    softmax(x, dim=-1, dtype=None)  autograd-aware softmax (Triton forward, Jacobian-free Triton backward), registered
                             as the operator torch.ops.softmax_course.softmax (notebook 08); dtype as torch.softmax's;
                             second order, forward mode and torch.func's transforms (notebook 04)
    softmax_forward(x, dim, dtype)  y = softmax(x, dim, dtype)
    softmax_backward(y, dy, dim, dtype)  dx (in dtype, by default y's) from the forward output y and the gradient dy
    graph_softmax(x, dim)    notebook 03's softmax, whose backward recomputes the forward and walks its graph
    reference                plain PyTorch forward, backward and explicit Jacobian (the oracles)
    kernels                  the teaching kernels of notebooks 01-05 and their launchers
    the kernels at the memory limit (notebooks 06-07), which softmax_forward/backward use, a module per idea:
      tiles                  whole rows per program (short and mid rows)
      split_rows, exchange   a long row split among programs that exchange partials
      two_pass               rows too long for a split's programs to be resident together
      columns, column_split  softmax over another dim of a contiguous tensor, in place (notebook 07)
      turned                 a dim held in the other order than the output's: channels-last, transposed (notebook 07)
      nested                 jagged nested tensors, through their values (notebook 07)
      plans, residency       the shape for a row length; how many programs the GPU holds at once
      fused, recipes         which kernels a call takes (launch_rows_forward/backward); launching them, cached
      steps                  notebook 06's steps, each runnable alone, and the GPU numbers that explain them
    show_source(obj)         display the real source of a helpers function or kernel in a notebook
    model                    notebook 08's tiny transformer, trained with either softmax
    attention(q, k, v, causal)  FlashAttention-2 forward and backward in Triton (flash_attention), the operator
                             softmax_course::attention (attention_ops; notebook 10)
"""

from . import device, fused, kernels, reference  # noqa: E402  (after device: triton is imported here)
from .attention_ops import attention
from .device import DEVICE, INTERPRET, ODD_SHAPE, describe, sized
from .display import show_source
from .ops import graph_softmax, softmax, softmax_backward, softmax_forward

__all__ = [
    "DEVICE",
    "INTERPRET",
    "ODD_SHAPE",
    "attention",
    "describe",
    "device",
    "graph_softmax",
    "columns",
    "fused",
    "kernels",
    "reference",
    "show_source",
    "sized",
    "softmax",
    "softmax_backward",
    "softmax_forward",
]
