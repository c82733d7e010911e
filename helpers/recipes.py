"""Launching. What a call launches (kernels, grids, scratch buffers) depends only on its tensors' layout, so it is
worked out once per layout into a ``Recipe`` and cached. A repeat call then launches the compiled kernels directly on
scratch buffers it keeps: no planning, no allocation, and none of the argument binding Triton's JIT redoes on every
call."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import triton

from .device import DEVICE, INTERPRET
from .kernels import has_data, launch
from .plans import Plan
from .residency import compile_options


@dataclass(frozen=True)
class Buffer:
    """A call's scratch tensor: ``numel`` elements of ``dtype``, filled with ``fill`` (None: left uninitialised)."""

    numel: int
    dtype: torch.dtype
    fill: int | None = None

    def allocate(self, device: torch.device) -> torch.Tensor:
        if self.fill is None:
            return torch.empty(self.numel, dtype=self.dtype, device=device)
        return torch.full((self.numel,), self.fill, dtype=self.dtype, device=device)


@dataclass
class Step:
    """One launch of a call: ``kernel`` on ``grid`` programs of ``num_warps`` warps, compiled within ``max_registers``
    a thread if given. Its arguments are the call's tensors (its operands, then its buffers), then the integers
    ``ints``, then ``constexprs``."""

    kernel: triton.runtime.JITFunction
    grid: int
    ints: tuple
    constexprs: dict
    num_warps: int
    max_registers: int | None = None
    direct: object = None  # once prepared: a function of (addresses, stream) that launches (``_direct_launch``)
    build: object = None  # the compiled kernel ``direct`` launches, kept alive with it: from Triton 3.7 a build that
    # is freed unloads its module, and ``direct``'s function handle with it (two threads that compile one build at
    # once each make one, and Triton's cache and ``_builds`` keep only one of the two)

    def run(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Launch through ``kernels.launch``: traced tensors, or the interpreter."""
        launch(self.kernel, (self.grid,), *tensors, *self.ints, **self.constexprs,
               **compile_options(self.num_warps, self.max_registers))

    def prepare(self, tensors: tuple[torch.Tensor, ...]):
        """Find the kernel's build for ``tensors`` (``_builds``; else compile it, or find it in Triton's cache) and
        make ``direct``."""
        key = (self.kernel, self.num_warps, self.max_registers, tensors[0].get_device(), *self.constexprs.items(),
               *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
               *[(i == 1, i % 16 == 0, -2**31 <= i < 2**31) for i in self.ints])
        compiled = _builds.get(key)
        if compiled is None:
            compiled = self.kernel.warmup(*tensors, *self.ints, **self.constexprs, grid=(self.grid,),
                                          **compile_options(self.num_warps, self.max_registers))
            compiled[(self.grid, 1, 1)]  # loads the module: the kernel's function handle and launcher
            if len(_builds) >= MAX_RECIPES:
                _builds.clear()
            _builds[key] = compiled
        constants = tuple(self.constexprs[name] for name in self.kernel.arg_names[len(tensors) + len(self.ints):])
        self.build, self.direct = compiled, _direct_launch(compiled, self.grid, (*self.ints, *constants))
        return self.direct


# Compiled kernels by what Triton specialises a build on: the kernel, its options and constexprs, each tensor's dtype
# and whether it starts on 16 bytes, and each integer's type (32 or 64 bits) and whether it is 1 or a multiple of 16.
# A new layout built as one seen before (a row length that grows call by call) skips Triton's warmup, 20-50 us of the
# H100 host's time (results/README.md, "Row lengths that torch.compile traces as symbols").
_builds: dict[tuple, object] = {}


def _direct_launch(compiled, grid: int, scalars: tuple):
    """A function of (addresses, stream) that launches ``compiled`` on ``grid`` programs, the addresses then
    ``scalars`` as its arguments: its C launch called as Triton's launcher calls it, without the launcher's Python
    (0.9-2.3 us a call on the H100's host; Triton's launch hooks are not called). The C launch's arguments differ by
    Triton version: from 3.7 the kernel's arguments come as a tuple with their signature, in 3.5 and 3.6 spread after
    the scratch buffers. Other versions, and kernels that need scratch memory, go through the launcher."""
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    c_launch = launcher.launch
    needs_scratch = launcher.global_scratch_size or getattr(launcher, "profile_scratch_size", 0)
    if needs_scratch or getattr(launcher, "gsan_enabled", False) or not hasattr(launcher, "profile_scratch_size"):
        return lambda pointers, stream: launcher(grid, 1, 1, stream, function, metadata, None, None, None, *pointers,
                                                 *scalars)
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    if hasattr(launcher, "kernel_signature"):
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature
        return lambda pointers, stream: c_launch(grid, 1, 1, stream, function, cooperative, pdl, metadata, None, None,
                                                 None, None, None, annotations, signature, (*pointers, *scalars))
    return lambda pointers, stream: c_launch(grid, 1, 1, stream, function, cooperative, pdl, None, None, metadata, None,
                                             None, None, *pointers, *scalars)


# Scratch buffers up to this size are kept by their recipe from call to call, one set per CUDA stream: a call then
# allocates nothing but its output. Larger ones come with calls long enough on the GPU that the host's time is hidden.
KEPT_BUFFER_BYTES = 1 << 20
LAUNCH_DIRECTLY = DEVICE.type == "cuda" and not INTERPRET  # compiled kernels on torch's CUDA stream (else: the JIT)
_current_stream = torch._C._cuda_getCurrentRawStream if LAUNCH_DIRECTLY else None  # torch's, on a device index
_capturing = torch._C._cuda_isCurrentStreamCapturing if LAUNCH_DIRECTLY else None


class InGraphPool(threading.local):
    """``with in_graph_pool:`` the launches in the block may run in torch.compile's CUDA-graph warmup (``ops``' opaque
    operators), on the graph tree's own stream with every allocation going to its memory pool. There a kept buffer
    would outlive the graph's outputs and cudagraph trees would refuse the pool, so calls in the block on a stream
    other than the default one take buffers of their own, as a captured call does."""

    on = False

    def __enter__(self) -> None:
        self.on = True

    def __exit__(self, *exc) -> None:
        self.on = False


in_graph_pool = InGraphPool()


@dataclass
class Recipe:
    """Everything one call launches: its scratch buffers, and its steps in order."""

    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    kept: dict = field(default_factory=dict)  # stream -> this recipe's buffers on it, and their addresses

    def run(self, operands: tuple[torch.Tensor, ...]) -> None:
        """Launch every step on ``operands`` through ``kernels.launch``, on fresh buffers."""
        tensors = (*operands, *[buffer.allocate(operands[0].device) for buffer in self.buffers])
        for step in self.steps:
            step.run(tensors)

    def launch(self, operands: tuple[torch.Tensor, ...], pointers: tuple | list, device: int) -> None:
        """Launch every step directly on the current stream of GPU ``device``, handed the operands' addresses.

        A kept exchange buffer is ready for the next call as the kernels leave it (its tags), and calls on one stream
        run one after another. A call being captured into a CUDA graph takes buffers of its own, whose fill the graph
        replays: the graph may later run on another stream, beside calls on this one; so does a call on a side stream
        under ``in_graph_pool``. Without a GPU: ``run``."""
        if not LAUNCH_DIRECTLY:
            self.run(operands)
            return
        stream = _current_stream(device)
        buffers = ()
        if self.buffers:
            if stream and (in_graph_pool.on or _capturing()):  # stream 0, CUDA's legacy default stream: neither
                buffers, buffer_pointers = self._allocate(operands[0].device, None)
            else:
                buffers, buffer_pointers = self.kept.get(stream) or self._allocate(operands[0].device, stream)
            pointers = (*pointers, *buffer_pointers)
        for step in self.steps:
            (step.direct or step.prepare((*operands, *buffers)))(pointers, stream)

    def _allocate(self, device: torch.device, stream: int | None) -> tuple:
        """Fresh buffers and their addresses, kept for ``stream`` if it is not None and they are small."""
        buffers = tuple(buffer.allocate(device) for buffer in self.buffers)
        allocated = buffers, tuple(buffer.data_ptr() for buffer in buffers)
        kept_bytes = sum(buffer.numel() * buffer.element_size() for buffer in buffers)
        if stream is not None and kept_bytes <= KEPT_BUFFER_BYTES:
            self.kept[stream] = allocated
        return allocated


_recipes: dict[tuple, Recipe] = {}
MAX_RECIPES = 4096  # layouts remembered before the cache starts over


def recipe_for(build, operands: tuple[torch.Tensor, ...], plan: Plan | int | None = None) -> Recipe:
    """``build(*operands, plan)``, cached per layout: shape, device, and each tensor's strides, dtype and whether it
    starts on 16 bytes (the compiled kernels are specialised on it). Traced tensors, whose sizes can be symbolic, are
    planned afresh: torch.compile traces a call once. (The column kernels pass their dim as ``plan``.)"""
    if not plain(operands):
        return build(*operands, plan)
    key = [build, plan, operands[0].shape, operands[0].get_device()]
    for t in operands:
        key += t.stride(), t.dtype, t.data_ptr() % 16 == 0
    key = tuple(key)
    recipe = _recipes.get(key)
    if recipe is None:
        if len(_recipes) >= MAX_RECIPES:
            _recipes.clear()
        recipe = _recipes[key] = build(*operands, plan)
    return recipe


def plain(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether every tensor holds data to launch on (``kernels.has_data``), none traced (a FakeTensor, ...)."""
    for t in tensors:  # a loop: cheaper than all() over a generator
        if type(t) is not torch.Tensor and not has_data(t):
            return False
    return True


def run(build, operands: tuple[torch.Tensor, ...], plan: Plan | int | None) -> None:
    """Launch ``build``'s recipe for ``operands`` (``recipe_for``)."""
    recipe = recipe_for(build, operands, plan)
    if plain(operands):
        recipe.launch(operands, [t.data_ptr() for t in operands], operands[0].get_device())
    else:
        recipe.run(operands)
