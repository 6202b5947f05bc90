"""CUDA paths, where a CUDA device exists (every test here is marked ``cuda`` and skipped on CPU-only machines, as
in CI here): ``scripts/gpu-check.sh`` runs them on a GPU machine.

- the asynchronous snapshot copies device tensors into *pinned* host buffers and equals them bit for bit;
- float16 autocast with its GradScaler and bfloat16 autocast without one train on the GPU, and a run stopped and
  resumed through the real entry point on CUDA ends equal to an uninterrupted one (regression: deterministic
  kernels only, so bitwise);
- NCCL with two ranks: on two GPUs (NCCL refuses two ranks on one GPU), the DDP world-size check of ``verify``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_train_helpers import differences, load_state, run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def test_the_async_snapshot_of_cuda_tensors_is_pinned_and_exact():
    from trainproof.train.async_save import _Snapshotter

    state = {"model": {"w": torch.randn(1024, 1024, device=CUDA), "b": torch.arange(7, device=CUDA)}, "step": 3}
    copied, done = _Snapshotter().copy(state)
    assert done is not None
    done.synchronize()
    for key, live in state["model"].items():
        host = copied["model"][key]
        assert host.device.type == "cpu" and host.is_pinned(), key
        assert torch.equal(host, live.cpu()), key
    assert copied["step"] == 3


@pytest.mark.parametrize(("precision", "dtype", "scaled"), [("fp16", torch.float16, True),
                                                            ("bf16", torch.bfloat16, False)])
def test_autocast_paths_train_on_the_gpu(precision, dtype, scaled):
    from trainproof.tasks import load_task
    from trainproof.train.device import configure_determinism
    from trainproof.train.run import build_run, train_step

    task = load_task("tinylm")
    task.precision = precision
    configure_determinism(task, CUDA)
    trained = build_run(task, CUDA, 3)
    assert trained.autocast == dtype and trained.scaler.is_enabled() == scaled
    losses = [train_step(trained)["loss"] for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_a_cuda_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path):
    args = ("--task", "regression", "--device", "cuda", "--max-steps")
    assert run(tmp_path / "ref", *args, "8").code == 0
    assert run(tmp_path / "cut", *args, "4").code == 0
    resumed = run(tmp_path / "cut", *args, "8")
    assert resumed.code == 0 and resumed.last("resume")["step"] == 4, resumed.stderr[-2000:]
    expected, got = load_state(tmp_path / "ref"), load_state(tmp_path / "cut")
    strip = lambda s: {**s, "meta": {k: v for k, v in s["meta"].items() if k != "trainer"}}  # noqa: E731
    assert got["meta"]["device"].startswith("cuda") and differences(strip(expected), strip(got)) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank (it refuses two ranks on one)")
def test_two_nccl_ranks_train_and_resume(tmp_path):
    args = ("--task", "regression", "--device", "cuda", "--nproc-per-node", "2", "--max-steps")
    assert run(tmp_path / "ref", *args, "8").code == 0
    assert run(tmp_path / "cut", *args, "4").code == 0
    resumed = run(tmp_path / "cut", *args, "8")
    assert resumed.code == 0, resumed.stderr[-2000:]
    assert load_state(tmp_path / "cut")["progress"]["step"] == 8
