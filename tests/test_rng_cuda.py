"""The CUDA generators' capture and restore, where CUDA exists (skipped on CPU-only machines, e.g. CI here).

A restore must put every device's generator back exactly: the next CUDA draws after a restore equal the ones
observed at capture time, and a capture taken before other draws is not disturbed by the observation itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainproof.train import rng

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_generators_restore_exactly_on_every_device():
    np_gen = rng.seed_all(1234)
    torch.cuda.manual_seed_all(99)
    saved = rng.capture(np_gen, cuda=True)
    assert len(saved["torch_cuda"]) == torch.cuda.device_count()
    expected = rng.observe_next_draws(np_gen, cuda=True)
    for i in range(torch.cuda.device_count()):  # move every device's stream on
        torch.rand(1000, device=f"cuda:{i}")
    rng.restore(saved, np_gen, cuda=True)
    assert rng.observe_next_draws(np_gen, cuda=True) == expected
    first = [float(torch.rand((), dtype=torch.float64, device=f"cuda:{i}")) for i in range(torch.cuda.device_count())]
    assert first == expected["torch_cuda"]


def test_a_cuda_restore_without_the_cuda_states_is_not_a_restore():
    np_gen = rng.seed_all(1234)
    saved = rng.capture(np_gen, cuda=True)
    before = rng.observe_next_draws(np_gen, cuda=True)
    torch.rand(10, device="cuda:0")
    rng.restore({**saved, "torch_cuda": []}, np_gen, cuda=False)  # CPU streams only
    after = rng.observe_next_draws(np_gen, cuda=True)
    assert after["torch_cuda"] != before["torch_cuda"] and after["numpy"] == before["numpy"]
    assert isinstance(np_gen, np.random.Generator)
