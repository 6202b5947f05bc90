"""Bring your own model: the ``DatasetTask`` adapter and ``examples/charlm.py`` through the real entry point.

- the adapter returns the sum of per-target losses with an exact count, refuses a reduced or misshapen loss
  (in process, and as exit 2 from ``python -m trainproof train``), and keeps its randomness on the trainer's generators;
- the example, SIGTERMed mid-run (a real signal to a real process), exits 75, resumes, and ends bitwise equal to
  an uninterrupted run (states read back through the store);
- the README section's commands run as written (``trainproof`` console script, ``export PYTHONPATH``), and
  their ``verify`` passes with a report that says so;
- ``verify`` catches a task that draws from a private generator (the pitfall docs/tasks.md warns about);
- docs/tasks.md's two task modules (adapter, from scratch) train through the entry point and round-trip config().

Everything else in ``job`` is driven through processes: only ``trainproof.tasks`` and ``storage`` are imported.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from trainproof.tasks import BatchRequest, ConfigError, DatasetTask, TaskContext, dataset_digest, load_task
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_train_helpers import differences

ROOT = Path(__file__).resolve().parent.parent
CHARLM = "examples.charlm:factory"
CPU = torch.device("cpu")
# Two stdlib files (about 7 kB): 111 windows of 64, 7 steps an epoch of 16 (the last a tail of 15), two
# micro-batches a step. 30 steps cross four epoch boundaries.
SIGTERM_CONFIG = {"files": ["bisect.py", "colorsys.py"], "micro_batch_size": 8}
SIGTERM_TARGET = 30


# -- helpers ------------------------------------------------------------------------------------------------
def env_without_trainproof(extra: dict[str, str] | None = None, *, pythonpath: bool = True) -> dict[str, str]:
    """Our environment minus TRAINPROOF_* options; the checkout importable unless ``pythonpath`` is False."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_") and k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    return {**env, **(extra or {})}


def job(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m trainproof ARGS`` from the repository root, to completion."""
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, env=env or env_without_trainproof(),
                          text=True, capture_output=True, timeout=timeout)


def events(stdout: str) -> list[dict[str, Any]]:
    """The JSON event lines a ``train`` process printed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def final_state(store: Path | str) -> dict[str, Any]:
    """The newest usable generation's training state: read and verified by the store, decoded weights-only, with its
    full history reassembled from the run's generations (each holds only the rows since the previous one)."""
    from trainproof.format.history import from_store

    run = open_store(str(store))
    loaded = run.load_latest(quarantine=False)
    assert loaded is not None, f"no usable generation in {store}"
    state = torch.load(io.BytesIO(loaded.files["training_state.pt"]), map_location="cpu", weights_only=True)
    return from_store(run, state).state


def without_invocation(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a resumed run must reproduce: the state minus the per-invocation trainer settings."""
    return {**state, "meta": {k: v for k, v in state["meta"].items() if k != "trainer"}}


def line_task(per_sample_loss, *, targets_per_sample: int = 1, rows: int = 10, **kwargs: Any) -> DatasetTask:
    """A small float64 regression through the adapter: rows (x, 2x + 1) with ``targets_per_sample`` outputs."""
    x = torch.linspace(-1.0, 1.0, rows, dtype=torch.float64).unsqueeze(1)
    y = (2.0 * x + 1.0).repeat(1, targets_per_sample)
    return DatasetTask(dataset=TensorDataset(x, y), build_model=lambda: torch.nn.Linear(1, targets_per_sample),
                       per_sample_loss=per_sample_loss, targets_per_sample=targets_per_sample,
                       config={"rows": rows}, batch_size=4, dtype=torch.float64, **kwargs)


def squared_error(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Unreduced squared error per target: ``(n, k)``, or ``(n,)`` for one target a sample."""
    x, y = batch
    err = (model(x) - y) ** 2
    return err.squeeze(1) if err.shape[1] == 1 else err


def built(task: DatasetTask, ids: list[int], *, seed: int = 0, epoch: int = 0) -> Any:
    """The micro-batch of ``ids`` as the trainer gets it: built (as a worker would) and moved to the CPU."""
    request = BatchRequest(seed=seed, step=1, micro=0, epoch=epoch, sample_ids=tuple(ids))
    return task.batch_to_device(task.build_batch(request), CPU)


# -- the adapter, in process --------------------------------------------------------------------------------
@pytest.mark.parametrize("targets_per_sample", [1, 3])
def test_adapter_returns_the_sum_of_per_target_losses_and_their_exact_count(targets_per_sample):
    task = line_task(squared_error, targets_per_sample=targets_per_sample)
    torch.manual_seed(0)
    model = task.build_model().to(torch.float64)
    ids = [7, 2, 9]
    assert task.count_targets(ids) == 3 * targets_per_sample
    batch = built(task, ids)
    x, y = task.dataset.tensors
    expected = ((model(x[ids]) - y[ids]) ** 2).sum()
    got = task.loss_sum(model, batch)
    assert got.shape == () and torch.equal(got, expected)
    assert not torch.equal(got, expected / task.count_targets(ids))  # a sum, not a mean
    # Sums over micro-batches divided by the step's count == the mean over the whole step (what the trainer does).
    whole = task.loss_sum(model, built(task, [7, 2, 9, 4])) / task.count_targets([7, 2, 9, 4])
    split = (task.loss_sum(model, built(task, [7, 2, 9]))
             + task.loss_sum(model, built(task, [4]))) / task.count_targets([7, 2, 9, 4])
    torch.testing.assert_close(split, whole, rtol=1e-15, atol=0.0)
    # The unreduced losses the objective check compares the trained loss with: one per target, summing to loss_sum.
    given = task.target_losses(model, batch)
    assert given.numel() == task.count_targets(ids) and torch.equal(given.sum(), got)


def test_adapter_gives_no_target_losses_when_a_subclass_counts_its_own_targets():
    class Padded(DatasetTask):  # e.g. variable-length rows padded to targets_per_sample: the rows hold padding
        def count_targets(self, sample_ids):
            return 2 * len(sample_ids)

    task = line_task(squared_error, targets_per_sample=3)
    task.__class__ = Padded
    assert task.target_losses(task.build_model().to(torch.float64), built(task, [0, 1])) is None


@pytest.mark.parametrize(("loss", "message"), [
    (lambda m, b: squared_error(m, b).mean(), r"shape \(\), expected \(3,\).*reduction='none'"),
    (lambda m, b: squared_error(m, b).sum(), r"shape \(\), expected \(3,\)"),
    (lambda m, b: squared_error(m, b).unsqueeze(1).repeat(1, 2), r"shape \(3, 2\), expected \(3,\)"),
    (lambda m, b: squared_error(m, b)[:2], r"shape \(2,\), expected \(3,\)"),
    (lambda m, b: squared_error(m, b).long(), "floating-point tensor"),
    (lambda m, b: squared_error(m, b).detach().sum().item(), "floating-point tensor of shape"),
])
def test_adapter_refuses_a_reduced_or_misshapen_loss(loss, message):
    task = line_task(loss)
    model = task.build_model().to(torch.float64)
    with pytest.raises(ConfigError, match=message):
        task.loss_sum(model, built(task, [0, 1, 2]))


def test_adapter_refuses_a_per_sample_loss_where_per_target_losses_are_due():
    # 3 targets a sample: a loss already summed per sample would make the count (and so the mean) wrong by 3x.
    task = line_task(lambda m, b: squared_error(m, b).sum(dim=1), targets_per_sample=3)
    with pytest.raises(ConfigError, match=r"shape \(2,\), expected \(2, 3\)"):
        task.loss_sum(task.build_model().to(torch.float64), built(task, [0, 1]))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": {"sizes": (1, 2)}}, "JSON round trip"),
    ({"config": {"x": torch.zeros(1)}}, "JSON-able"),
    ({"config": {"lr": float("nan")}}, "JSON-able"),
    ({"batch_size": 0}, "batch_size"),
    ({"micro_batch_size": 5}, "micro_batch_size"),
    ({"optimizer": "lbfgs"}, "optimizer 'lbfgs'"),
    ({"data_identity": "not-a-digest"}, "sha256"),
])
def test_adapter_refuses_settings_that_cannot_define_a_run(kwargs, message):
    x = torch.zeros(4, 1)
    base = {"dataset": TensorDataset(x, x), "build_model": lambda: torch.nn.Linear(1, 1),
            "per_sample_loss": squared_error, "config": {}, "batch_size": 4}
    with pytest.raises(ConfigError, match=message):
        DatasetTask(**{**base, **kwargs})


def test_adapter_identity_follows_the_data_and_augmentation_draws_only_from_each_samples_generators():
    a, b = line_task(squared_error), line_task(squared_error)
    assert a.data_identity() == b.data_identity() == dataset_digest(a.dataset)
    assert line_task(squared_error, rows=11).data_identity() != a.data_identity()
    # The sample's own generator, and torch's global one (seeded from the same (seed, epoch, sample) for the call).
    noisy = line_task(squared_error, augment=lambda s, rng: (s[0] + float(rng.normal()) + float(torch.rand(())), s[1]))
    first, again = (built(noisy, [1, 2], seed=5).data[0] for _ in range(2))
    assert torch.equal(first, again)
    for other in (built(noisy, [1, 2], seed=6), built(noisy, [1, 2], seed=5, epoch=1)):
        assert not (other.data[0] == first).any()
    # A sample's augmentation does not depend on the batch it lands in, its place there, or what ran before.
    assert torch.equal(built(noisy, [2, 7], seed=5).data[0][0], first[1])
    torch.manual_seed(1)
    state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()
    python_state = random.getstate()
    built(noisy, [1, 2])
    assert torch.equal(torch.get_rng_state(), state) and (np.random.get_state()[1] == np_state).all()
    assert random.getstate() == python_state


def test_adapter_casts_floating_inputs_to_the_task_dtype_and_keeps_integer_ones():
    x, labels = torch.zeros(4, 2, dtype=torch.float32), torch.arange(4)
    task = DatasetTask(dataset=TensorDataset(x, labels), build_model=lambda: torch.nn.Linear(2, 4),
                       per_sample_loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"),
                       config={}, batch_size=2, dtype=torch.float64)
    inputs, targets = built(task, [0, 3]).data
    assert (inputs.dtype, targets.dtype) == (torch.float64, torch.int64) and targets.tolist() == [0, 3]


def test_charlm_config_round_trips_and_the_stdlib_files_are_its_data_identity():
    task = load_task(CHARLM, {"files": ["colorsys.py"], "context": 32})
    again = load_task(CHARLM, task.config())  # what export's reload check and `verify --audit` do
    assert again.config() == task.config() and again.data_identity() == task.data_identity()
    assert task.config()["files"] == ["colorsys.py"] and task.config()["d_model"] == 64  # defaults resolved
    assert load_task(CHARLM, {"files": ["bisect.py"], "context": 32}).data_identity() != task.data_identity()
    x, y = task.dataset[3]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])  # next-character targets
    assert task.count_targets([0, 1]) == 64 and task.objective == "char_token_mean_v1" and task.cpu_threads == 1
    with pytest.raises(ConfigError, match="does not exist"):
        load_task(CHARLM, {"files": ["no_such_module_here.py"]})


# -- through the real entry point ---------------------------------------------------------------------------
@pytest.mark.slow  # the README test verifies charlm's resume bitwise; SIGTERM itself: tests/test_preempt.py
def test_charlm_sigterm_mid_run_exits_75_and_resumes_bitwise(tmp_path):
    config = tmp_path / "charlm.json"
    config.write_text(json.dumps(SIGTERM_CONFIG))
    args = ("--task", CHARLM, "--config", str(config), "--max-steps", str(SIGTERM_TARGET), "--log-format", "json")
    reference = subprocess.Popen([sys.executable, "-m", "trainproof", "train", "--store", str(tmp_path / "ref"), *args],
                                 cwd=ROOT, env=env_without_trainproof(), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim = subprocess.Popen([sys.executable, "-m", "trainproof", "train", "--store", str(tmp_path / "cut"), *args],
                              cwd=ROOT, env=env_without_trainproof(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Signal as soon as step 2 is reported: the run has 28 steps (over a second) left, so the signal lands
        # mid-run; the trainer finishes the step it is in, commits it and exits 75.
        seen = []
        while True:
            line = victim.stdout.readline()
            assert line, f"the run ended before step 2: {seen[-3:]} {victim.stderr.read()}"
            seen.append(line)
            if any(e["event"] == "step" and e["step"] >= 2 for e in events(line)):
                break
        victim.send_signal(signal.SIGTERM)
        out, err = victim.communicate(timeout=budget(120))
        stopped = [e for e in events("".join(seen) + out) if e["event"] == "stopped"]
        assert victim.returncode == 75 and stopped, err
        cut = stopped[-1]["step"]
        assert stopped[-1]["reason"] == "signal" and 2 <= cut < SIGTERM_TARGET, stopped
        assert final_state(tmp_path / "cut")["progress"]["step"] == cut  # the stop committed its step

        resumed = job("train", "--store", str(tmp_path / "cut"), *args)
        _, ref_err = reference.communicate(timeout=budget(300))
    finally:
        for proc in (victim, reference):
            proc.kill()  # a no-op for a process that has ended; stops it when an assertion above failed
    assert (reference.returncode, resumed.returncode) == (0, 0), ref_err + resumed.stderr
    resume = [e for e in events(resumed.stdout) if e["event"] == "resume"]
    assert resume and (resume[0]["step"], resume[0]["rng_restored"]) == (cut, True), resumed.stdout[-2000:]

    expected, got = final_state(tmp_path / "ref"), final_state(tmp_path / "cut")
    assert got["progress"]["step"] == SIGTERM_TARGET
    assert differences(without_invocation(expected), without_invocation(got)) == []
    assert got["ranks"][0]["data"]["epoch"] == 4  # the resumed part crossed epoch boundaries (7 steps an epoch)


def test_a_misshapen_loss_stops_training_with_exit_2_and_says_why(tmp_path):
    module = tmp_path / "meanloss.py"
    module.write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import TensorDataset
        from trainproof.tasks import DatasetTask

        def factory(config):
            x = torch.linspace(-1, 1, 8).unsqueeze(1)
            return DatasetTask(dataset=TensorDataset(x, 2 * x), build_model=lambda: torch.nn.Linear(1, 1),
                               per_sample_loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),  # a mean: wrong
                               config=dict(config), batch_size=4)
    '''))
    env = env_without_trainproof({"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    result = job("train", "--store", str(tmp_path / "run"), "--task", "meanloss:factory", "--max-steps", "2", env=env)
    assert result.returncode == 2, result.stderr
    assert "per_sample_loss returned shape (), expected (4,)" in result.stderr, result.stderr
    assert "reduction='none'" in result.stderr


def doc_modules() -> dict[str, str]:
    """docs/tasks.md's ``python`` blocks that start with ``# <name>.py``: module name -> source."""
    text = (ROOT / "docs" / "tasks.md").read_text()
    blocks = re.findall(r"```python\n# (\w+)\.py\b[^\n]*\n(.*?)```", text, re.S)
    return {name: body for name, body in blocks}


def test_the_task_examples_in_docs_train_and_round_trip_their_config(tmp_path, monkeypatch):
    modules = doc_modules()
    # the adapter one, the from-scratch one, the latter with its batches built by workers, the classifier, the schedules
    assert set(modules) == {"mytask", "lines", "wlines", "classify", "schedules"}, sorted(modules)
    for name, body in modules.items():
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in modules:
        task = load_task(f"{name}:factory", {"batch_size": 4})
        again = load_task(f"{name}:factory", task.config())
        assert again.config() == task.config() and again.data_identity() == task.data_identity(), name
    lines = load_task("lines:factory", {})  # its target_losses: one loss per target, which loss_sum sums
    model, ctx = lines.build_model().double(), TaskContext(np_rng=np.random.default_rng(0), device=torch.device("cpu"))
    batch = lines.make_batch([0, 5, 9], ctx)
    given = lines.target_losses(model, batch)
    assert given.shape == (3,) and torch.equal(given.sum(), lines.loss_sum(model, batch))
    env = env_without_trainproof({"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "TRAINPROOF_LOG_FORMAT": "json"})
    procs = {name: subprocess.Popen([sys.executable, "-m", "trainproof", "train", "--store", str(tmp_path / name),
                                     "--task", f"{name}:factory", "--max-steps", "8"],
                                    cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in modules}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=budget(300))
        assert proc.returncode == 0, f"{name}: {err}"
        losses = [e["loss"] for e in events(out) if e["event"] == "step"]
        assert len(losses) == 8 and losses[-1] < losses[0], (name, losses)
        assert final_state(tmp_path / name)["progress"]["step"] == 8
        started = next(e for e in events(out) if e["event"] == "start")
        assert started["data_workers"] == {"mytask": 0, "lines": None, "wlines": 2, "classify": 0, "schedules": 0}[name]


def test_the_classifier_example_exports_its_accuracy_and_the_reload_check_reproduces_it(tmp_path, monkeypatch):
    """docs/tasks.md's classifier declares ``eval_metrics={"accuracy": ...}``: ``trainproof export`` records the
    accuracy of the exported weights beside the loss (what a plain evaluation of those weights gives), prints it,
    and the fresh-process reload check reproduces it from both weights files."""
    (tmp_path / "classify.py").write_text(doc_modules()["classify"])
    env = env_without_trainproof({"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    store = tmp_path / "run"
    for argv in (["train", "--store", str(store), "--task", "classify:factory", "--max-steps", "24"],
                 ["export", "--store", str(store), "--task", "classify:factory"]):
        done = subprocess.run([sys.executable, "-m", "trainproof", *argv], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=budget(300))
        assert done.returncode == 0, done.stderr[-3000:]
    bundle = store / "exports" / "step-00000024"
    recorded = json.loads((bundle / "metrics.json").read_text())["eval"]
    assert recorded["metric"] == "loss" and set(recorded["others"]) == set(recorded["others_bf16"]) == {"accuracy"}
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("classify:factory", {})
    model = task.build_model()
    model.load_state_dict(_full_precision(bundle))
    x, y = task.eval_dataset.tensors
    with torch.no_grad():
        expected = float((model(x).argmax(dim=1) == y).double().mean())
    assert recorded["others"]["accuracy"] == expected and 0.5 < expected <= 1.0  # trained: better than a coin
    assert f"other metrics: accuracy {expected:.6g}" in done.stdout, done.stdout
    check = json.loads((store / "exports" / "step-00000024.reload-check.json").read_text())
    assert check["passed"] and check["checks"]["other_metrics_reproduced"] == {"passed": True,
                                                                              "metrics": ["accuracy"]}
    assert check["others"]["accuracy"] == {"recorded": expected, "reloaded": expected}


def test_eval_metrics_are_checked_like_the_loss_and_a_metric_not_reproduced_fails_the_reload_check():
    """A metric function that returns booleans (or reduces) is one line naming the metric; names are checked when
    the task is built; the reload check fails a metric whose value, or set of names, the bundle does not match."""
    from trainproof.proof.reload import _others_close

    x = torch.linspace(-1, 1, 8).unsqueeze(1)
    data = TensorDataset(x, (x > 0).long().squeeze(1))
    build = lambda **kw: DatasetTask(dataset=data, build_model=lambda: torch.nn.Linear(1, 2), config={},  # noqa: E731
                                     per_sample_loss=lambda m, b: torch.nn.functional.cross_entropy(
                                         m(b[0]), b[1], reduction="none"), batch_size=4, eval_dataset=data, **kw)
    as_bool = build(eval_metrics={"accuracy": lambda m, b: m(b[0]).argmax(1) == b[1]})
    with pytest.raises(ConfigError, match=r"eval_metrics\['accuracy'\] must return a floating-point .*use \.float"):
        as_bool.evaluate_metrics(as_bool.build_model())
    reduced = build(eval_metrics={"accuracy": lambda m, b: (m(b[0]).argmax(1) == b[1]).float().mean()})
    with pytest.raises(ConfigError, match=r"eval_metrics\['accuracy'\] returned shape \(\), expected \(4,\)"):
        reduced.evaluate_metrics(reduced.build_model())
    for bad in ({"loss": lambda m, b: None}, {"": lambda m, b: None}, {"accuracy": 1}):
        with pytest.raises(ConfigError, match="eval_metrics"):
            build(eval_metrics=bad)
    good = build(eval_metrics={"accuracy": lambda m, b: (m(b[0]).argmax(1) == b[1]).float()})
    model = good.build_model()
    values = good.evaluate_metrics(model)
    assert set(values) == {"loss", "accuracy"} and values["loss"] == good.evaluate(model)
    assert values["accuracy"] in {k / 8 for k in range(9)}  # a mean over the 8 evaluation samples
    recorded = {"others": {"accuracy": 0.75}, "others_bf16": {"accuracy": 0.5}}
    assert _others_close(recorded, {"accuracy": 0.75}, {"accuracy": 0.5})["passed"]
    assert _others_close(recorded, {"accuracy": 0.625}, {"accuracy": 0.5})["failed"] == ["others.accuracy"]
    assert not _others_close(recorded, {"accuracy": 0.75, "f1": 0.5}, {"accuracy": 0.5, "f1": 0.5})["passed"]
    assert not _others_close({"others": {"accuracy": "0.75"}, "others_bf16": {"accuracy": 0.5}},
                             {"accuracy": 0.75}, {"accuracy": 0.5})["passed"]
    assert _others_close({}, {}, {})["passed"]  # a task without other metrics: nothing recorded, nothing to match


def _full_precision(bundle: Path) -> dict[str, torch.Tensor]:
    """The exported full-precision weights, read the way a user would."""
    name = json.loads((bundle / "config.json").read_text())["weights"]["full_precision"]
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(bundle / name))
    return torch.load(bundle / name, weights_only=True)


def readme_commands(heading: str = "## Train your own model") -> list[str]:
    """The command lines of the first ``bash`` block under README.md's ``heading`` (to the next heading), verbatim."""
    readme = (ROOT / "README.md").read_text()
    section = re.split(r"\n#{2,3} ", readme.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"README.md's {heading!r} section has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_section_runs_as_written_and_its_verify_passes(tmp_path):
    """The README block in one bash script, from the repository root, with ``bash scripts/dev.sh`` replaced by
    the console script it execs (dev.sh would otherwise build a venv of its own), the run folder moved into
    tmp_path and 200 steps cut to 20 (time). Nothing puts the checkout on PYTHONPATH but the block itself."""
    trainproof = Path(sys.executable).parent / "trainproof"
    assert trainproof.is_file(), f"no console script next to {sys.executable}: install with `pip install -e .`"
    store = tmp_path / "charlm"
    lines = readme_commands()
    assert any(line.startswith("bash scripts/dev.sh train") and CHARLM in line for line in lines), lines
    script = "\n".join(
        line.replace("bash scripts/dev.sh ", f"{shlex.quote(str(trainproof))} ")
            .replace("./runs/charlm", shlex.quote(str(store)))
            .replace("--max-steps 200", "--max-steps 20")
        for line in lines
    )
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, text=True, capture_output=True,
                            env=env_without_trainproof({"TRAINPROOF_LOG_FORMAT": "json"}, pythonpath=False),
                            timeout=budget(600))
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    # train: 20 steps committed
    assert final_state(store)["progress"]["step"] == 20
    # verify: the report read back from the store says passed, bitwise
    vids = [p.name for p in (store / "verification").iterdir() if p.is_dir()]
    assert len(vids) == 1, vids
    report = json.loads(open_store(f"{store}/verification/{vids[0]}").read_file("verification.json"))
    assert report["completed"] and report["failing_checks"] == [], report["failing_checks"]
    assert (report["all_checks_passed"], report["positive"], report["negative_divergence_detected"]) == (True,) * 3
    assert report["settings"]["task"] == CHARLM and report["settings"]["config"].endswith("charlm-quick.json")
    resume = {c["name"]: c for c in report["checks"]["resume"]}
    assert {"parameters", "optimizer", "losses", "rng_next_draws", "data_position"} <= set(resume)
    assert all(c["max_abs_diff"] == 0.0 for c in resume.values()), resume
    assert report["export"]["reload_check"]["passed"] is True
    # export: the run's own bundle, committed and reload-checked in a fresh process
    bundle = open_store(f"{store}/exports")
    assert [(g.step, g.status) for g in bundle.scan()] == [(20, "complete")]
    record = json.loads(bundle.read_file("step-00000020.reload-check.json"))
    assert record["passed"] is True and record["metric"] == "heldout_char_loss"


@pytest.mark.slow  # test_verify_cuts covers a lost generator family
def test_verify_catches_a_task_that_draws_from_a_private_generator(tmp_path):
    """docs/tasks.md's pitfall: a generator the trainer does not own restarts with every process, so the
    resumed path replays the first draws instead of continuing them, and the comparison fails (exit 1)."""
    module = tmp_path / "privaterng.py"
    module.write_text(textwrap.dedent('''
        import numpy as np
        import torch
        from torch.utils.data import TensorDataset
        from trainproof.tasks import DatasetTask

        def factory(config):
            private = np.random.default_rng(0)  # WRONG: not checkpointed by the trainer
            x = torch.linspace(-1, 1, 12, dtype=torch.float64).unsqueeze(1)
            return DatasetTask(
                dataset=TensorDataset(x, 2 * x), build_model=lambda: torch.nn.Linear(1, 1),
                per_sample_loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).squeeze(1),
                augment=lambda s, rng: (s[0] + float(private.normal(0.0, 0.1)), s[1]),  # should use rng
                config=dict(config), batch_size=4, dtype=torch.float64, optimizer="sgd", lr=0.1)
    '''))
    env = env_without_trainproof({"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    store = str(tmp_path / "run")
    result = job("verify", "--store", store, "--task", "privaterng:factory", "--steps", "4", "--cut", "2",
                 "--id", "v", "--no-export", env=env)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(open_store(f"{store}/verification/v").read_file("verification.json"))
    assert report["completed"] and not report["all_checks_passed"]
    resume = {c["name"]: c for c in report["checks"]["resume"]}
    assert not resume["losses"]["within_tolerance"] and resume["losses"]["first_step"] == 3
    assert resume["sample_ids"]["within_tolerance"]  # same rows: only the private draws differ
