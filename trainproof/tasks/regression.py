"""``regression``: the resume-equivalence protocol's fixture (docs/protocol.md), exactly.

24 rows of a synthetic two-input, one-target relationship; Linear(2->8), tanh, Dropout(0.25),
Linear(8->1) (33 parameters); batches of 4; Adam lr 0.03 with StepLR(step_size=3, gamma=0.5); CPU,
float64, one thread. All three generator families are really used on every step:

- Python ``random``: a light gain applied to the inputs of each batch;
- the run's NumPy ``Generator(PCG64)``: input noise here, and the per-epoch permutation in the sampler;
- PyTorch: dropout masks.

After 5 updates the cursor stands at 20 of 24 (a mid-epoch cut); 10 updates consume 40 rows, so the run
crosses into a second epoch permutation. After 10 updates the next learning rate is 0.00375.

For a long demo run, ``lr_min`` floors the decay (opt-in: the fixture itself is unchanged, see RegressionConfig).
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from trainproof.tasks.base import Task, TaskContext, config_from_dict, eval_mode, require, sha256_of


@dataclass(kw_only=True)
class RegressionConfig:
    """Settings of the fixture; the defaults ARE the protocol's fixture."""

    rows: int = 24
    """Rows in the dataset (one epoch)."""
    batch_size: int = 4
    """Rows per optimizer step."""
    hidden: int = 8
    """Hidden width: 2*8+8 + 8+1 = 33 parameters at the default."""
    dropout: float = 0.25
    """Dropout probability after the activation."""
    lr: float = 0.03
    """Adam learning rate."""
    step_size: int = 3
    """StepLR period, in optimizer steps."""
    gamma: float = 0.5
    """StepLR decay factor."""
    gain: float = 0.1
    """Python-random input gain is drawn uniformly from [1 - gain, 1 + gain] per batch."""
    noise: float = 0.01
    """Std of the NumPy Gaussian noise added to every input value."""
    data_seed: int = 20240601
    """Seed of the (fixed) dataset; independent of the run seed so the data identity never moves."""
    lr_min: float = 0.0
    """Floor of the StepLR decay (0: none, the fixture). The fixture halves the rate every 3 steps, which is right
    for the protocol's 10 steps but falls below 1e-7 by step 60 and to 1e-202 by step 2000; a longer
    demo sets e.g. ``{"lr_min": 1e-4}``. Left out of the task's settings (hence the contract) while 0, so every
    existing run and the protocol's fixture keep their contract."""

    def __post_init__(self) -> None:
        require(self.rows >= 1 and self.batch_size >= 1, "regression: rows and batch_size must be >= 1")
        require(self.hidden >= 1, "regression: hidden must be >= 1")
        require(0.0 <= self.dropout < 1.0, "regression: dropout must be in [0, 1)")
        require(self.lr > 0 and self.step_size >= 1 and self.gamma > 0, "regression: lr, step_size, gamma must be > 0")
        require(self.gain >= 0 and self.noise >= 0, "regression: gain and noise must be >= 0")
        require(0.0 <= self.lr_min <= self.lr, "regression: need 0 <= lr_min <= lr")


def make_dataset(rows: int, data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed synthetic relationship y = f(x1, x2), float64.

    Generated with its own PCG64 seeded by ``data_seed``, never from the run's generators.
    """
    gen = np.random.Generator(np.random.PCG64(data_seed))
    x = gen.uniform(-1.0, 1.0, size=(rows, 2))
    y = 0.8 * x[:, 0] - 0.5 * x[:, 1] + 0.3 * x[:, 0] * x[:, 1] + 0.2 * np.sin(3.0 * x[:, 0])
    y = y + gen.normal(0.0, 0.05, size=rows)
    return torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y.astype(np.float64)).unsqueeze(1)


class RegressionTask(Task):
    """The protocol fixture (see module docstring)."""

    objective = "mse_mean_v1"
    supports_cuda = False  # the fixture is defined on the CPU, where the comparison can be exact
    cpu_threads = 1
    dtype = torch.float64
    default_steps = 10

    def __init__(self, cfg: RegressionConfig) -> None:
        self.cfg = cfg
        self.x, self.y = make_dataset(cfg.rows, cfg.data_seed)

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    def config(self) -> dict[str, Any]:
        settings = asdict(self.cfg)
        if settings["lr_min"] == 0.0:  # the default is not a setting: the fixture's contract stays what it was
            del settings["lr_min"]
        return settings

    def num_samples(self) -> int:
        return self.cfg.rows

    def data_identity(self) -> str:
        return sha256_of("regression-data-v1", self.x, self.y)

    def build_model(self) -> nn.Module:
        h = self.cfg.hidden
        return nn.Sequential(nn.Linear(2, h), nn.Tanh(), nn.Dropout(self.cfg.dropout), nn.Linear(h, 1))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.cfg.lr)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        c = self.cfg
        if c.lr_min == 0.0:  # the fixture, exactly
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=c.step_size, gamma=c.gamma)
        floor = c.lr_min / c.lr

        def factor(step: int) -> float:
            # A plain function: LambdaLR's state_dict stores None for it (weights-only safe); rebuilt from the config.
            return max(c.gamma ** (step // c.step_size), floor)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def make_batch(self, sample_ids: list[int], ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(sample_ids, dtype=torch.long)
        x, y = self.x[idx], self.y[idx]
        gain = 1.0 + self.cfg.gain * (2.0 * random.random() - 1.0)
        noise = torch.from_numpy(ctx.np_rng.normal(0.0, self.cfg.noise, size=tuple(x.shape)))
        return (x * gain + noise).to(ctx.device), y.to(ctx.device)

    def loss_sum(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).sum()

    def target_losses(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each row's squared error (a row is one target), unreduced: what ``loss_sum`` sums."""
        x, y = batch
        return ((model(x) - y) ** 2).reshape(len(x), -1).sum(dim=1)

    def deterministic_objective(self) -> RegressionTask:
        """No dropout, gain or noise (the objective check's variant): this very task (a subclass stays itself, its own
        ``loss_sum`` included) with those settings at 0."""
        clone = copy.copy(self)
        clone.cfg = replace(self.cfg, dropout=0.0, gain=0.0, noise=0.0)
        return clone

    eval_metric = "mse"

    def evaluate(self, model: nn.Module) -> float:
        """MSE over the 24 clean rows (no gain, no noise), dropout off."""
        weight = next(model.parameters())
        x, y = (t.to(device=weight.device, dtype=weight.dtype) for t in (self.x, self.y))
        with eval_mode(model):
            return float(((model(x) - y) ** 2).mean())


def make_task(config: dict[str, Any] | None = None) -> RegressionTask:
    """Factory used by ``--task regression`` (and an example of a user factory's signature)."""
    return RegressionTask(config_from_dict(RegressionConfig, config))
