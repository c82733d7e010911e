"""helpers.attention, FlashAttention-2 in Triton: the oracle, the blocked PyTorch loop, the forward and backward
kernels, the operator (opcheck, torch.compile) and what it refuses.

Every kernel result is checked against ``attention_reference`` in float64 (and its autograd for the gradients): fp32
closely, fp16/bf16 by asking for no more error than torch's own ``scaled_dot_product_attention`` makes in that dtype.
Under Triton's interpreter a loop step takes ~15 ms, so the CPU shapes are small: sequence lengths that are not
multiples of the 32-row tiles (1, 17, 100, 130, and queries and keys of different lengths), head_dim 16/32/64. On a
GPU the same file also runs real sizes: head_dim 64/128, sequences of 1000 and 4097, fp16 and bf16.
"""

import concurrent.futures
import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ON_GPU, traced_by_torch
from torch.autograd import forward_ad
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_leaves

import helpers
from helpers import flash_attention
from helpers.flash_attention import Blocks
from helpers.reference import attention_blocked, attention_reference

FORWARD = torch.ops.softmax_course.attention.default
BACKWARD = torch.ops.softmax_course.attention_backward.default
LOW_PRECISION = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def poisoned_attention_outputs(monkeypatch):
    """O, L, dQ, dK and dV start as NaN: an element a kernel forgets to write cannot pass a comparison."""
    monkeypatch.setattr(flash_attention, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def qkv(batch, heads, seq_q, seq_k, head_dim, seed=0):
    """float64 q, k, v and a gradient dO, on the kernels' device."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq_q, head_dim), *[(batch, heads, seq_k, head_dim)] * 2, (batch, heads, seq_q, head_dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(helpers.DEVICE) for shape in shapes]


def tensor(*shape, dtype=torch.float32, device=helpers.DEVICE):
    return torch.zeros(shape, dtype=dtype, device=device)


def scores(q, k, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def reference_with_grads(q, k, v, do, causal):
    """O and (dQ, dK, dV) of attention_reference in float64."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o = attention_reference(*leaves, causal)
    return o.detach(), torch.autograd.grad(o, leaves, do.double())


def sdpa_with_grads(q, k, v, do, causal, dtype):
    """O and gradients of torch's scaled_dot_product_attention in ``dtype``: the error a good kernel makes there."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    return o.detach(), torch.autograd.grad(o, leaves, do.to(dtype))


def assert_near(actual, expected, dtype, sdpa=None, name=""):
    """fp32: close to the float64 oracle, relative to the tensor's largest value. fp16/bf16: no more than twice
    SDPA's error (plus one rounding of the largest value), measured against the same oracle."""
    expected = expected.double()
    largest = expected.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, atol=1e-5 * max(largest, 1.0), rtol=1e-5,
                                   msg=lambda message: f"{name}: {message}")
        return
    error = (actual.double() - expected).abs().max().item()
    allowed = 2 * (sdpa.double() - expected).abs().max().item() + torch.finfo(dtype).eps * largest
    assert error <= allowed, f"{name}: max error {error:.3g}, SDPA's allows {allowed:.3g}"


def check(batch, heads, seq_q, seq_k, head_dim, causal, dtype):
    """The operator against the oracle: O and L, then dQ, dK and dV through its registered autograd."""
    q, k, v, do = qkv(batch, heads, seq_q, seq_k, head_dim)
    expected, expected_grads = reference_with_grads(q, k, v, do, causal)
    sdpa, sdpa_grads = sdpa_with_grads(q, k, v, do, causal, dtype) if dtype in LOW_PRECISION else (None, [None] * 3)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o, L = FORWARD(*leaves, causal, head_dim ** -0.5)
    assert o.dtype == dtype and L.dtype == torch.float32 and L.shape == q.shape[:-1]
    assert_near(o.detach(), expected, dtype, sdpa, "O")
    # L is in base 2 (L = lse / ln 2), of the scores of the inputs as rounded to dtype
    lse = torch.logsumexp(scores(*(t.detach().double() for t in leaves[:2]), causal), dim=-1)
    torch.testing.assert_close(L.detach().double() * math.log(2), lse, atol=1e-4, rtol=0)
    grads = torch.autograd.grad(o, leaves, do.to(dtype))
    for name, grad, expected_grad, sdpa_grad in zip(("dQ", "dK", "dV"), grads, expected_grads, sdpa_grads,
                                                   strict=True):
        assert grad.dtype == dtype
        assert_near(grad, expected_grad, dtype, sdpa_grad, name)


# (seq_q, seq_k, head_dim): lengths off the 32-row tiles, one query or key, more queries than keys and fewer
SHAPES = [(1, 1, 16), (17, 17, 16), (100, 100, 32), (130, 130, 64), (130, 37, 16), (37, 130, 32)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq_q, seq_k, head_dim", SHAPES)
def test_fp32(seq_q, seq_k, head_dim, causal):
    check(1, 2, seq_q, seq_k, head_dim, causal, torch.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seq_q, seq_k, head_dim", [(100, 100, 32), (130, 37, 16)])
def test_low_precision(seq_q, seq_k, head_dim, dtype, causal):
    check(1, 2, seq_q, seq_k, head_dim, causal, dtype)


@pytest.mark.skipif(ON_GPU, reason="the tiles of the interpreter; a GPU runs its own")
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16)])
@pytest.mark.parametrize("seq_q, seq_k, causal", [(130, 130, True), (100, 37, True), (37, 100, False)])
def test_unequal_tiles(monkeypatch, block_m, block_n, seq_q, seq_k, causal):
    """Query and key tiles of different heights: the diagonal crosses several key tiles (or a key tile several query
    tiles), so the masked and unmasked ranges of every kernel meet in the middle of a tile."""
    monkeypatch.setattr(flash_attention, "INTERPRETER_BLOCKS", Blocks(block_m, block_n, 1, 1))
    check(1, 1, seq_q, seq_k, 16, causal, torch.float32)


def test_any_strides():
    """q in (batch, seq, heads, head_dim) memory, k with every other head_dim element, v a slice of a longer
    sequence; o.sum() sends back a gradient with zero strides."""
    q, k, v, _ = qkv(2, 3, 70, 45, 16)
    q_strided = q.float().transpose(1, 2).contiguous().transpose(1, 2)
    k_strided = torch.stack([k.float(), torch.zeros_like(k.float())], dim=-1).flatten(-2)[..., ::2]
    v_strided = torch.cat([v.float(), v[:, :, :7].float()], dim=2)[:, :, :45]
    assert not any(t.is_contiguous() for t in (q_strided, k_strided, v_strided))
    leaves = [t.requires_grad_() for t in (q_strided, k_strided, v_strided)]
    o = helpers.attention(*leaves, causal=True)
    o.sum().backward()
    expected, expected_grads = reference_with_grads(q, k, v, torch.ones_like(q), True)
    assert_near(o.detach(), expected, torch.float32, name="O")
    for name, leaf, expected_grad in zip(("dQ", "dK", "dV"), leaves, expected_grads, strict=True):
        assert_near(leaf.grad, expected_grad, torch.float32, name=name)


@pytest.mark.parametrize("scale", [0.3, 0.0, -0.25], ids=["0.3", "zero", "negative"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale(scale, causal):
    """Any finite scale, as SDPA takes. At 0 every visible key weighs the same: a masked score is set to -inf after
    it is scaled, not before (-inf * 0 is NaN). A negative scale reverses the scores' order, so the max of QK^T is no
    longer the scaled scores' max: the kernels run it as -scale on -K. 33 keys: an unmasked tile and a masked one."""
    q, k, v, do = qkv(1, 2, 40, 33, 16)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    o = helpers.attention(*leaves, causal=causal, scale=scale)
    exact_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention_reference(*exact_leaves, causal, scale)
    assert_near(o.detach(), expected.detach(), torch.float32, name="O")
    for name, grad, expected_grad in zip(("dQ", "dK", "dV"), torch.autograd.grad(o, leaves, do.float()),
                                         torch.autograd.grad(expected, exact_leaves, do), strict=True):
        assert_near(grad, expected_grad, torch.float32, name=name)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_scale_not_finite(scale):
    q = tensor(1, 1, 4, 16)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        helpers.attention(q, q, q, scale=scale)


@pytest.mark.parametrize("causal, seq_q", [(False, 40), (True, 100), (True, 40)],
                         ids=["full", "causal", "causal, every row -inf"])
def test_keys_of_minus_infinity(causal, seq_q):
    """Keys 0-63 score -inf (a -inf in k), the whole first key block of a row at every tile size: the row starts at
    its first finite score, as torch's softmax does. 40 queries: a ragged last query block, whose padding (q = 0)
    times a key of -inf must not reach dK or dV. Causal, the first 64 rows see only -inf and are NaN, as torch's, and
    the keys hidden from them still get torch's dK (with 40 queries, 0 for the keys no query sees). Their dV is left
    out: torch's NaN P, hidden entries too, makes every key's dV NaN, here only the keys those rows see."""
    q, k, v, do = qkv(1, 2, seq_q, 80, 16)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., :64, 0] = float("-inf")
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    o = helpers.attention(*leaves, causal=causal)
    exact_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention_reference(*exact_leaves, causal)
    assert o[..., 64 if causal else 0:, :].isfinite().all() and o[..., :64, :].isnan().all() == causal
    torch.testing.assert_close(o.double(), expected.detach(), equal_nan=True, atol=1e-5, rtol=1e-5)
    grads = zip("qkv", torch.autograd.grad(o, leaves, do.float()), torch.autograd.grad(expected, exact_leaves, do),
                strict=True)
    for name, grad, expected_grad in list(grads)[:2 if causal else 3]:
        torch.testing.assert_close(grad.double(), expected_grad, equal_nan=True, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_nan_value(causal):
    """A NaN in V makes O, delta, dQ and dK NaN where torch's are, and no further: the keys a causal query hides, here
    keys 40-79 that no query sees, get torch's 0 in dK, not 0 * delta = NaN. (A delta zeroed for any NaN O, as for
    rows of -inf scores, lost the NaN in dK of the keys those rows see.)"""
    q, k, v, do = qkv(1, 2, 40, 80, 16)
    v[0, 0, 3, 0] = float("nan")
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    o = helpers.attention(*leaves, causal=causal)
    exact_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention_reference(*exact_leaves, causal)
    torch.testing.assert_close(o.double(), expected.detach(), equal_nan=True, atol=1e-5, rtol=1e-5)
    for name, grad, expected_grad in zip("qkv", torch.autograd.grad(o, leaves, do.float()),
                                         torch.autograd.grad(expected, exact_leaves, do), strict=True):
        assert expected_grad.isnan().any() == (name != "v")  # P has no NaN: dV = P^T dO has none either
        torch.testing.assert_close(grad.double(), expected_grad, equal_nan=True, atol=1e-5, rtol=1e-5, msg=name)


def test_empty():
    q, k, v, _ = qkv(2, 0, 5, 5, 16)
    assert helpers.attention(q.float(), k.float(), v.float()).shape == (2, 0, 5, 16)
    q = tensor(1, 1, 0, 16).requires_grad_()
    o = helpers.attention(q, tensor(1, 1, 3, 16), tensor(1, 1, 3, 16))
    o.sum().backward()
    assert o.shape == (1, 1, 0, 16) and q.grad.shape == q.shape


def test_empty_without_keys():
    """No keys is refused only where there are queries to answer: with batch or heads 0 the output is empty."""
    for shape in ((0, 1, 4, 16), (1, 0, 4, 16)):
        q = tensor(*shape).requires_grad_()
        kv = tensor(*shape[:2], 0, 16)
        o = helpers.attention(q, kv, kv)
        o.sum().backward()
        assert o.shape == shape and q.grad.shape == shape


def test_lazily_negated_views():
    """w.conj().imag is -w.imag with its data stored unnegated: q, k, v and dO such views, with the values of their
    negation, as SDPA reads them."""
    q, k, v, do = (t.float() for t in qkv(1, 2, 20, 17, 16))
    negated = [torch.complex(torch.zeros_like(t), -t).conj().imag for t in (q, k, v, do)]  # each equal to t
    assert all(t.is_neg() for t in negated)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = helpers.attention(*leaves, causal=True)
    expected_grads = torch.autograd.grad(o, leaves, do)
    views = [t.requires_grad_() for t in negated[:3]]
    o_views = helpers.attention(*views, causal=True)
    torch.testing.assert_close(o_views, o, atol=0, rtol=0)
    for grad, expected in zip(torch.autograd.grad(o_views, views, negated[3]), expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=0, rtol=0)


def test_offsets_past_2_to_the_31():
    """Rows 2**30 elements apart, the last at an offset of 2**31 within its head: the kernels index in 64 bits for
    such tensors (32-bit offsets wrapped, and read outside q, k and v). One 4 GB fp16 storage, of which the kernels
    and the test touch a few rows."""
    storage = torch.empty(2**31 + 64, dtype=torch.float16, device=helpers.DEVICE)
    views = [storage.as_strided((1, 1, 3, 16), (0, 0, 2**30, 1), offset) for offset in (0, 16, 32)]
    q, k, v, do = qkv(1, 1, 3, 3, 16)
    for view, values in zip(views, (q, k, v), strict=True):
        view.copy_(values)
    assert flash_attention.wide_offsets(views[0]) and not flash_attention.wide_offsets(q)
    leaves = [view.requires_grad_() for view in views]
    o = helpers.attention(*leaves, causal=True)
    sdpa, sdpa_grads = sdpa_with_grads(*views, do, True, torch.float16)
    expected, expected_grads = reference_with_grads(*views, do, True)
    assert_near(o.detach(), expected, torch.float16, sdpa, "O")
    for name, grad, expected_grad, sdpa_grad in zip(("dQ", "dK", "dV"), torch.autograd.grad(o, leaves, do.half()),
                                                   expected_grads, sdpa_grads, strict=True):
        assert_near(grad, expected_grad, torch.float16, sdpa_grad, name)


def test_batch_and_heads_past_a_grids_programs(monkeypatch):
    """batch * heads programs over GRID_Y_LIMIT (CUDA's 65535, 3 here) launch in slices of the batch; heads alone
    over it are refused."""
    monkeypatch.setattr(flash_attention, "GRID_Y_LIMIT", 3)
    check(3, 2, 20, 17, 16, True, torch.float32)  # 6 programs down: 3 launches of 1 batch each
    with pytest.raises(ValueError, match="at most 3"):
        helpers.attention(*(tensor(1, 4, 5, 16) for _ in range(3)))


# ---- the PyTorch versions ----
@pytest.mark.parametrize("seq_q, seq_k", [(17, 17), (40, 23), (23, 40)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_is_torchs_attention(seq_q, seq_k, causal):
    """Causal is top-left aligned, as torch's is_causal: query i sees keys 0..i."""
    q, k, v, _ = qkv(2, 3, seq_q, seq_k, 16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(attention_reference(q, k, v, causal), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("block", [1, 5, 16, 32, 77, 100, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_blocked_loop_is_the_reference(block, causal):
    """The online-softmax loop with an output accumulator gives the same O and log-sum-exp at every block size."""
    q, k, v, _ = qkv(2, 3, 90, 100, 16)
    o, lse = attention_blocked(q, k, v, causal, block=block)
    torch.testing.assert_close(o, attention_reference(q, k, v, causal), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores(q, k, causal), dim=-1), atol=1e-12, rtol=1e-12)


def test_blocked_loop_in_low_precision_computes_in_fp32():
    q, k, v = (t.bfloat16() for t in qkv(1, 2, 50, 50, 16)[:3])
    o, lse = attention_blocked(q, k, v, True)
    assert o.dtype == lse.dtype == torch.float32
    # against float64 on the same bf16 inputs: fp32 arithmetic is within 1e-6 (1.3e-7 measured), bf16's near 1e-2
    torch.testing.assert_close(o.double(), attention_reference(q.double(), k.double(), v.double(), True), atol=1e-6,
                               rtol=0)


# ---- the operator ----
def op_inputs(dtype=torch.float32):
    q, k, v, do = qkv(1, 2, 37, 20, 16)
    return [t.to(dtype) for t in (q, k, v, do)]


# torch logs this when it cannot compile a kernel to Triton's IR to see which arguments it writes (torch 2.11 with
# Triton 3.9: a Triton newer than the one the torch was built with), and then assumes it writes every one
UNREADABLE_KERNEL = "Encountered an exception in identify_mutated_tensors"


@pytest.mark.parametrize("scale", [0.25, None], ids=["0.25", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_forward(dtype, scale, caplog):
    """scale=None: the operator works out 1/sqrt(head_dim) itself, from head_dim as a symbol in the dynamic trace."""
    q, k, v, _ = op_inputs(dtype)
    args = (q.requires_grad_(), k.requires_grad_(), v.transpose(-2, -1).contiguous().transpose(-2, -1), True, scale)
    results = torch.library.opcheck(FORWARD, args, raise_exception=False)
    failed = {test for test, result in results.items() if result != "SUCCESS"}
    if failed == {"test_aot_dispatch_dynamic"} and UNREADABLE_KERNEL in caplog.text:
        pytest.xfail("this torch cannot read this Triton's kernels, so its AOT trace takes q, k and v as written")
    assert not failed, results


def test_opcheck_backward():
    q, k, v, do = op_inputs()
    o, L = FORWARD(q, k, v, False, 0.25)
    results = torch.library.opcheck(BACKWARD, (do.expand_as(o), q, k, v, o, L, False, 0.25))
    assert set(results.values()) == {"SUCCESS"}, results


def test_the_operators_check_their_inputs():
    """Called by name (a traced graph, a user), the operators refuse what helpers.attention refuses: k and v of fewer
    heads than q, or an L of fewer rows, would be read past their ends."""
    q, k, v, do = op_inputs()
    with pytest.raises(ValueError, match="share batch, heads and head_dim"):
        FORWARD(q, k[:, :1], v[:, :1], False, None)
    o, L = FORWARD(q, k, v, False, None)
    with pytest.raises(ValueError, match="L must have shape"):
        BACKWARD(do, q, k, v, o, L[:, :1], False, None)
    with pytest.raises(ValueError, match="dO must have shape"):
        BACKWARD(do[:, :, :5], q, k, v, o, L, False, None)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.enable_grad])
def test_inference_mode_records_nothing(grad_mode):
    """Under ``torch.inference_mode`` (``enable_grad`` inside it too) attention and its backward return inference
    tensors that require no grad, as F.scaled_dot_product_attention: the autograd.Functions, which would record them
    and save O, are not called."""
    q, k, v, do = (t.requires_grad_() for t in op_inputs())
    with torch.inference_mode(), grad_mode():
        o, expected = helpers.attention(q, k, v), F.scaled_dot_product_attention(q, k, v)
        _, L = FORWARD(q.detach(), k.detach(), v.detach(), False, None)
        grads = helpers.attention_ops._attention_backward(do, q, k, v, o, L, False, None)
    for got in (o, expected, *grads):
        assert (got.is_inference(), got.requires_grad, got.grad_fn) == (True, False, None)
    oracle, oracle_grads = reference_with_grads(q.detach(), k.detach(), v.detach(), do, False)
    for name, got, want in zip(("O", "dQ", "dK", "dV"), (o, *grads), (oracle, *oracle_grads), strict=True):
        assert_near(got, want, torch.float32, name=name)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the checks' shape tests, constant in the trace
def test_L_is_not_differentiable():
    """L comes out of the operator for its backward: a loss on it would get no gradient, so it asks for none."""
    q, k, v, _ = (t.requires_grad_() for t in op_inputs())
    o, L = FORWARD(q, k, v, False, None)
    assert o.requires_grad and not L.requires_grad


@pytest.mark.parametrize("subclass", ["TwoTensor", "Parameter"])
def test_tensor_subclasses(subclass):
    """A subclass with a dispatch of its own (TwoTensor: two tensors in one) meets the operators, as it meets SDPA's:
    its data is not the kernels' to read. nn.Parameter dispatches as a tensor and runs the kernels."""
    q, k, v, do = (t.float() for t in qkv(1, 2, 20, 17, 16))
    wrap = {"TwoTensor": lambda t: TwoTensor(t, 2 * t), "Parameter": torch.nn.Parameter}[subclass]
    leaves = [wrap(t.clone()).requires_grad_() for t in (q, k, v)]
    o = helpers.attention(*leaves, causal=True)
    grads = torch.autograd.grad(o, leaves, wrap(do) if subclass == "TwoTensor" else do)
    expected, expected_grads = reference_with_grads(q, k, v, do, True)
    if subclass == "TwoTensor":
        assert type(o) is TwoTensor
        doubled = attention_reference(*(2 * t for t in (q, k, v)), True)
        assert_near(o.b.detach(), doubled, torch.float32, name="O of the second tensor")
        o, grads = o.a, [grad.a for grad in grads]
    assert_near(o.detach(), expected, torch.float32, name="O")
    for name, grad, expected_grad in zip(("dQ", "dK", "dV"), grads, expected_grads, strict=True):
        assert_near(grad, expected_grad, torch.float32, name=name)


def test_calls_from_threads():
    """Four threads at once, each with its own lengths (Triton's interpreter keeps one grid for the process:
    ``kernels.launch`` runs one launch at a time)."""
    cases = [qkv(1, 2, 20 + 9 * i, 17 + 5 * i, 16, seed=i) for i in range(4)]

    def call(case):
        q, k, v, _ = case
        return helpers.attention(q.float(), k.float(), v.float(), causal=True), attention_reference(q, k, v, True)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for o, expected in pool.map(call, cases):
            assert_near(o, expected, torch.float32)


def test_the_default_scale_is_the_operators():
    """scale=None reaches the operator, which takes 1/sqrt(head_dim) of the q it is given: a torch.jit.trace recorded
    at head_dim 16 replays at head_dim 32 with head_dim 32's scale."""
    traced = torch.jit.trace(lambda q, k, v: helpers.attention(q, k, v), [t.float() for t in qkv(1, 2, 20, 20, 16)[:3]])
    q, k, v, _ = qkv(1, 2, 20, 20, 32)
    assert_near(traced(q.float(), k.float(), v.float()), attention_reference(q, k, v), torch.float32)


TRANSFORMS = {  # each of ``f(q, k, v)``, its results' leaves compared
    "grad": lambda f, q, k, v, do: torch.func.grad(lambda *a: (f(*a) * do).sum(), argnums=(0, 1, 2))(q, k, v),
    "vjp": lambda f, q, k, v, do: torch.func.vjp(f, q, k, v)[1](do),
    "jacrev": lambda f, q, k, v, do: torch.func.jacrev(f, argnums=1)(q[:, :, :3], k, v),  # jacobian of O by K
    "vmap over k": lambda f, q, k, v, do: torch.func.vmap(f, in_dims=(None, 0, None))(q, torch.stack([k, -k]), v),
    "vmap of grad": lambda f, q, k, v, do: torch.func.vmap(torch.func.grad(lambda *a: f(*a).sum()))(
        torch.stack([q, 2 * q]), torch.stack([k, k]), torch.stack([v, -v])),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_torch_func_transforms(transform):
    """torch.func's reverse-mode transforms and vmap run the kernels (vmap as more batch rows): fp32 values against
    the same transform of the reference in float64."""
    q, k, v, do = qkv(1, 2, 20, 17, 16)
    ours = TRANSFORMS[transform](lambda *a: helpers.attention(*a, causal=True), *(t.float() for t in (q, k, v, do)))
    exact = TRANSFORMS[transform](lambda *a: attention_reference(*a, causal=True), q, k, v, do)
    for actual, expected in zip(tree_leaves(ours), tree_leaves(exact), strict=True):
        assert actual.shape == expected.shape
        assert_near(actual, expected, torch.float32, name=transform)


def dual(run):
    with forward_ad.dual_level():
        return run()


def test_vmap_over_no_samples():
    q, k, v, _ = (t.float() for t in qkv(1, 2, 20, 17, 16))
    o = torch.func.vmap(functools.partial(helpers.attention, causal=True), in_dims=(0, None, None))(q[None][:0], k, v)
    assert o.shape == (0, 1, 2, 20, 16)


@pytest.mark.parametrize("mode", ["jvp", "jacfwd", "hessian", "dual", "functionalize"])
def test_forward_mode_is_refused(mode):
    """No forward rule: the operator's autograd would give zero tangents, so forward mode raises instead."""
    q, k, v = (t.float() for t in qkv(1, 1, 4, 4, 16)[:3])
    f = functools.partial(helpers.attention, k=k, v=v)
    runs = {"jvp": lambda: torch.func.jvp(f, (q,), (torch.ones_like(q),)),
            "jacfwd": lambda: torch.func.jacfwd(f)(q),
            "hessian": lambda: torch.func.hessian(lambda q: f(q).sum())(q),
            "dual": lambda: dual(lambda: f(forward_ad.make_dual(q, torch.ones_like(q)))),
            "functionalize": lambda: torch.func.jvp(torch.func.functionalize(f), (q,), (torch.ones_like(q),))}
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        runs[mode]()


@pytest.mark.parametrize("call", ["attention", "operator"])
def test_double_backward_is_refused(call):
    """The backward is not differentiable again: a gradient of the gradients raises, whether autograd went through
    helpers.attention or the operator's registered rule."""
    q, k, v = (t.float().requires_grad_() for t in qkv(1, 1, 4, 4, 16)[:3])
    o = helpers.attention(q, k, v) if call == "attention" else FORWARD(q, k, v, False, None)[0]
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="not differentiable"):
        dq.sum().backward()


def causal_attention(q, k, v):
    return helpers.attention(q * 2.0, k, v, causal=True) + 1.0


def test_no_graph_break():
    q, k, v, _ = op_inputs()
    explanation = torch._dynamo.explain(causal_attention)(q, k, v)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert "softmax_course.attention" in explanation.graphs[0].code


def compiled_against_eager(backend: str) -> None:
    torch._dynamo.reset()
    q, k, v, do = op_inputs()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves, do)
    o = torch.compile(causal_attention, backend=backend, fullgraph=True)(*leaves)
    grads = torch.autograd.grad(o, leaves, do)
    torch.testing.assert_close(o, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


@traced_by_torch
def test_compiled_aot_eager():
    """fullgraph=True: AOTAutograd traces the forward and the backward operator together, then runs them eagerly
    (on CPU the operators are opaque custom_ops, as helpers.softmax's: see test_operator.py)."""
    compiled_against_eager("aot_eager")


@pytest.mark.skipif(not ON_GPU, reason="Inductor compiles the Triton kernels it traces for a GPU; Triton's "
                    "interpreter cannot be traced (test_compiled_aot_eager covers the CPU path)")
@traced_by_torch
def test_compiled_inductor_traces_the_kernels():
    from torch._inductor.utils import run_and_get_code

    compiled_against_eager("inductor")
    torch._dynamo.reset()
    q, k, v, _ = op_inputs()
    _, (code, *_) = run_and_get_code(torch.compile(causal_attention, fullgraph=True), q, k, v)
    assert "attention_forward_kernel" in code  # Inductor launches our kernel itself


# ---- what it refuses ----
@pytest.mark.parametrize("causal, scale, message", [("False", None, "causal must be a bool"),
                                                   (1, None, "causal must be a bool"),
                                                   (np.bool_(True), None, "causal must be a bool, got .*numpy"),
                                                   (False, "0.5", "scale must be a number or None")])
def test_argument_types(causal, scale, message):
    """As SDPA's: causal="False" would be true."""
    q = tensor(1, 1, 4, 16)
    with pytest.raises(TypeError, match=message):
        helpers.attention(q, q, q, causal, scale)


@pytest.mark.parametrize("layout", ["sparse", "nested"])
def test_layouts(layout):
    q = tensor(1, 1, 4, 16)
    x = q.to_sparse() if layout == "sparse" else torch.nested.nested_tensor([q[0], q[0]], layout=torch.jagged)
    with pytest.raises(NotImplementedError, match="the kernels take dense"):
        helpers.attention(x, q, q)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool])
def test_dtype(dtype):
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        helpers.attention(tensor(1, 1, 4, 16, dtype=dtype), tensor(1, 1, 4, 16), tensor(1, 1, 4, 16))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="must share a dtype"):
        helpers.attention(tensor(1, 1, 4, 16), tensor(1, 1, 4, 16, dtype=torch.float16), tensor(1, 1, 4, 16))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        helpers.attention(tensor(1, 1, 4, 16), [[1.0]], tensor(1, 1, 4, 16))


def test_wrong_device():
    with pytest.raises(ValueError, match="but the kernels run on"):
        helpers.attention(tensor(1, 1, 4, 16), tensor(1, 1, 4, 16), tensor(1, 1, 4, 16, device="meta"))


@pytest.mark.parametrize("shapes, message", [
    (((4, 16), (4, 16), (4, 16)), "must be 4-D"),
    (((1, 2, 4, 16), (1, 3, 4, 16), (1, 3, 4, 16)), "share batch, heads and head_dim"),
    (((1, 2, 4, 16), (1, 2, 4, 32), (1, 2, 4, 32)), "share batch, heads and head_dim"),
    (((1, 2, 4, 16), (1, 2, 5, 16), (1, 2, 6, 16)), "k and v their seq length"),
    (((1, 2, 4, 48), (1, 2, 4, 48), (1, 2, 4, 48)), "power of two from 16 to 128"),
    (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "power of two from 16 to 128"),
    (((1, 2, 4, 256), (1, 2, 4, 256), (1, 2, 4, 256)), "power of two from 16 to 128"),
    (((1, 2, 4, 16), (1, 2, 0, 16), (1, 2, 0, 16)), "no keys"),
])
def test_shapes(shapes, message):
    with pytest.raises(ValueError, match=message):
        helpers.attention(*(tensor(*shape) for shape in shapes))


# ---- real sizes, on a GPU ----
@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU (the interpreter takes ~15 ms a tile step)")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seq", [1000, 4097])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_sizes(head_dim, seq, dtype, causal):
    check(2, 4, seq, seq, head_dim, causal, dtype)


@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_uneven_lengths(head_dim):
    check(1, 4, 1000, 777, head_dim, True, torch.float32)
    check(1, 4, 333, 4097, head_dim, False, torch.bfloat16)


# ---- the kernels compile for Hopper ----
COMPILE = r"""
import sys
import torch
import triton
import helpers
from helpers.flash_attention import DELTA_BLOCK_M, blocks_for
from helpers.display import cuobjdump
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from helpers import flash_attention as attention
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
for case in sys.argv[1:]:
    name, dtype, head_dim, causal, *wide = case.split(":")
    kernel, head_dim = getattr(attention, f"attention_{name}_kernel"), int(head_dim)
    b = blocks_for("forward" if name == "delta" else name, head_dim, DTYPES[dtype])
    warps, stages = (4, 1) if name == "delta" else (b.num_warps, b.num_stages)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=DELTA_BLOCK_M if name == "delta" else b.block_m, BLOCK_N=b.block_n,
                      CAUSAL=causal == "causal", WIDE=wide == ["wide"])
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        if param.name.endswith("stride_d"):  # contiguous head_dim: Triton specialises a stride of 1
            constexprs[param.name] = 1
        if param.name in constexprs:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):  # 16-byte aligned, as torch allocates
            signature[param.name] = "*fp32" if param.name in ("L_ptr", "delta_ptr") else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.name in ("scale", "qk_scale"):
            signature[param.name] = "fp64"  # as torch.compile passes a Python float
        else:  # strides, heads and lengths of contiguous (4, 16, 4096, head_dim) tensors: multiples of 16
            signature[param.name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {key: value for key, value in constexprs.items() if key in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    usage = cuobjdump(compiled.asm["cubin"], "-res-usage")
    stack = int(usage.split("STACK:")[1].split()[0])
    print(case, stack, "wgmma" in compiled.asm["ptx"], flush=True)
"""
COMPILE_CASES = (["forward:bf16:128:causal", "dkdv:bf16:128:causal", "dq:bf16:128:causal", "delta:bf16:128:full",
                  "forward:bf16:128:causal:wide"],
                 ["forward:fp16:64:full", "dkdv:fp16:64:full", "dq:fp16:64:full", "forward:fp32:128:causal",
                  "dkdv:bf16:128:causal:wide"])


def test_kernels_compile_for_hopper():
    """Built for an H100 (sm_90) with no GPU present, as test_compile.py does for the softmax kernels: the 16-bit dots
    become wgmma (tensor cores), and the 16-bit tiles of GPU_BLOCKS compile without spilling registers (stack 0) for
    the benchmark's shapes, whose strides and lengths Triton specialises as multiples of 16, with 32-bit indices and
    with 64-bit ones (``:wide``). Two processes, one per core."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(SOFTMAX_INTERPRET="0")
    runs = [subprocess.Popen([sys.executable, "-c", COMPILE, *cases], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for cases in COMPILE_CASES]
    lines = []
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=600)
            assert run.returncode == 0, stderr[-3000:]
            lines += stdout.split("\n")[:-1]
    finally:  # a timeout or a failed assert leaves no compiler process behind
        for run in runs:
            run.kill()
    compiled = {case: (int(stack), wgmma == "True") for case, stack, wgmma in map(str.split, lines)}
    assert len(compiled) == sum(map(len, COMPILE_CASES)), lines
    for case, (stack, wgmma) in compiled.items():
        if ":fp32:" not in case:  # fp32 runs exactly, on FMA units: checked for correctness, not tuned for speed
            assert stack == 0, f"{case} spills registers: {lines}"
        assert wgmma == (not case.startswith("delta") and ":fp32:" not in case), case  # fp32: exact, on FMA units
