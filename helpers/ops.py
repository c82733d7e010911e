"""The public softmax ops: shape, dtype and stride handling around the kernels, and the autograd wrapper.

Any rank and dim. Softmax over another dim than the last of contiguous tensors takes the column kernels
(``helpers.columns``: held whole, split into pieces that exchange partials (``helpers.column_split``), or taken in
two passes), and its output is laid out as its input. A dim held whole whose elements lie next to each other in the
input but not in torch's output (channels-last activations over their channels), or the other way round (a transposed
x over its last dim), takes turned tiles (``turned.takes``). Otherwise the softmax dim is moved last and the
rest flattened into rows, a view when strides allow it and a copy otherwise, and the output is fresh contiguous rows
in the input's shape, contiguous as torch's (a copy where the dim was not last). Inputs are never written.

Nested tensors of the jagged layout run on the kernels through their values (``helpers.nested``). What the kernels do
not take and torch does (a tensor on another device than theirs, a meta tensor, other nested tensors) gets torch's own
softmax.
"""

from __future__ import annotations

import functools
import operator

import numpy
import torch
from torch.autograd import forward_ad
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from . import columns, fused, kernels, nested, plans, recipes, turned
from .device import DEVICE, INTERPRET

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Whether a tensor is where the kernels run, by a property where one says (cheaper than building t.device).
_on_kernel_device = ((lambda t: t.is_cpu) if INTERPRET else (lambda t: t.is_cuda) if DEVICE.type == "cuda"
                     else (lambda t: t.device.type == DEVICE.type))


def _check_tensor(name: str, t: object, on_kernel_device: bool = True) -> None:
    """A tensor the kernels take: of a floating dtype, dense (strided), and, unless not asked, on their device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; softmax takes float16, bfloat16, float32 or float64 tensors")
    if on_kernel_device and not _on_kernel_device(t):
        expected = "cpu" if INTERPRET else DEVICE.type
        raise ValueError(f"{name} is on {t.device}, but the kernels run on {expected}: move it with .to({expected!r})")
    if t.layout != torch.strided or t.is_nested:
        raise NotImplementedError(f"{name} is a {'nested' if t.is_nested else t.layout} tensor; the kernels take "
                                  f"dense (strided) tensors")


def _wrapped_by_torch_func(*tensors: torch.Tensor) -> bool:
    """Whether a tensor is a torch.func wrapper (grad, vmap, jvp, ...): it holds no data, and the autograd.Functions'
    transform rules (``Softmax``) unwrap it for the kernels. A vmap batch that escaped its function has no rule left
    to unwrap it: refused, as torch refuses it."""
    wrapped = False
    for t in tensors:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            if torch._C._functorch.is_batchedtensor(t) and not torch._C._are_functorch_transforms_active():
                raise RuntimeError("a tensor of a torch.func.vmap batch escaped from the function being vmapped")
            wrapped = True
    return wrapped


def _int_dim(dim: object) -> int:
    """torch's rule for a dim's type: an int, or an integer that converts exactly (numpy's scalars, a 0-d integer
    tensor), but not a bool, an array or a tensor of more dims."""
    if isinstance(dim, torch.Tensor):
        integer = dim.ndim == 0 and not (dim.is_floating_point() or dim.is_complex() or dim.dtype == torch.bool)
    else:
        integer = not isinstance(dim, (bool, numpy.ndarray)) and hasattr(type(dim), "__index__")
    if not integer:
        raise TypeError(f"dim must be an int, not {type(dim).__name__}")
    return operator.index(dim)


def _dim_index(dim: int, ndim: int) -> int:
    """torch's rule: a 0-d tensor takes dim 0 or -1; negative dims count from the end."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The 2-D (rows, N) view of ``t`` with ``dim`` last; a copy only when strides cannot express it."""
    if t.ndim == 2 and dim == 1:
        return t  # already rows: each view op below costs the host a microsecond or two
    moved = t.reshape(1) if t.ndim == 0 else t if dim == t.ndim - 1 else t.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1])


def _holds_rows(shape: torch.Size, dim: int) -> bool:
    """Whether a contiguous tensor of ``shape`` holds its rows over ``dim`` back to back, as ``_rows`` lays them out:
    ``dim`` is last or of size 1, or every dim after it is of size 1."""
    return not shape or shape[dim] == 1 or all(size == 1 for size in shape[dim + 1:])


def _unrows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo ``_rows`` where ``_holds_rows`` does not: the contiguous rows moved into ``like``'s shape, a new
    contiguous tensor as torch.softmax returns (viewed back, they would hold ``dim`` last in memory)."""
    return rows.view(like.movedim(dim, -1).shape).movedim(-1, dim).contiguous()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of ``shape`` (a dim of size 0 or 1 counts as 1)."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


def _new_rows(n_rows: int, n_cols: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Output storage. Tests replace this with a NaN-filled version so unwritten elements show."""
    return like.new_empty((n_rows, n_cols), dtype=dtype)


def _new_contiguous_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor of ``like``'s shape (torch.softmax's layout for any input) and type (a subclass's, as
    torch's). Tests replace it too."""
    return like.new_empty(like.shape, dtype=dtype)


def _rows_output(like: torch.Tensor, dim: int, dtype: torch.dtype, launch) -> torch.Tensor:
    """A new output of ``like``'s shape and ``dtype`` in torch.softmax's layout, a tensor of its own as torch's (not a
    view: in-place ops such as ``detach_`` work on it), whose rows over ``dim`` ``launch(rows)`` writes: in place
    where its memory holds them (``_holds_rows``), else into new rows that ``_unrows`` then moves there."""
    if _holds_rows(like.shape, dim):
        out = _new_contiguous_output(like, dtype)
        launch(_rows(out, dim))  # a view of out: reshaping a contiguous tensor whose moved dims are of size 1
        return out
    n_cols = like.shape[dim]
    rows = _new_rows(like.numel() // n_cols, n_cols, like=like, dtype=dtype)
    launch(rows)
    return _unrows(rows, like, dim)


# The operators. On a GPU they are ``torch.library.triton_op``s: torch.compile sees through them to the kernel launches
# (``kernels.launch`` wraps them with ``wrap_triton``) and schedules those like its own kernels. Triton's interpreter
# cannot be traced, so on CPU they are opaque ``custom_op``s: torch.compile calls them as a black box. Either way the
# function itself works out the output's shape and strides for FakeTensors, without launching anything.
def _operator(name: str, fn):
    """Register ``fn`` (PyTorch code and kernel launches, no input written) as the operator ``name``."""
    if INTERPRET:
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return torch.library.triton_op(name, fn, mutates_args=())


def _forward(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The body of ``softmax_course::softmax``: rows in, the fused forward launch, rows out in ``dtype``."""
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=dtype)
    if not recipes.plain((x,)) and _runs_eager("forward", dim, x):
        return _eager_softmax_op(x, dim, dtype)  # traced, and best run by the eager launch (below)
    if columns.takes_columns(dim, x):
        y = _new_contiguous_output(x, dtype)
        if not recipes.plain((x,)) and columns.in_two_passes((y, x), dim):
            return _eager_softmax_op(x, dim, dtype)  # traced: opaque (below)
        columns.launch_columns_forward(x, y, dim)
        return y
    if turned.takes(dim, x):
        y = _new_contiguous_output(x, dtype)
        turned.launch_forward(x, y, dim)
        return y
    x_rows = _rows(x, dim)
    return _rows_output(x, dim, dtype, lambda y_rows: fused.launch_rows_forward(x_rows, y_rows))


def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The body of ``softmax_course::softmax_backward``: dx in ``dtype``."""
    if y.numel() == 0:
        return y.new_empty(y.shape, dtype=dtype)
    if _rounded_on_host(dtype, y, dy):
        return _backward(y, dy, dim, torch.float64).to(dtype)
    if not recipes.plain((y, dy)) and _runs_eager("backward", dim, y, dy):
        return _eager_softmax_backward_op(y, dy, dim, dtype)
    if columns.takes_columns(dim, y, dy):
        dx = _new_contiguous_output(y, dtype)
        if not recipes.plain((y, dy)) and columns.in_two_passes((dx, y, dy), dim):
            return _eager_softmax_backward_op(y, dy, dim, dtype)
        columns.launch_columns_backward(y, dy, dx, dim)
        return dx
    if turned.takes(dim, y, dy):
        dx = _new_contiguous_output(y, dtype)
        turned.launch_backward(y, dy, dx, dim)
        return dx
    y_rows, dy_rows = _rows(y, dim), _rows(dy, dim)
    return _rows_output(y, dim, dtype, lambda dx_rows: fused.launch_rows_backward(y_rows, dy_rows, dx_rows))


_softmax_op = _operator("softmax_course::softmax", _forward)
_softmax_backward_op = _operator("softmax_course::softmax_backward", _backward)


# Three kinds of traced call are recorded as opaque operators that run the eager launch, rather than as the kernels:
# - A size or stride that torch.compile traces as a symbol (dynamic shapes: dynamic=True, or a length that changed
#   between calls). A plan is made for numbers, so planning would fix the graph to one length and compile another at
#   the next (a decode loop's growing scores, and torch.compile gives up after 8). Opaque, one graph takes every length.
# - Rows whose plan caps its kernel's registers (Triton's maxnreg, ``plans.Plan.max_registers``). Inductor builds a
#   user's Triton kernel with its num_warps and num_stages only, so the pieces would compile uncapped, step down to
#   narrower ones and run up to 0.04 of copy slower (results/README.md, "Under torch.compile the register caps would
#   be lost").
# - Columns in two passes (``columns.in_two_passes``). Traced with its backward, a model whose forward and backward
#   each launch the two-pass column kernels failed to compile under torch 2.11 with Triton 3.9 (its partitioner:
#   "Node ... was invalid, but is output"), though either direction alone compiled, as did the two-pass rows.
# The choice is made in the operators' bodies, where a traced size is a number or visibly a symbol: to Dynamo, which
# runs ``softmax`` itself, every SymInt is an int.
def _output_like(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of ``dtype`` laid out as ``_forward`` or ``_backward`` lays out its result, torch's
    contiguous layout on every path: the fake implementation of the opaque operators. It asks no plan, which a
    symbolic size would have to be made concrete for."""
    return t.new_empty(t.shape, dtype=dtype)


def _symbolic(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile traces any size or stride of these tensors as a symbol."""
    return not all(is_concrete_int(n) for t in tensors for n in (*t.shape, *t.stride()))


def _runs_eager(phase: str, dim: int, t: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether a traced call over ``dim`` of ``t`` (and ``others``) is recorded as an opaque operator (above)."""
    if _symbolic(t, *others):
        return True
    if t.numel() == 0 or columns.takes_columns(dim, t, *others) or turned.takes(dim, t, *others):
        return False
    n_cols = t.shape[dim] if t.ndim else 1  # a 0-d tensor is one row of one element
    return plans.plan_for(n_cols, phase, t.element_size()).max_registers is not None


def _eager_forward(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A plain call of ``softmax`` (its launch kept per layout, below), which a compiled graph may run in its
    CUDA-graph memory pool (``recipes.in_graph_pool``)."""
    with recipes.in_graph_pool, torch.no_grad():
        return softmax(x, dim, dtype)


def _eager_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A plain call of ``softmax_backward``, which a compiled graph may run in its CUDA-graph memory pool."""
    with recipes.in_graph_pool, torch.no_grad():
        return softmax_backward(y, dy, dim, dtype)


# Defined through ``torch.library.Library`` rather than ``custom_op``, whose Python layers (autograd, aliasing checks)
# cost a compiled call tens of microseconds on the H100's host. They are called only inside the operators above, below
# autograd, so they need no autograd of their own.
_library = torch.library.Library("softmax_course", "FRAGMENT")
_library.define("softmax_eager(Tensor x, int dim, ScalarType dtype) -> Tensor")
_library.define("softmax_backward_eager(Tensor y, Tensor dy, int dim, ScalarType dtype) -> Tensor")
_library.impl("softmax_eager", _eager_forward, "CompositeExplicitAutograd")
_library.impl("softmax_backward_eager", _eager_backward, "CompositeExplicitAutograd")
torch.library.register_fake("softmax_course::softmax_eager", _output_like, lib=_library)
torch.library.register_fake("softmax_course::softmax_backward_eager",
                            lambda y, dy, dim, dtype: _output_like(y, dim, dtype),
                            lib=_library)
_eager_softmax_op = torch.ops.softmax_course.softmax_eager.default
_eager_softmax_backward_op = torch.ops.softmax_course.softmax_backward_eager.default


def _traced(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile is tracing the call, a tensor is traced (FakeTensors, torch.func.functionalize's
    wrappers, ...) or the call is watched (``_watched``): then the operator runs, for the tracer to see. Plain calls
    skip its dispatcher, which adds Python time to every call."""
    return torch.compiler.is_compiling() or not recipes.plain(tensors) or _functionalized(*tensors) or _watched()


_dispatch_modes, _jit_tracing = torch._C._len_torch_dispatch_stack, torch._C._get_tracing_state  # on every call


def _watched() -> bool:
    """Whether a TorchDispatchMode (a logger, a FLOP counter, make_fx) or torch.jit.trace is watching the ops that
    run: they see an operator only through its dispatcher."""
    return _dispatch_modes() > 0 or _jit_tracing() is not None


def _functionalized(*tensors: torch.Tensor) -> bool:
    """Whether a tensor is a ``torch.func.functionalize`` wrapper, whose ``data_ptr()`` is 0: the operator runs, which
    functionalize unwraps. The operator has no forward-mode rule (a tangent would come back as None, or zeros under
    torch.func.jvp), so forward mode is refused there."""
    if not any(torch._is_functional_tensor(t) for t in tensors):
        return False
    if _forward_mode_on():
        raise NotImplementedError("forward-mode AD (forward_ad, torch.func.jvp, jacfwd) through "
                                  "torch.func.functionalize: the softmax operator that functionalize runs has no "
                                  "forward-mode rule")
    return True


# Plain calls (tensors with data, nn.Parameters too, outside autograd and torch.compile) of a layout seen before go
# straight to its launch.
# The first call of a layout (shapes, strides, dtypes, device, dim, 16-byte starts, the dtype asked for) is checked and
# planned into its launch, which it leaves here under that key and then runs: a call of the same key passes the same
# checks and plans the same. A forward's key has 7 entries and a backward's 11, so they never meet.
_plain_calls: dict[tuple, object] = {}
_new_output = torch.empty_like  # a plain call's output, laid out as its input. Tests replace it, as _new_rows


def _remember(key: tuple, call) -> None:
    if len(_plain_calls) >= recipes.MAX_RECIPES:
        _plain_calls.clear()
    _plain_calls[key] = call


def _forward_call(x: torch.Tensor, dim: int, dtype: torch.dtype):
    """What a plain forward call of ``x``'s layout does from now on: ``_forward``, or for a tensor with a new tensor's
    strides, softmax over its last dim (contiguous rows) or down its columns (``columns.takes_columns``), or for
    turned tiles (``turned.takes``), the recipe launched on ``x`` into ``y``, by default a new output of
    ``dtype`` in torch's layout. Also the output the recipe was planned with (else None), for this first call to
    write into."""
    recipe, new_output = None, _new_output
    contiguous = x.numel() and x.stride() == _contiguous_strides(x.shape)
    if contiguous and (dim == x.ndim - 1 or columns.takes_columns(dim, x)):
        first_y = _new_output(x, dtype=dtype)
        if dim == x.ndim - 1:
            recipe = recipes.recipe_for(fused.forward_recipe, (_rows(first_y, dim), _rows(x, dim)))
        else:
            recipe = recipes.recipe_for(columns.forward_recipe, (first_y, x), dim)
    elif x.numel() and turned.takes(dim, x):
        first_y, new_output = _new_contiguous_output(x, dtype), _new_contiguous_output
        recipe = recipes.recipe_for(turned.forward_recipe, (first_y, x), dim)
    if recipe is None:
        return (lambda x, x_ptr, y=None: _forward(x, dim, dtype)), None
    device = x.get_device()

    def launch(x: torch.Tensor, x_ptr: int, y: torch.Tensor | None = None) -> torch.Tensor:
        if y is None:
            y = new_output(x, dtype=dtype)
        recipe.launch((y, x), (y.data_ptr(), x_ptr), device)
        return y

    return launch, first_y


def _rounded_on_host(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether an fp64 result is to be stored in bf16 under Triton's interpreter, which casts fp64 to bf16 as if to a
    16-bit integer (zeros): ``_backward`` computes it in fp64 and rounds it on the host (as a GPU's store would)."""
    return INTERPRET and dtype == torch.bfloat16 and kernels.compute_dtype(*tensors) == torch.float64


def _backward_call(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype):
    """``_forward_call`` for the backward."""
    recipe, new_output = None, _new_output
    planned = y.numel() and not _rounded_on_host(dtype, y, dy)
    contiguous = planned and y.stride() == _contiguous_strides(y.shape) and dy.is_contiguous()
    if contiguous and (dim == y.ndim - 1 or columns.takes_columns(dim, y, dy)):
        first_dx = _new_output(y, dtype=dtype)
        if dim == y.ndim - 1:
            recipe = recipes.recipe_for(fused.backward_recipe, (_rows(first_dx, dim), _rows(y, dim), _rows(dy, dim)))
        else:
            recipe = recipes.recipe_for(columns.backward_recipe, (first_dx, y, dy), dim)
    elif planned and turned.takes(dim, y, dy):
        first_dx, new_output = _new_contiguous_output(y, dtype), _new_contiguous_output
        recipe = recipes.recipe_for(turned.backward_recipe, (first_dx, y, dy), dim)
    if recipe is None:
        return (lambda y, dy, y_ptr, dy_ptr, dx=None: _backward(y, dy, dim, dtype)), None
    device = y.get_device()

    def launch(y: torch.Tensor, dy: torch.Tensor, y_ptr: int, dy_ptr: int, dx: torch.Tensor | None = None):
        if dx is None:
            dx = new_output(y, dtype=dtype)
        recipe.launch((dx, y, dy), (dx.data_ptr(), y_ptr, dy_ptr), device)
        return dx

    return launch, first_dx


def _result_dtype(dtype: object, default: torch.dtype) -> torch.dtype:
    """A result's dtype: ``dtype``, or ``default`` where it is None; Python's ``float`` is float64, as in torch."""
    if dtype is None:
        return default
    if dtype is float:
        return torch.float64
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point torch.dtype (float16, bfloat16, float32 or float64), "
                        f"got {dtype}")
    return dtype


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Autograd-aware softmax: a drop-in for ``torch.softmax(x, dim, dtype)`` on the course's device, and a PyTorch
    operator (``torch.ops.softmax_course.softmax``) that torch.compile traces through on a GPU (notebook 08).

    fp16 and bf16 are computed in fp32 and stored back in their dtype; fp64 is computed in fp64. ``dtype``, as
    torch's, is the output's, to which ``x`` is cast first: a 16-bit ``x`` to fp32 (the upcast attention code asks
    for) in the kernels as they load it, any other cast by ``x.to(dtype)``. Under CUDA autocast a 16-bit ``x`` and
    no ``dtype`` give fp32, as torch's does. Its backward is ``softmax_backward`` of the saved output, into ``x``'s
    dtype. The backward is differentiable again, and forward mode (a tangent's ``J @ x_t``) and torch.func's
    transforms (grad, vmap, jacrev, jacfwd, hessian, ...) run on the same kernels. A meta tensor (shapes, no data)
    gets torch.softmax's meta result, and a tensor on another device (a CPU tensor on a GPU machine) torch's own
    softmax. A nested tensor of the jagged layout, (batch, sequence, ...) with its sequences back to back, is softmax
    of its values over any dim after the sequence dim, and over the sequence dim of its sequences padded with -inf
    (where torch.softmax's own gradient is wrong in torch 2.13); other nested tensors are torch's.
    """
    if type(dim) is not int:
        return softmax(x, _int_dim(dim), dtype)  # one type for the layout's key: 1.0 == True == 1
    if dtype is None and _any_autocast() and _autocast_widens(x):
        dtype = torch.float32
    key = x_ptr = None
    if not torch.compiler.is_compiling() and (type(x) is torch.Tensor or kernels.has_data(x)):
        if x.is_neg():  # a lazily negated view (w.conj().imag): the kernels would read its data unnegated
            return softmax(x.resolve_neg(), dim, dtype)
        try:
            x_ptr = x.data_ptr()
            key = (x.shape, x.stride(), x.dtype, x.get_device(), dim, x_ptr % 16 == 0, dtype)
        except RuntimeError:  # no data (a torch.func wrapper, a legacy vmap's batch, a sparse tensor) or no strides
            x_ptr = None  # (a nested tensor)
        else:
            call = _plain_calls.get(key)
            if call is not None and (x_ptr or not x.numel()) and not (x.requires_grad and _grad_recorded()) and (
                    forward_ad._current_level < 0 or not torch._C._is_fwd_grad_enabled()) and (  # _forward_mode_on
                    not _dispatch_modes() and _jit_tracing() is None):  # not _watched(), inline
                return call(x, x_ptr)  # (x_ptr 0 with elements: a torch.func.functionalize wrapper, traced)
    if isinstance(x, torch.Tensor) and (x.dtype not in FLOAT_DTYPES if dtype is None else isinstance(
            dtype, torch.dtype) and dtype not in FLOAT_DTYPES) and not x.is_nested and not x.numel():
        _dim_index(dim, x.ndim)
        return torch.softmax(x, dim, dtype)  # nothing to compute, so torch takes any dtype: its empty result
    if dtype is not None and isinstance(x, torch.Tensor) and x.dtype not in FLOAT_DTYPES:
        return softmax(x.to(_result_dtype(dtype, x.dtype)), dim)  # integers, bools: cast first, as torch's
    if isinstance(x, torch.Tensor) and x.is_nested:
        return _nested_softmax(x, dim, dtype)
    if isinstance(x, torch.Tensor) and not _on_kernel_device(x):  # torch's own: meta (shapes only), another device
        _dim_index(dim, x.ndim)  # torch's check, which its meta softmax skips
        return torch.softmax(x, dim, dtype)
    _check_tensor("x", x)
    dim = _dim_index(dim, x.ndim)
    y_dtype = _result_dtype(dtype, x.dtype)
    if y_dtype != x.dtype and not (y_dtype == torch.float32 and x.element_size() == 2):
        return softmax(x.to(y_dtype), dim)  # a cast the kernels do not make as they load: torch's order
    if _traced(x) or (x_ptr is None and not _wrapped_by_torch_func(x)):
        return _softmax_op(x, dim, y_dtype)  # traced, or no data: a legacy vmap's batch, which runs sample by sample
    if x_ptr is None or (x.requires_grad and _grad_recorded()) or _forward_mode_on():  # None: torch.func's
        return Softmax.apply(x, dim, y_dtype)  # the operator's autograd, without its dispatcher; back here to run
    call, y = _forward_call(x, dim, y_dtype)
    _remember(key, call)
    return call(x, x_ptr, y)


_any_autocast = torch._C._is_any_autocast_enabled  # read on every call: one lookup less


def _autocast_widens(x: object) -> bool:
    """Whether torch.softmax of ``x`` under the autocast now on returns fp32: CUDA autocast's float32 list holds
    softmax (CPU autocast's does not), and it widens 16-bit tensors only."""
    return (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and torch.is_autocast_enabled("cuda"))


def softmax_forward(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = softmax(x, dim, dtype)`` by the fused Triton forward kernels (notebook 06): the same operator as
    ``softmax``."""
    return softmax(x, dim, dtype)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int = -1,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dx`` from the forward output ``y`` and the incoming gradient ``dy``: ``dx = y * (dy - sum(y * dy, dim))``,
    by the fused Triton backward kernels (notebook 06); ``torch.ops.softmax_course.softmax_backward``. It is computed
    in fp32 (fp64 if ``y`` or ``dy`` is) and stored in ``dtype``, the forward input's, by default ``y``'s. Meta
    tensors, other devices and nested tensors go as in ``softmax``, the jagged ones' ``y`` and ``dy`` with sequences
    of the same lengths."""
    if type(dim) is not int:
        return softmax_backward(y, dy, _int_dim(dim), dtype)
    key = y_ptr = dy_ptr = None
    if not torch.compiler.is_compiling() and (type(y) is torch.Tensor or kernels.has_data(y)) and (
            type(dy) is torch.Tensor or kernels.has_data(dy)):
        if y.is_neg() or dy.is_neg():  # as in softmax
            return softmax_backward(y.resolve_neg(), dy.resolve_neg(), dim, dtype)
        try:
            y_ptr, dy_ptr = y.data_ptr(), dy.data_ptr()
            key = (y.shape, dy.shape, y.stride(), dy.stride(), y.dtype, dy.dtype, y.get_device(), dim,
                   y_ptr % 16 == 0, dy_ptr % 16 == 0, dtype)
        except RuntimeError:  # as in softmax
            y_ptr = None
        else:
            call = _plain_calls.get(key)
            if call is not None and (y_ptr and dy_ptr or not y.numel()) and not (
                    _grad_recorded() and (y.requires_grad or dy.requires_grad)) and (
                    forward_ad._current_level < 0 or not torch._C._is_fwd_grad_enabled()) and (  # _forward_mode_on
                    not _dispatch_modes() and _jit_tracing() is None):  # not _watched()
                return call(y, dy, y_ptr, dy_ptr)
    if isinstance(y, torch.Tensor) and isinstance(dy, torch.Tensor) and (y.is_nested or dy.is_nested):
        return _nested_backward(y, dy, dim, _result_dtype(dtype, y.dtype))
    elsewhere = isinstance(y, torch.Tensor) and isinstance(dy, torch.Tensor) and not (
        _on_kernel_device(y) and _on_kernel_device(dy))
    _check_tensor("y", y, on_kernel_device=not elsewhere)
    _check_tensor("dy", dy, on_kernel_device=not elsewhere)
    if y.shape != dy.shape:
        raise ValueError(f"y and dy must have the same shape, got {tuple(y.shape)} and {tuple(dy.shape)}")
    dx_dtype = _result_dtype(dtype, y.dtype)
    if elsewhere:  # torch's own: meta (shapes only), another device
        _dim_index(dim, y.ndim)
        return _torch_backward(y, dy, dim, dx_dtype)
    dim = _dim_index(dim, y.ndim)
    if _traced(y, dy) or (y_ptr is None and not _wrapped_by_torch_func(y, dy)):
        return _softmax_backward_op(y, dy, dim, dx_dtype)
    if y_ptr is None or (_grad_recorded() and (y.requires_grad or dy.requires_grad)) or _forward_mode_on():
        return SoftmaxBackward.apply(y, dy, dim, dx_dtype)  # y_ptr None: torch.func's wrappers, as in softmax
    call, dx = _backward_call(y, dy, dim, dx_dtype)
    _remember(key, call)
    return call(y, dy, y_ptr, dy_ptr, dx)


def _nested_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None) -> torch.Tensor:
    dim_index = _dim_index(dim, x.dim())
    if not nested.takes_kernels(x, dim_index):
        return torch.softmax(x, dim, dtype)
    return nested.softmax(x, dim_index, functools.partial(softmax, dtype=dtype))


def _nested_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    dim_index = _dim_index(dim, y.dim())
    if not (nested.takes_kernels(y, dim_index) and nested.takes_kernels(dy, dim_index)):
        return _torch_backward(y, dy, dim, dtype)
    return nested.softmax_backward(y, dy, dim_index, functools.partial(softmax_backward, dtype=dtype))


def _torch_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``softmax_backward`` where the kernels do not run (meta tensors, another device than theirs, nested tensors
    ``nested.takes_kernels`` refuses): torch's own backward, in the precision the kernels compute in, then ``dtype``."""
    wide = kernels.compute_dtype(y, dy)
    dx = torch._softmax_backward_data(dy.to(wide), y.to(wide), dim, wide).to(dtype)
    if dx.is_nested or dx.stride() == _contiguous_strides(dx.shape):
        return dx
    return _new_contiguous_output(dx, dtype).copy_(dx)  # torch.softmax's layout, as the kernels' dx


def _grad_recorded() -> bool:
    """Whether autograd records calls now: grad mode on, and inference mode off. Under ``inference_mode`` torch records
    nothing even inside ``enable_grad``, but an autograd.Function would, and fail to save an inference tensor."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def _forward_mode_on() -> bool:
    """Whether forward-mode AD sees this call: inside ``forward_ad.dual_level()`` (``torch.func.jvp`` enters one too),
    and not in an autograd.Function's forward, which turns it off."""
    return forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()


def _widened(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in fp32, or fp64 if any is: the precision of the second-order terms computed in PyTorch."""
    wide = kernels.compute_dtype(*tensors)
    return [t.to(wide) for t in tensors]


def _vmapped(fn, info, in_dims: tuple, tensors: tuple[torch.Tensor, ...], dim: int, dtype: torch.dtype):
    """``fn`` (``softmax`` or ``softmax_backward``) over a ``torch.func.vmap`` batch in one call: each tensor's batch
    dim moved first (a tensor without one expanded to the batch), the softmax dim one further on, a 0-d sample as a
    row of one element. Returns the result and its batch dim, 0."""
    batched = [t.movedim(b, 0) if b is not None else t.expand(info.batch_size, *t.shape)
               for t, b in zip(tensors, in_dims[:len(tensors)], strict=True)]
    if batched[0].ndim == 1:
        return fn(*(t.unsqueeze(1) for t in batched), 1, dtype).squeeze(1), 0
    return fn(*batched, _dim_index(dim, batched[0].ndim - 1) + 1, dtype), 0


class Softmax(torch.autograd.Function):
    """Triton forward; the backward uses only the saved output ``y`` (no Jacobian, no re-read of ``x``).

    ``jvp`` (forward mode) and ``vmap`` let ``forward_ad`` and ``torch.func``'s transforms through as well."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return softmax_forward(x, dim, dtype)

    @staticmethod
    def setup_context(ctx, inputs: tuple[torch.Tensor, int, torch.dtype | None], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)  # y, not x
        ctx.save_for_forward(output)
        ctx.dim, ctx.x_dtype = inputs[1], inputs[0].dtype

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, ctx.dim, ctx.x_dtype), None, None

    @staticmethod
    def jvp(ctx, x_tangent: torch.Tensor, _dim, _dtype) -> torch.Tensor:
        """The Jacobian is symmetric, so the tangent ``J @ x_tangent`` is the backward's formula applied to it (in the
        wider of y's and the tangent's dtypes, as torch's)."""
        (y,) = ctx.saved_tensors
        return softmax_backward(y, x_tangent, ctx.dim, torch.promote_types(y.dtype, x_tangent.dtype))

    @staticmethod
    def vmap(info, in_dims: tuple, x: torch.Tensor, dim: int, dtype: torch.dtype | None):
        return _vmapped(softmax, info, in_dims, (x,), dim, dtype)


# The operator's autograd is this Function's: the same context and backward, registered once (notebook 08).
torch.library.register_autograd("softmax_course::softmax", Softmax.backward, setup_context=Softmax.setup_context)


def _save_backward_inputs(ctx, inputs: tuple[torch.Tensor, torch.Tensor, int, torch.dtype], output: torch.Tensor):
    y, dy, ctx.dim, ctx.dx_dtype = inputs
    ctx.save_for_backward(y, dy)
    ctx.save_for_forward(y, dy)


def _backward_backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
    """The gradients of ``dx = y * (dy - <y, dy>)`` for an incoming ``g``, which make the backward differentiable
    (a gradient penalty, a Hessian-vector product; notebook 04). ``dx`` is linear in ``dy``, so the gradient for
    ``dy`` is the same backward of ``g``: ``y * (g - <y, g>)``. The gradient for ``y`` is
    ``g * (dy - <y, dy>) - dy * <g, y>``, in PyTorch at fp32 (fp64 if any input is)."""
    y, dy = ctx.saved_tensors
    grad_y = grad_dy = None
    if ctx.needs_input_grad[1]:
        grad_dy = softmax_backward(y, g, ctx.dim, dy.dtype)
    if ctx.needs_input_grad[0]:
        y_w, dy_w, g_w = _widened(y, dy, g)
        grad_y = (g_w * (dy_w - (y_w * dy_w).sum(ctx.dim, keepdim=True))
                  - dy_w * (g_w * y_w).sum(ctx.dim, keepdim=True)).to(y.dtype)
    return grad_y, grad_dy, None, None


torch.library.register_autograd("softmax_course::softmax_backward", _backward_backward,
                                setup_context=_save_backward_inputs)


class SoftmaxBackward(torch.autograd.Function):
    """``softmax_backward`` in eager autograd: the operator's context and gradients (above), with forward mode and
    ``vmap`` as ``Softmax`` has them."""

    @staticmethod
    def forward(y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return softmax_backward(y, dy, dim, dtype)

    setup_context = staticmethod(_save_backward_inputs)
    backward = staticmethod(_backward_backward)

    @staticmethod
    def jvp(ctx, y_tangent: torch.Tensor | None, dy_tangent: torch.Tensor | None, _dim, _dtype) -> torch.Tensor:
        """The change in ``dx = y * (dy - <y, dy>)``: the backward of ``dy``'s tangent (it is linear in ``dy``), plus
        ``y_t * (dy - <y, dy>) - y * <y_t, dy>`` for ``y``'s tangent ``y_t``, in PyTorch at fp32 (fp64 if any is).
        Its dtype is torch's: ``dx``'s where that is a cast from ``y``'s, else the widest of ``dx``'s and the
        tangents'."""
        y, dy = ctx.saved_tensors
        tangent_dtype = ctx.dx_dtype
        if ctx.dx_dtype == y.dtype:  # no cast: the widest
            for t in (y_tangent, dy_tangent):
                tangent_dtype = tangent_dtype if t is None else torch.promote_types(tangent_dtype, t.dtype)
        tangent = None
        if y_tangent is not None:
            y_w, dy_w, y_t = _widened(y, dy, y_tangent)
            tangent = (y_t * (dy_w - (y_w * dy_w).sum(ctx.dim, keepdim=True))
                       - y_w * (y_t * dy_w).sum(ctx.dim, keepdim=True))
        if dy_tangent is not None:
            from_dy = softmax_backward(y, dy_tangent, ctx.dim, tangent_dtype if tangent is None else tangent.dtype)
            tangent = from_dy if tangent is None else tangent + from_dy
        return tangent.to(tangent_dtype)

    @staticmethod
    def vmap(info, in_dims: tuple, y: torch.Tensor, dy: torch.Tensor, dim: int, dtype: torch.dtype):
        return _vmapped(softmax_backward, info, in_dims, (y, dy), dim, dtype)


class GraphSoftmax(torch.autograd.Function):
    """Notebook 03's version: saves the input ``x`` and recomputes the forward inside the graph backward kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.dim = dim
        return softmax_forward(x, dim)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        if torch.is_grad_enabled():  # create_graph=True: differentiating dx would need the graph kernel's own backward
            raise RuntimeError("graph_softmax's backward is not differentiable: use helpers.softmax, whose is")
        (x,) = ctx.saved_tensors
        if x.numel() == 0:
            return torch.zeros_like(x), None
        x_rows, dy_rows = _rows(x, ctx.dim), _rows(dy, ctx.dim)
        return _rows_output(x, ctx.dim, x.dtype,
                            lambda dx_rows: kernels.launch_graph_backward(x_rows, dy_rows, dx_rows)), None


def graph_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax whose backward walks the computational graph (notebook 03); ``softmax`` is the one to use."""
    _check_tensor("x", x)
    return GraphSoftmax.apply(x, _dim_index(_int_dim(dim), x.ndim))
