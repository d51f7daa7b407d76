"""A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention).

Ray-free, torch only. Module names follow torchtitan's llama3 (``tok_embeddings``,
``layers.<i>.attention.wq`` ..., ``norm``, ``output``) so its tensor-parallel plan applies as
written; see :mod:`ray_mesh.models.parallelize` for TP + sequence parallel + FSDP2.

The rotary table is a non-persistent buffer on the root and is handed to every block as an
argument: TP's ``PrepareModuleInput`` then leaves it alone (layout ``None``), and checkpoints
do not carry it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ray_mesh.errors import ModelConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.43M parameters: unit and numerics tests.
    "tiny": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 352},
    # ~1.7M: the default CPU job (a few minutes on 2 cores).
    "small": {"dim": 192, "n_layers": 4, "n_heads": 6, "n_kv_heads": 2, "ffn_hidden": 512},
    # ~28.6M: a real run on GPUs.
    "base": {"dim": 512, "n_layers": 9, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1536},
}


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the decoder. Byte-level by default (``vocab_size=256``).

    ``n_kv_heads`` < ``n_heads`` is grouped-query attention (each kv head serves
    ``n_heads / n_kv_heads`` query heads); None means ``n_heads`` (plain multi-head).
    ``ffn_hidden`` None: Llama's rule, 8/3 * dim rounded up to ``multiple_of``.
    """

    vocab_size: int = 256
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int | None = 2
    ffn_hidden: int | None = None
    multiple_of: int = 32
    max_seq_len: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.dim % self.n_heads:
            raise ModelConfigError(
                f"model: n_heads={self.n_heads} does not divide dim={self.dim}; every head "
                f"needs dim/n_heads features. Use n_heads in ({_divisors(self.dim)}) or a dim "
                f"that is a multiple of {self.n_heads}.")
        if self.head_dim % 2:
            raise ModelConfigError(
                f"model: head_dim = dim/n_heads = {self.head_dim} is odd; rotary embeddings "
                f"rotate pairs of features. Choose dim and n_heads with an even quotient.")
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"model: n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}; "
                f"each kv head serves a whole group of query heads. Use n_kv_heads in "
                f"({_divisors(self.n_heads)}).")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ModelConfigError(f"model: norm_eps and rope_theta must be > 0, got "
                                   f"{self.norm_eps} and {self.rope_theta}.")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LlamaConfig:
        """From a config mapping; ``preset: tiny|small|base`` fills the keys not given."""
        data = dict(data or {})
        preset = data.pop("preset", None)
        if preset is not None:
            if preset not in PRESETS:
                raise ModelConfigError(f"model.preset {preset!r} is unknown; use one of "
                                       f"{tuple(PRESETS)}.")
            data = {**PRESETS[preset], **data}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelConfigError(f"model: unknown key(s) {unknown}; known: {sorted(known)}.")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        raw = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(raw / self.multiple_of)

    def check_seq_len(self, seq_len: int, what: str = "seq_len") -> None:
        """Raise unless sequences of ``seq_len`` tokens fit the rotary table."""
        if seq_len > self.max_seq_len:
            raise ModelConfigError(
                f"{what}={seq_len} is longer than the model's max_seq_len={self.max_seq_len}. "
                f"Lower {what}, or raise model.max_seq_len to at least {seq_len}.")

    def check_tp(self, tp: int) -> None:
        """Raise unless tensor parallel over ``tp`` ranks splits every sharded size evenly."""
        sizes = {"n_heads": self.n_heads, "n_kv_heads": self.kv_heads,
                 "vocab_size": self.vocab_size, "ffn_hidden": self.hidden, "dim": self.dim}
        for name, size in sizes.items():
            if size % tp:
                raise ModelConfigError(
                    f"tensor parallel: tp={tp} does not divide model {name}={size} (TP gives "
                    f"each rank whole heads, an equal vocab slice and an equal share of the MLP)."
                    f" Use a tp in ({_divisors(size)}), or change {name}.")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"model.{name} must be a positive int, got {value!r}.")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of the rotary angles, stacked: (2, max_seq_len, head_dim / 2), float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (2i, 2i+1) of ``x`` (b, s, heads, head_dim) by position."""
    cos, sin = rope[0, : x.shape[1], None, :], rope[1, : x.shape[1], None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.groups = cfg.n_heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them, or 1/tp of them under TP).
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        # Grouped-query: each local kv head serves `groups` consecutive local query heads.
        k = k.repeat_interleave(self.groups, dim=2)
        v = v.repeat_interleave(self.groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden)
        self.activation_checkpointing = False
        """Recompute this block's activations in backward (set by parallelize_llama)."""

    def _forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class Llama(nn.Module):
    """tokens (batch, seq) int64 -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta),
                             persistent=False)
        self.seq_divisor = 1
        """Sequence parallel shards the sequence over tp ranks: it must divide seq_len."""
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head (call again after TP replaced both)."""
        self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torchtitan's init: small normal weights, output projections scaled by depth."""
        cfg = self.config
        emb_std = cfg.dim ** -0.5 if cfg.tie_embeddings else 1.0
        nn.init.normal_(self.tok_embeddings.weight, std=emb_std)
        for i, layer in enumerate(self.layers):
            deep = 0.02 / math.sqrt(2 * (i + 1))
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv,
                        layer.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=deep)
        if not cfg.tie_embeddings:
            std = cfg.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        self.config.check_seq_len(seq, "the input's sequence length")
        if seq % self.seq_divisor:
            raise ModelConfigError(
                f"sequence parallel splits the sequence over tp={self.seq_divisor} ranks, but "
                f"the input has {seq} tokens per row. Use a seq_len that is a multiple of "
                f"{self.seq_divisor}, or sequence_parallel=False.")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        # A view (nn.Linear on 3-D input): wrapped with FSDP2, apply_fsdp's own_output hook
        # makes it a tensor of its own (ray_mesh.parallel.fsdp).
        return self.output(self.norm(h))


def num_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Parameters of the whole model (global sizes, also under TP/FSDP), shared ones once."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and "tok_embeddings" in name):
            continue
        seen.add(id(p))
        total += p.numel()  # a DTensor's numel is its global size
    return total
