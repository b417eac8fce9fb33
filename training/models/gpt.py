"""A small decoder-only transformer: the built-in model, declared like any user model.

It says what only it can say, the way a user's model does: its blocks live in a ModuleDict
(`layers`, found as the longest list of same-class children); `_tp_plan` splits attention's q/k/v
and the first feed-forward linear by columns and their partners by rows (Megatron's pairing, in
Hugging Face's words) and names the norms sequence parallelism splits by position; `pp_first`/`pp_last` name what only the first and last pipeline stage keep,
and its forward skips whatever a stage removed (torchtitan's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.models.moe import GroupedExperts, MoE


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


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward in every block (training/models/moe.py)."""

    n_experts: int
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01

    def build(self, d_model: int, hidden: int) -> MoE:
        return MoE(d_model, hidden, self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_coef)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, dropout: float = 0.0, experts: Experts | None = None):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = Attention(d_model, n_heads)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, ffn_hidden) if experts is None else experts.build(d_model, ffn_hidden)
        # Megatron's hidden dropout after each sublayer (off by default: ranks draw different
        # masks, so a run with it is not bitwise one process's).
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights keep the first losses near log(vocab).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    if isinstance(module, GroupedExperts):
        for weight in (module.w1, module.w2):
            nn.init.normal_(weight, mean=0.0, std=0.02)


class GPT(nn.Module):
    pp_first = ("tok_embeddings", "pos_embeddings")
    pp_last = ("norm", "output")
    init_module = staticmethod(_init_weights)
    """How each module is initialised: what lets it be built on the meta device and initialised
    shard by shard (training/parallel/materialize.py)."""
    _tp_plan = {
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.ffn_norm": "sequence_parallel",
        "norm": "sequence_parallel",
    }

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, ffn_mult: float,
                 dropout: float = 0.0, experts: Experts | None = None):
        super().__init__()
        if experts is not None:  # the experts are not split by TP: only attention's linears and the norms are
            self._tp_plan = {k: v for k, v in self._tp_plan.items() if ".feed_forward." not in k}
            self._ep_plan = {"layers.*.feed_forward.experts": "ep_dispatch_experts",
                             "layers.*.feed_forward.experts.w1": "grouped_gemm",
                             "layers.*.feed_forward.experts.w2": "grouped_gemm"}
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleDict({str(i): Block(d_model, n_heads, round(ffn_mult * d_model), dropout, experts)
                                     for i in range(n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.output: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (Hugging Face's name): each token's true position where the tokens are not
        0..t-1, e.g. this rank's part of a sequence under context parallelism."""
        h = tokens
        if self.tok_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device) if position_ids is None else position_ids
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(vocab_size: int = 256, seq_len: int = 64, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
          ffn_mult: float = 4, dropout: float = 0.0, n_experts: int = 0, top_k: int = 2,
          capacity_factor: float | None = None, aux_loss_coef: float = 0.01) -> GPT:
    """The factory `model=gpt-*` names (`_target_: training.models.gpt.build`). `n_experts` > 0 makes
    every block's feed-forward a mixture of that many experts of `ffn_mult` x `d_model` hidden units,
    `top_k` of them per token (`model=gpt-moe-*`). `ffn_mult` may be fractional (a two-matrix expert
    as wide as a published SwiGLU expert's three: 1.5 x its width)."""
    if d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
    experts = Experts(n_experts, top_k, capacity_factor, aux_loss_coef) if n_experts else None
    return GPT(vocab_size, seq_len, d_model, n_layers, n_heads, ffn_mult, dropout, experts)
