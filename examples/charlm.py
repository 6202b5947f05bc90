"""A character-level transformer trained on Python's own standard library sources.

Real text that every machine with Python has, offline: a fixed, sorted list of ``.py`` files from
``os.path.dirname(os.__file__)`` (they exist in every CPython 3.10+). Each file's sha256 enters the data
identity, so another Python's standard library is another run contract (a resume on it is refused).

Built with :class:`trainproof.tasks.DatasetTask`: a map-style Dataset of fixed-length windows, a model factory and a
per-token loss. Run it from the repository root::

    python -m trainproof train --store ./runs/charlm --task examples.charlm:factory --max-steps 200
    python -m trainproof train ... --config my.json     # any CharLMConfig field, e.g. {"d_model": 128}

(``trainproof train ...`` works the same once the repository root is on ``PYTHONPATH``.)
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainproof.tasks import DatasetTask, config_from_dict, require, sha256_of

TRAIN_FILES = ["bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "queue.py", "sched.py", "shlex.py",
               "textwrap.py"]
"""Default training text (about 87 kB): small, stable modules present in every CPython 3.10+."""
EVAL_FILES = ["graphlib.py"]
"""Default held-out text for the export's evaluation (never trained on)."""


@dataclass(kw_only=True)
class TransformerConfig:
    """The model's and the optimiser's settings (examples.tokenlm trains the same model on a bucket dataset)."""

    context: int = 64
    """Tokens per training window (each window predicts ``context`` next tokens)."""
    d_model: int = 64
    """Embedding width."""
    n_heads: int = 4
    """Attention heads (must divide d_model)."""
    n_layers: int = 2
    """Transformer blocks."""
    d_ff: int = 256
    """MLP hidden width."""
    dropout: float = 0.1
    """Dropout probability (draws from PyTorch's global generator, which the trainer checkpoints)."""
    batch_size: int = 16
    """Windows per optimizer step."""
    micro_batch_size: int = 16
    """Windows per forward/backward (the step accumulates gradients over its micro-batches)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warm-up, then inverse-square-root decay (independent of the run's length)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        require(self.context >= 2, f"{name}: context must be >= 2")
        require(self.d_model >= 1 and self.n_heads >= 1 and self.d_model % self.n_heads == 0,
                f"{name}: d_model must be a positive multiple of n_heads")
        require(self.n_layers >= 1 and self.d_ff >= 1, f"{name}: n_layers and d_ff must be >= 1")
        require(0.0 <= self.dropout < 1.0, f"{name}: dropout must be in [0, 1)")
        require(1 <= self.micro_batch_size <= self.batch_size, f"{name}: need 1 <= micro_batch_size <= batch_size")
        require(self.lr > 0 and self.weight_decay >= 0 and self.warmup_steps >= 1 and self.grad_clip >= 0,
                f"{name}: need lr > 0, weight_decay >= 0, warmup_steps >= 1, grad_clip >= 0")


@dataclass(kw_only=True)
class CharLMConfig(TransformerConfig):
    """Data, model and optimisation settings; the defaults train in about a minute on one CPU thread."""

    files: list[str] = field(default_factory=lambda: list(TRAIN_FILES))
    """Training files, relative to the standard library folder; read in this order."""
    eval_files: list[str] = field(default_factory=lambda: list(EVAL_FILES))
    """Held-out files for :meth:`DatasetTask.evaluate` (the export's metric)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.files) >= 1 and len(self.eval_files) >= 1, "charlm: need at least one file and eval file")


def read_sources(names: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The concatenated text of standard-library files and each file's (name, sha256)."""
    root = os.path.dirname(os.__file__)
    texts, digests = [], []
    for name in names:
        path = os.path.join(root, name)
        require(os.path.isfile(path), f"charlm: {path} does not exist (choose files of this Python's stdlib)")
        with open(path, "rb") as f:
            raw = f.read()
        texts.append(raw.decode("utf-8"))
        digests.append((name, hashlib.sha256(raw).hexdigest()))
    return "".join(texts), digests


class CharWindows(Dataset):
    """Non-overlapping windows of a token sequence: sample ``i`` is (inputs, next characters), both ``(context,)``."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context
        self.count = (len(tokens) - 1) // context  # every window needs one more token as its last target
        require(self.count >= 1, f"charlm: the text has {len(tokens)} characters, fewer than context + 1")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.context
        chunk = self.tokens[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-norm causal blocks, linear head."""

    def __init__(self, vocab_size: int, cfg: TransformerConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        # Each block constructed on its own (nn.TransformerEncoder would deep-copy one: identical initial weights).
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for tokens ``(B, T)``."""
        t = tokens.shape[1]
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        # A float mask in the activations' dtype (-inf above the diagonal): valid for float32 and float64 runs.
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(self.ln_f(x))


def per_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of every predicted character, unreduced: ``(B, context)``."""
    inputs, targets = batch
    logits = model(inputs)
    # At least float32 even under CUDA autocast (float16 logits lose digits in the softmax).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="none").view(targets.shape)


def warmup_then_inverse_sqrt(warmup: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up over ``warmup`` steps, then ``sqrt(warmup / step)``."""

    def factor(step: int) -> float:
        return (step + 1) / warmup if step < warmup else math.sqrt(warmup / (step + 1))

    return factor


def factory(config: dict[str, Any]) -> DatasetTask:
    """``--task examples.charlm:factory``: the task for ``config`` (any :class:`CharLMConfig` fields)."""
    cfg = config_from_dict(CharLMConfig, config)
    text, digests = read_sources(cfg.files)
    eval_text, eval_digests = read_sources(cfg.eval_files)
    # The vocabulary is every character of the training and held-out text, sorted: a pure function of the
    # files, so their digests (in the data identity) fix it.
    vocab = sorted(set(text) | set(eval_text))
    index = {ch: i for i, ch in enumerate(vocab)}

    def encode(s: str) -> torch.Tensor:
        return torch.tensor([index[ch] for ch in s], dtype=torch.long)

    return DatasetTask(
        dataset=CharWindows(encode(text), cfg.context),
        eval_dataset=CharWindows(encode(eval_text), cfg.context),
        build_model=lambda: CharTransformer(len(vocab), cfg),
        per_sample_loss=per_token_loss,
        targets_per_sample=cfg.context,
        config=asdict(cfg),
        data_identity=sha256_of("charlm-stdlib-v1", digests, eval_digests, cfg.context),
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        optimizer="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, optimizer_options={"betas": [0.9, 0.95]},
        lr_schedule=warmup_then_inverse_sqrt(cfg.warmup_steps), grad_clip=cfg.grad_clip or None,
        objective="char_token_mean_v1", eval_metric="heldout_char_loss", default_steps=200,
        cpu_threads=1,  # one thread: CPU reductions in a fixed order, so CPU runs are bitwise reproducible
    )
