"""``tinylm``: a small decoder-only transformer on a deterministically generated token corpus.

What makes it a realistic checkpointing workload, at CPU-test size by default:

- variable-length sequences, right-padded per micro-batch, with padding masks in attention and loss;
- the **global token mean** objective (``global_token_mean_v1``): the sum of masked token losses over
  every micro-batch of a step divided by the count of real target tokens of the whole step. The count
  comes from :meth:`TinyLMTask.count_targets` before any forward pass, so a distributed run can
  all-reduce it first;
- gradient accumulation over micro-batches, dropout (PyTorch RNG), AdamW, warm-up schedule,
  gradient clipping, and on CUDA float16 autocast with a GradScaler (all driven by the trainer);
- input-token corruption as augmentation, drawing from every generator family the trainer owns: Python
  ``random`` (each sequence's corruption rate), the run's NumPy generator (which positions, and the
  replacement tokens) and PyTorch (dropout). So a resume that loses any one of them diverges here too,
  as it does on ``regression``.

The corpus is generated from ``corpus_seed`` with its own PCG64 (never the run's generators): each
sequence is BOS, a short random motif repeated with a little noise, EOS. It is learnable, so the loss
visibly falls. Size it up with ``--config`` (d_model, n_layers, n_sequences, ...) for GPU runs.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainproof.tasks.base import Task, TaskContext, config_from_dict, eval_mode, require, sha256_of

PAD, BOS, EOS = 0, 1, 2
IGNORE = -100  # cross_entropy's ignore_index: padded target positions contribute nothing


@dataclass(kw_only=True)
class TinyLMConfig:
    """Model, corpus and optimisation settings; defaults are sized for fast CPU tests."""

    vocab_size: int = 48
    """Tokens, including PAD=0, BOS=1, EOS=2."""
    d_model: int = 32
    """Embedding width."""
    n_heads: int = 2
    """Attention heads (must divide d_model)."""
    n_layers: int = 2
    """Transformer blocks."""
    d_ff: int = 64
    """MLP hidden width."""
    dropout: float = 0.1
    """Dropout in embeddings, attention and MLP (draws from the PyTorch generator)."""
    min_len: int = 6
    """Shortest sequence, in tokens including BOS and EOS."""
    max_len: int = 24
    """Longest sequence, in tokens including BOS and EOS."""
    n_sequences: int = 40
    """Sequences in the corpus (one epoch)."""
    batch_size: int = 8
    """Sequences per optimizer step."""
    micro_batch_size: int = 4
    """Sequences per forward/backward; the step accumulates over ceil(batch/micro) micro-batches."""
    lr: float = 1e-2
    """Peak AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay on matrices (not on biases, norms or embeddings)."""
    warmup_steps: int = 4
    """Linear warm-up, then inverse-square-root decay (independent of the run's length)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    corpus_seed: int = 1234
    """Seed of the corpus generator; independent of the run seed."""
    input_noise: float = 0.05
    """Mean rate of input tokens replaced by random ones (augmentation; targets are never corrupted)."""

    def __post_init__(self) -> None:
        require(self.vocab_size >= 8, "tinylm: vocab_size must be >= 8")
        require(self.d_model >= 1 and self.n_heads >= 1 and self.d_model % self.n_heads == 0,
                "tinylm: d_model must be a positive multiple of n_heads")
        require(self.n_layers >= 1 and self.d_ff >= 1, "tinylm: n_layers and d_ff must be >= 1")
        require(0.0 <= self.dropout < 1.0, "tinylm: dropout must be in [0, 1)")
        require(4 <= self.min_len <= self.max_len, "tinylm: need 4 <= min_len <= max_len")
        require(self.n_sequences >= 1, "tinylm: n_sequences must be >= 1")
        require(1 <= self.micro_batch_size <= self.batch_size, "tinylm: need 1 <= micro_batch_size <= batch_size")
        require(0.0 <= self.input_noise < 0.5, "tinylm: input_noise must be in [0, 0.5)")
        require(self.lr > 0 and self.weight_decay >= 0 and self.warmup_steps >= 1 and self.grad_clip >= 0,
                "tinylm: lr > 0, weight_decay >= 0, warmup_steps >= 1, grad_clip >= 0")


def make_corpus(cfg: TinyLMConfig) -> list[np.ndarray]:
    """Deterministic variable-length sequences: BOS, a noisy repeated motif, EOS."""
    gen = np.random.Generator(np.random.PCG64(cfg.corpus_seed))
    corpus = []
    for _ in range(cfg.n_sequences):
        length = int(gen.integers(cfg.min_len, cfg.max_len + 1))
        motif = gen.integers(3, cfg.vocab_size, size=int(gen.integers(2, 6)))
        body = np.resize(motif, length - 2)
        noisy = gen.random(length - 2) < 0.05
        body[noisy] = gen.integers(3, cfg.vocab_size, size=int(noisy.sum()))
        corpus.append(np.concatenate([[BOS], body, [EOS]]).astype(np.int64))
    return corpus


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention that also masks padded keys."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only language model: token + learned position embeddings, blocks, untied head."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, key_real: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V). ``key_real`` (B, T) is False at padding."""
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        # Position 0 (BOS) is always real, so no query row is fully masked (no NaN from softmax).
        attn_mask = causal[None, None] & key_real[:, None, None, :]
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.head(self.ln_f(x))


class TinyLMTask(Task):
    """The ``tinylm`` task (see module docstring)."""

    objective = "global_token_mean_v1"
    # Note: one CPU thread keeps CPU runs bitwise reproducible across machines with other core counts;
    # it makes CPU training slow, which is fine at test size (real runs use the GPU).
    cpu_threads = 1
    dtype = torch.float32
    default_steps = 50

    def __init__(self, cfg: TinyLMConfig) -> None:
        self.cfg = cfg
        self.grad_clip = cfg.grad_clip or None
        self.corpus = make_corpus(cfg)

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.micro_batch_size

    def config(self) -> dict[str, Any]:
        return asdict(self.cfg)

    def num_samples(self) -> int:
        return len(self.corpus)

    def data_identity(self) -> str:
        return sha256_of("tinylm-corpus-v1", [len(s) for s in self.corpus], *self.corpus)

    def build_model(self) -> nn.Module:
        return TinyLM(self.cfg)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(0.9, 0.95))

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        warmup = self.cfg.warmup_steps

        def factor(step: int) -> float:
            # A plain function: LambdaLR's state_dict stores None for it (weights-only safe) and the
            # factor is rebuilt from the config on resume.
            return (step + 1) / warmup if step < warmup else math.sqrt(warmup / (step + 1))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def count_targets(self, sample_ids: list[int]) -> int:
        return sum(len(self.corpus[i]) - 1 for i in sample_ids)

    def make_batch(self, sample_ids: list[int], ctx: TaskContext) -> dict[str, torch.Tensor]:
        seqs = [self.corpus[i] for i in sample_ids]
        inputs = [self._corrupt(s[:-1], ctx.np_rng) for s in seqs] if self.cfg.input_noise > 0 else None
        return _pad(seqs, ctx.device, inputs)

    def _corrupt(self, tokens: np.ndarray, np_rng: np.random.Generator) -> np.ndarray:
        """Replace a few input tokens (never BOS; targets stay clean) by random ones: Python ``random`` jitters
        this sequence's rate, the run's NumPy generator picks the positions and the replacements. Drawn per
        sequence, in sample order, so a step's draws do not depend on its split into micro-batches."""
        rate = self.cfg.input_noise * (0.5 + random.random())
        hit = np_rng.random(len(tokens)) < rate
        hit[0] = False
        replacement = np_rng.integers(3, self.cfg.vocab_size, size=len(tokens))
        return np.where(hit, replacement, tokens).astype(np.int64)

    def deterministic_objective(self) -> TinyLMTask:
        """No dropout and no input corruption (the objective check's variant): this very task (a subclass stays
        itself, its own ``loss_sum`` included) with those settings at 0."""
        clone = copy.copy(self)
        clone.cfg = replace(self.cfg, dropout=0.0, input_noise=0.0)
        return clone

    eval_metric = "heldout_token_loss"

    def evaluate(self, model: nn.Module) -> float:
        """Global token-mean cross-entropy on a held-out slice, dropout off.

        The slice is ``max(8, n_sequences // 4)`` sequences from the same generator with another seed
        (``corpus_seed + 1``): never trained on, and no new config key (which would change the contract).
        """
        heldout = make_corpus(replace(self.cfg, corpus_seed=self.cfg.corpus_seed + 1,
                                      n_sequences=max(8, self.cfg.n_sequences // 4)))
        device = next(model.parameters()).device
        total, count = 0.0, 0
        with eval_mode(model):
            for i in range(0, len(heldout), self.cfg.micro_batch_size):
                chunk = heldout[i : i + self.cfg.micro_batch_size]
                total += float(self.loss_sum(model, _pad(chunk, device)).double())
                count += sum(len(s) - 1 for s in chunk)
        return total / count

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["inputs"], batch["key_real"])
        # At least float32 even under autocast (summing thousands of token losses in float16 loses digits);
        # a float64 model keeps float64.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
            ignore_index=IGNORE, reduction="sum",
        )

    def target_losses(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each sequence's token losses, unreduced, padding left out: what ``loss_sum`` sums."""
        logits = model(batch["inputs"], batch["key_real"])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        targets = batch["targets"]
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                                 reduction="none").view(targets.shape)
        return [row[real] for row, real in zip(losses, targets != IGNORE)]


def _pad(seqs: list[np.ndarray], device: torch.device,
         inputs_of: list[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded inputs/targets of a micro-batch; padded targets are IGNORE, ``key_real`` masks them.
    ``inputs_of``: each sequence's (augmented) inputs instead of ``s[:-1]``."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), width), PAD, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for row, s in enumerate(seqs):
        n = len(s) - 1
        inputs[row, :n] = torch.from_numpy(s[:-1] if inputs_of is None else inputs_of[row])
        targets[row, :n] = torch.from_numpy(s[1:])
    batch = {"inputs": inputs, "targets": targets, "key_real": targets != IGNORE}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def make_task(config: dict[str, Any] | None = None) -> TinyLMTask:
    """Factory used by ``--task tinylm``."""
    return TinyLMTask(config_from_dict(TinyLMConfig, config))
