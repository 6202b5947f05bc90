"""A small language model trained from token shards in a bucket, with DataLoader workers.

The data is generated offline and packed once (``trainproof data pack``, or ``pack`` below): byte-level tokens
(a vocabulary of 256) of Python's own standard library sources, which every machine with Python has, stored as
``uint16`` token ids the way a real tokenizer's would be, cut into windows of ``context + 1`` tokens. Training then
reads the windows it needs from the bucket through the store layer (every part verified against ``dataset.json``,
cached locally) in two DataLoader worker processes per rank, which also apply the augmentation: a few input tokens
replaced at random, drawn from each window's own generator (run seed, epoch, window), so the run is the same with
any number of workers and after any resume. From the repository root::

    python -m examples.tokenlm pack s3://bucket/datasets/stdlib-bytes           # once (or any URL or folder)
    python -m trainproof train --store s3://bucket/runs/lm --task examples.tokenlm:factory \\
        --config lm.json --max-steps 300                                        # lm.json: {"dataset": "s3://..."}
    python -m trainproof train ... --data-workers 4                                    # same run, more workers

The dataset's identity (the digest of its manifest's shard digests) is the run's data identity, and its URL is part
of the task's settings: another dataset, or the same one moved, is another experiment. The last ``eval_windows``
windows are held out (never trained on) for ``evaluate``, the export's metric.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from examples.charlm import CharTransformer, TransformerConfig, per_token_loss, warmup_then_inverse_sqrt
from trainproof.data import ShardedDataset, pack_records, token_windows
from trainproof.errors import TrainError
from trainproof.tasks import DatasetTask, config_from_dict, require

VOCAB = 256
"""Byte-level tokens."""


@dataclass(kw_only=True)
class TokenLMConfig(TransformerConfig):
    """The dataset, the augmentation, and examples.charlm's model and optimiser settings."""

    dataset: str = ""
    """URL of the packed dataset (``pack`` below): s3://bucket/prefix, a folder, memory://name. ``context`` must
    match its windows (``context + 1`` tokens each)."""
    eval_windows: int = 64
    """The dataset's last windows, held out for ``evaluate``."""
    input_noise: float = 0.02
    """Probability of replacing an input token with a random one (augmentation, per window's own generator)."""
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.dataset), "tokenlm: set 'dataset' to the packed dataset's URL (python -m examples.tokenlm "
                                    "pack URL)")
        require(self.eval_windows >= 1 and 0.0 <= self.input_noise < 1.0,
                "tokenlm: need eval_windows >= 1 and input_noise in [0, 1)")


def windows(batch: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate windows of ``context + 1`` token ids into (inputs, next tokens), int64 ``(B, context)`` each."""
    tokens = torch.from_numpy(np.stack(batch).astype(np.int64))
    return tokens[:, :-1], tokens[:, 1:]


class InputNoise:
    """Replace each input token (not the last, which is only a target) with a random one with probability ``p``,
    drawn from the window's own generator."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        hit = rng.random(len(window) - 1) < self.p
        out = window.copy()
        out[:-1][hit] = rng.integers(0, VOCAB, int(hit.sum()), dtype=window.dtype)
        return out


def factory(config: dict[str, Any]) -> DatasetTask:
    """``--task examples.tokenlm:factory``: the task for ``config`` (any :class:`TokenLMConfig` fields)."""
    cfg = config_from_dict(TokenLMConfig, config)
    data = ShardedDataset(cfg.dataset)
    require(data.manifest.kind == "records" and data.manifest.shape == (cfg.context + 1,),
            f"tokenlm: {cfg.dataset} holds {data.manifest.kind} of shape {list(data.manifest.shape)}, not windows of "
            f"context + 1 = {cfg.context + 1} tokens")
    held_out = len(data) - cfg.eval_windows
    require(held_out >= cfg.batch_size, f"tokenlm: {len(data)} windows leave fewer than a batch after the held-out "
                                        f"{cfg.eval_windows}")
    return DatasetTask(
        dataset=data.take(0, held_out), eval_dataset=data.take(held_out, len(data)), collate=windows,
        build_model=lambda: CharTransformer(VOCAB, cfg), per_sample_loss=per_token_loss,
        targets_per_sample=cfg.context, config=asdict(cfg),
        augment=InputNoise(cfg.input_noise) if cfg.input_noise else None,
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        optimizer="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, optimizer_options={"betas": [0.9, 0.95]},
        lr_schedule=warmup_then_inverse_sqrt(cfg.warmup_steps), grad_clip=cfg.grad_clip or None,
        objective="byte_token_mean_v1", eval_metric="heldout_token_loss", default_steps=300,
        num_workers=2, prefetch=2,  # defaults; `train --data-workers N` overrides (not part of the contract)
    )


def stdlib_tokens(limit_bytes: int) -> np.ndarray:
    """``limit_bytes`` of byte-level tokens (``uint16`` ids) of the standard library's ``.py`` files, in sorted path
    order, the text repeated when it is shorter (about 30 MB: 60 MiB of tokens)."""
    root = os.path.dirname(os.__file__)
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) if "site-packages" not in d
                   for f in fs if f.endswith(".py"))
    chunks, total = [], 0
    for path in paths:
        with open(path, "rb") as fh:
            chunks.append(np.frombuffer(fh.read(), dtype=np.uint8))
        total += len(chunks[-1])
        if 2 * total >= limit_bytes:
            break
    return np.resize(np.concatenate(chunks).astype(np.uint16), limit_bytes // 2)


def pack(url: str, *, context: int = 64, mib: float = 8.0, shard_mib: float = 64.0, part_kib: int = 1024) -> str:
    """Pack ``mib`` MiB of the standard library's tokens into a dataset at ``url``; its identity."""
    tokens = stdlib_tokens(int(mib * 2**20))
    packed = pack_records(url, token_windows(tokens, context), shard_bytes=int(shard_mib * 2**20),
                          part_bytes=part_kib * 1024, source={"tokens": "python-stdlib-bytes", "context": context})
    return packed.identity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.tokenlm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack the standard library's byte tokens into a dataset at URL")
    p.add_argument("url")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--mib", type=float, default=8.0, help="dataset size in MiB (the text repeated past ~60 MiB)")
    p.add_argument("--shard-mib", type=float, default=64.0)
    p.add_argument("--part-kib", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        identity = pack(args.url, context=args.context, mib=args.mib, shard_mib=args.shard_mib, part_kib=args.part_kib)
    except TrainError as exc:
        print(f"tokenlm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({"dataset": args.url, "identity": identity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
