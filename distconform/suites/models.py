"""Models the conformance cases train, in our own code.

Shapes, initialisation order and forward math follow the models of torch's own tests
(``MLP`` and ``MLPStack`` of its FSDP test helpers, ``Transformer`` of its DTensor test helpers)
so that parameter counts
and numerics match what the upstream cases exercise; nothing here knows about sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class MLP(nn.Module):
    """``relu(out_proj(relu(in_proj(x))))`` with hidden size ``dim * dim_multiplier``."""

    def __init__(
        self,
        dim: int,
        device: torch.device | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, device=device, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device), persistent=False)
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        if self.buffer is not None:
            z = z + self.buffer
        return z


class MLPStack(nn.Sequential):
    """Three MLPs (multipliers 3, 4, 3), optionally followed by a bias-free LayerNorm."""

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False) -> None:
        modules: list[nn.Module] = [
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        ]
        if with_seq_parallel:
            modules.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*modules)
        self.with_seq_parallel = with_seq_parallel


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True
    weight_tying: bool = True
    checkpoint_activations: bool = False
    num_experts: int = 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise ValueError(f"dim {args.dim} is not divisible by n_heads {args.n_heads}")
        self.head_dim = args.dim // args.n_heads
        self.dropout_p = args.dropout_p
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.size()

        def heads(t: torch.Tensor) -> torch.Tensor:
            # (batch, seq, dim) -> (batch, heads, seq, head_dim); -1 lets TP shard the heads.
            return t.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            None,
            self.dropout_p if self.training else 0.0,
            is_causal=self.use_attn_mask,
        )
        out = out.transpose(1, 2).contiguous().view(batch, seq_len, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.num_experts:
            raise NotImplementedError("expert layers (num_experts > 0) are not modelled yet")
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_activations = args.checkpoint_activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _batch, seq_len = tokens.size()
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(0, seq_len, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            if self.checkpoint_activations:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h)).float()


class TiedModel(nn.Module):
    """An embedding and an output projection sharing one weight (weight tying)."""

    def __init__(self, vocab_size: int = 17, dim: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.tok_embeddings(ids))


class ChunkedHeadModel(nn.Module):
    """Embedding, body, RMSNorm and a vocabulary head; ``skip_head`` returns the hidden state.

    Lets a caller run the head by itself per chunk of the hidden state (the partial-group
    forward the upstream partial-group tests run); ``tie`` shares the head's weight with the
    embedding.
    """

    def __init__(self, dim: int = 32, vocab_size: int = 128, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


class WidthBlock(nn.Module):
    """``relu(linear(x))``: a block with one computation child, so hooks can tell the
    block's entry from the start of its computation."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class WidthStack(nn.Module):
    """Blocks of growing widths (4 -> 5 -> 6 ...) and a head: every block has its own
    parameter count, padded or not, so a collective's size names the block it belongs to
    (for checks of prefetch order)."""

    def __init__(self, n_blocks: int = 6, first_width: int = 4, out_dim: int = 3) -> None:
        super().__init__()
        widths = range(first_width, first_width + n_blocks + 1)
        self.in_dim = first_width
        self.layers = nn.ModuleList(WidthBlock(w, w + 1) for w in widths[:-1])
        self.head = nn.Linear(widths[-1], out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
