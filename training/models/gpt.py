"""A small decoder-only transformer, laid out for the parallelism functions.

Blocks live in a ModuleDict (`layers`) and the embedding, final norm and output head may be set
to None, so that a pipeline stage can delete what it doesn't own (torchtitan's layout). Attention
uses separate q/k/v/o projections and the MLP two linears: Megatron's column-then-row split
applies to them directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 for the head dim: under tensor parallelism each rank holds n_heads / tp heads.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def head_dim(self) -> int:
        return self.wq.in_features // self.n_heads


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = Attention(d_model, n_heads)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    pp_first = ("tok_embeddings", "pos_embeddings")
    pp_last = ("norm", "output")

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, ffn_mult: int):
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleDict({str(i): Block(d_model, n_heads, ffn_mult * d_model) for i in range(n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.output: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights keep the first losses near log(vocab).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
