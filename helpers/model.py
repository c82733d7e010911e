"""Notebook 08's tiny transformer: a character-level language model whose attention takes its softmax as an argument,
so the same model, from the same initial weights, trains with ``torch.softmax`` or ``helpers.softmax``; or, in
notebook 10, a whole causal attention (``helpers.attention`` or ``scaled_dot_product_attention``) instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

SoftmaxFn = Callable[[torch.Tensor, int], torch.Tensor]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # causal attention of q, k, v

# The training text: the course's subject, a few times over, so a small model can learn it in a few hundred steps.
TEXT = (
    "softmax turns scores into probabilities: subtract the row max, exponentiate, divide by the sum. "
    "the backward needs only the output: dx = y * (dy - sum(y * dy)). "
    "online softmax keeps a running max and a running denominator, and rescales the sum when the max grows. "
) * 8
VOCABULARY = sorted(set(TEXT))


@dataclass(frozen=True)
class Config:
    context: int  # T, tokens per sequence
    width: int  # model dimension
    heads: int
    layers: int
    batch: int


class CausalSelfAttention(nn.Module):
    """Multi-head attention whose probabilities come from ``softmax(scores, -1)``: rows of ``context`` scores, the
    future masked to -inf, so the first token's row has a single finite score."""

    def __init__(self, config: Config, softmax: SoftmaxFn | None, attention: AttentionFn | None = None):
        super().__init__()
        self.heads, self.softmax, self.attention = config.heads, softmax, attention
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)
        future = torch.ones(config.context, config.context, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = h.shape
        q, k, v = self.qkv(h).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention is not None:  # the scores never leave the kernel
            return self.out(self.attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width))
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(self.future[:tokens, :tokens], float("-inf"))
        p = self.softmax(scores, -1)  # (batch, heads, tokens, tokens): one softmax row per query
        return self.out((p @ v).transpose(1, 2).reshape(batch, tokens, width))


class Block(nn.Module):
    def __init__(self, config: Config, softmax: SoftmaxFn | None, attention: AttentionFn | None = None):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config, softmax, attention)
        self.mlp = nn.Sequential(nn.Linear(config.width, 4 * config.width), nn.GELU(),
                                 nn.Linear(4 * config.width, config.width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class TinyTransformer(nn.Module):
    def __init__(self, config: Config, softmax: SoftmaxFn | None, attention: AttentionFn | None = None):
        super().__init__()
        self.token = nn.Embedding(len(VOCABULARY), config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.Sequential(*(Block(config, softmax, attention) for _ in range(config.layers)))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, len(VOCABULARY))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.token(tokens) + self.position(positions))))


def batches(config: Config, steps: int, device: torch.device, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (input, next-token target) windows of TEXT, the same for every run with the same seed."""
    data = torch.tensor([VOCABULARY.index(c) for c in TEXT])
    starts = torch.randint(len(data) - config.context - 1, (steps, config.batch),
                           generator=torch.Generator().manual_seed(seed))
    windows = [torch.stack([data[s:s + config.context + 1] for s in step]) for step in starts]
    return [(w[:, :-1].to(device), w[:, 1:].to(device)) for w in windows]


def train(config: Config, softmax: SoftmaxFn | None, steps: int, device: torch.device, compile: bool = False,
          progress: Callable = iter, seed: int = 0, attention: AttentionFn | None = None) -> list[float]:
    """Train a fresh TinyTransformer (weights from ``seed``, so every softmax starts from the same model) for ``steps``
    AdamW steps, its attention from ``softmax`` or, given, from ``attention``; the loss of every step."""
    torch.manual_seed(seed)
    model = TinyTransformer(config, softmax, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    forward = torch.compile(model) if compile else model  # AOTAutograd compiles the backward with it
    losses = []
    for tokens, targets in progress(batches(config, steps, device, seed)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
