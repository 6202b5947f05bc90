"""A task whose model is mostly frozen, as a LoRA fine-tune's is: the regression fixture with a wide first layer and
a wide hidden layer that require no gradient (the "base", ~0.5 MB in float64) and a trainable head (257 parameters).
``TP_FROZEN_WRITE_AT=N``: at step N the task writes into a frozen weight through ``.data`` (what "frozen" must not
assume away: the trainer stores the changed base again)."""

from __future__ import annotations

import os

import torch
from torch import nn

from trainproof.tasks.regression import RegressionConfig, RegressionTask

WIDTH = 256


class Frozen(RegressionTask):
    def __init__(self) -> None:
        super().__init__(RegressionConfig(dropout=0.0))
        self.write_at = int(os.environ.get("TP_FROZEN_WRITE_AT", "0"))
        if self.write_at:  # a counter on the task (hidden state): only in the run that writes, never verified
            self.calls = 0

    def build_model(self) -> nn.Module:
        model = nn.Sequential(nn.Linear(2, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        for layer in (model[0], model[2]):
            layer.requires_grad_(False)
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=self.cfg.lr)

    def loss_sum(self, model: nn.Module, batch):
        if self.write_at:
            self.calls += 1
            if self.calls == self.write_at:
                model[0].bias.data.add_(0.5)
        return super().loss_sum(model, batch)


def factory(config):
    return Frozen()
