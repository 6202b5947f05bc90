"""Tasks: the regression fixture's protocol facts, tinylm's global-token-mean objective and padding
masks, and loading a user's own task with ``package.module:factory``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainproof.errors import ConfigError
from trainproof.train.run import build_run, train_step
from trainproof.tasks import Task, TaskContext, load_task
from trainproof.tasks.tinylm import IGNORE
from trainproof.train.device import configure_determinism
from tests.support.timing import budget

CPU = torch.device("cpu")


def _run(name: str, config: dict | None = None, seed: int = 7):
    task = load_task(name, config)
    configure_determinism(task, CPU)
    return build_run(task, CPU, seed)


def test_regression_is_the_protocol_fixture():
    run = _run("regression")
    assert sum(p.numel() for p in run.model.parameters()) == 33
    assert [type(m).__name__ for m in run.model] == ["Linear", "Tanh", "Dropout", "Linear"]
    assert run.model[2].p == 0.25 and run.task.num_samples() == 24 and run.task.batch_size == 4
    assert all(p.dtype == torch.float64 for p in run.model.parameters())
    assert torch.get_num_threads() == 1
    for _ in range(5):
        train_step(run)
    assert (run.sampler.epoch, run.sampler.cursor) == (0, 20)
    for _ in range(5):
        train_step(run)
    assert (run.sampler.epoch, run.sampler.cursor) == (1, 16)
    assert run.lr() == 0.00375


@pytest.mark.parametrize("generator", ["python", "numpy", "torch"])
def test_regression_really_draws_from_all_three_generators(generator):
    """Changing any one generator's state changes the first step's loss (so each must be restored)."""
    base = _run("regression")
    baseline = train_step(base)["loss"]
    other = _run("regression")
    if generator == "python":
        random.seed(999)
    elif generator == "numpy":
        other.np_gen.bit_generator.state = np.random.Generator(np.random.PCG64(999)).bit_generator.state
        other.sampler.permutation = base.sampler.permutation.copy()  # keep the rows, change only the noise
        other.sampler.cursor = 0
    else:
        torch.manual_seed(999)
    assert train_step(other)["loss"] != baseline


def _tinylm_grads(micro: int, ids: list[int]):
    task = load_task("tinylm", {"dropout": 0.0, "input_noise": 0.0, "batch_size": 8, "micro_batch_size": micro})
    torch.manual_seed(0)
    model = task.build_model()
    ctx = TaskContext(np_rng=np.random.Generator(np.random.PCG64(0)), device=CPU)
    chunks = [ids[i : i + micro] for i in range(0, len(ids), micro)]
    count = sum(task.count_targets(c) for c in chunks)
    total = 0.0
    for chunk in chunks:
        loss_sum = task.loss_sum(model, task.make_batch(chunk, ctx))
        (loss_sum / count).backward()
        total += float(loss_sum.detach())
    return total / count, [p.grad.clone() for p in model.parameters()]


def test_tinylm_global_token_mean_is_independent_of_the_micro_batch_split():
    ids = [3, 17, 5, 29, 11, 0, 38, 21]  # sequences of different lengths
    loss_whole, grads_whole = _tinylm_grads(8, ids)
    loss_split, grads_split = _tinylm_grads(3, ids)  # micro-batches of 3, 3, 2 with different token counts
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    for a, b in zip(grads_whole, grads_split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_tinylm_counts_real_tokens_and_masks_padding():
    task = load_task("tinylm", {"dropout": 0.0, "input_noise": 0.0})
    ctx = TaskContext(np_rng=np.random.Generator(np.random.PCG64(0)), device=CPU)
    lengths = [len(s) for s in task.corpus]
    short, long = int(np.argmin(lengths)), int(np.argmax(lengths))
    assert lengths[short] < lengths[long]
    batch = task.make_batch([short, long], ctx)
    assert int((batch["targets"] != IGNORE).sum()) == task.count_targets([short, long])
    torch.manual_seed(0)
    model = task.build_model().eval()
    alone = task.loss_sum(model, task.make_batch([short], ctx))
    padded = task.loss_sum(model, batch) - task.loss_sum(model, task.make_batch([long], ctx))
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)  # padding changes nothing


def test_tinylm_corpus_is_deterministic_and_identified():
    a, b = load_task("tinylm"), load_task("tinylm")
    assert a.data_identity() == b.data_identity()
    assert load_task("tinylm", {"corpus_seed": 5}).data_identity() != a.data_identity()
    assert len({len(s) for s in a.corpus}) > 5  # variable lengths


def test_tinylm_loss_falls():
    run = _run("tinylm")
    losses = [train_step(run)["loss"] for _ in range(60)]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])


@pytest.mark.parametrize(("task", "config", "message"), [
    ("regression", {"bogus": 1}, "unknown RegressionConfig key"),
    ("regression", {"dropout": 1.5}, "dropout"),
    ("tinylm", {"d_model": 30, "n_heads": 4}, "multiple of n_heads"),
    ("tinylm", {"micro_batch_size": 9}, "micro_batch_size"),
    ("nope", {}, "unknown task"),
    ("no_such_module_xyz:make", {}, "cannot import"),
    ("json:nothing_here", {}, "no callable"),
    ("json:dumps", {}, "not a trainproof.tasks.Task"),
])
def test_bad_task_specs_are_config_errors(task, config, message):
    with pytest.raises(ConfigError, match=message):
        load_task(task, config)


def test_a_user_task_loads_from_package_module_factory(tmp_path, monkeypatch):
    pkg = tmp_path / "mytasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "line.py").write_text(textwrap.dedent('''
        import torch
        from trainproof.tasks import Task

        class Line(Task):
            objective = "mse_sum_v1"
            def __init__(self, config): self.scale = config.get("scale", 2.0)
            batch_size = 2
            def config(self): return {"scale": self.scale}
            def num_samples(self): return 6
            def data_identity(self): return "0" * 64
            def build_model(self): return torch.nn.Linear(1, 1)
            def build_optimizer(self, model): return torch.optim.SGD(model.parameters(), lr=0.1)
            def make_batch(self, ids, ctx):
                x = torch.tensor(ids, dtype=torch.float32).unsqueeze(1)
                return x, self.scale * x
            def loss_sum(self, model, batch):
                x, y = batch
                return ((model(x) - y) ** 2).sum()

        def make(config):
            return Line(config)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("mytasks.line:make", {"scale": 3.0})
    assert isinstance(task, Task) and task.config() == {"scale": 3.0}
    run = build_run(task, CPU, 1)
    losses = [train_step(run)["loss"] for _ in range(6)]
    assert run.step == 6 and run.scheduler is None and losses[-1] < losses[0]


def test_a_task_module_not_found_says_where_modules_are_imported_from(tmp_path):
    """A typo'd or misplaced task module names the folder it was looked for in; a module that imports a missing
    package names that package instead (not "the task was not found")."""
    (tmp_path / "usertask.py").write_text("import not_installed_package_xyz\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    lines = {}
    for spec in ("usertaks:make", "usertask:make"):
        result = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(tmp_path / "run"),
                                 "--task", spec], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=budget(300))
        assert result.returncode == 2, result.stderr
        lines[spec] = result.stderr.strip().splitlines()[-1]
    assert f"working directory ({tmp_path})" in lines["usertaks:make"] and "usertaks.py" in lines["usertaks:make"]
    assert "'not_installed_package_xyz', which is not installed" in lines["usertask:make"], lines
    assert not (tmp_path / "run").exists()
