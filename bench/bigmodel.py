"""A benchmark task with a large state and cheap steps: ``layers`` x ``Linear(width, width)`` trained with Adam.

The checkpoint is dominated by parameters and Adam's two moments (3 x 4 bytes a parameter), so its size is
set by ``state_mib`` (``layers`` is derived from it unless given). Used by ``bench/bench_async_stall.py``::

    python -m trainproof train --store ./runs/big --task bench.bigmodel:factory --config '{"state_mib": 256}' ...
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from trainproof.tasks import DatasetTask, config_from_dict, require, sha256_of


@dataclass(kw_only=True)
class BigModelConfig:
    """Size and data of the benchmark model."""

    state_mib: float = 64.0
    """Approximate checkpoint size (parameters + Adam moments, float32)."""
    width: int = 1024
    """Features of every layer."""
    layers: int = 0
    """Linear layers (0: derived from ``state_mib``)."""
    samples: int = 256
    """Training samples (random inputs and targets from a fixed seed)."""
    batch_size: int = 8
    """Samples per optimizer step."""
    frozen_mib: float = 0.0
    """A frozen base in front of the trained layers, as a LoRA run's (float32 weights that require no gradient)."""


class _Random(Dataset):
    def __init__(self, n: int, width: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def factory(config: dict) -> DatasetTask:
    """The benchmark task (``--task bench.bigmodel:factory``)."""
    cfg = config_from_dict(BigModelConfig, config)
    per_layer = 3 * 4 * (cfg.width * cfg.width + cfg.width)  # weights + bias, and two Adam moments
    if not cfg.layers:
        cfg.layers = max(1, round(cfg.state_mib * 2**20 / per_layer))
    require(cfg.layers >= 1 and cfg.width >= 1, "bigmodel: layers and width must be >= 1")

    base = round(cfg.frozen_mib * 2**20 / (4 * (cfg.width * cfg.width + cfg.width)))

    def build() -> nn.Module:
        frozen = [nn.Linear(cfg.width, cfg.width).requires_grad_(False) for _ in range(base)]
        return nn.Sequential(*frozen, *[nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])

    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean(dim=1)

    return DatasetTask(dataset=_Random(cfg.samples, cfg.width), build_model=build, per_sample_loss=loss,
                       config=asdict(cfg), batch_size=cfg.batch_size, optimizer="adam", lr=1e-4,
                       data_identity=sha256_of("bench.bigmodel", asdict(cfg)), default_steps=20,
                       eval_dataset=_Random(cfg.batch_size, cfg.width, seed=1), eval_metric="mse")
