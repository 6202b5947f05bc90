"""Pretrained weights without transformers (tests/test_hf.py has the example's end-to-end runs): the file loaded into
the model on a fresh start is exactly the file's tensors, in one process and in a sharded 2-rank run (FSDP2), where it
gives the same losses as the replicated (DDP) run that loads the same file."""

from __future__ import annotations

import hashlib
import os
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from tests.test_train_helpers import ROOT, run

TASK = textwrap.dedent('''
    import hashlib, os, torch
    from torch.utils.data import TensorDataset
    from trainproof.tasks import DatasetTask, Pretrained

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 8), torch.nn.Linear(8, 1)])

        def forward(self, x):
            return self.blocks[1](torch.tanh(self.blocks[0](x)))

    def factory(config):
        x = torch.linspace(-1, 1, 32, dtype=torch.float64).unsqueeze(1)
        data = TensorDataset(torch.cat([x, x * x], 1), 3 * x)
        files = [Pretrained(url=config["init_from"], sha256=config["init_sha256"])] if config.get("init_from") else []
        return DatasetTask(dataset=data, eval_dataset=data, build_model=Net,
                           per_sample_loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).squeeze(1), config=dict(config),
                           batch_size=4, dtype=torch.float64, optimizer="sgd", lr=0.1, pretrained=files)
''')


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    (tmp_path / "pretask.py").write_text(TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("pretask")
    torch.manual_seed(5)
    weights = {k: v.contiguous() for k, v in module.Net().state_dict().items()}  # float32: cast on load
    path = tmp_path / "w.safetensors"
    save_file(weights, str(path))
    yield module, path, weights
    import sys

    sys.modules.pop("pretask", None)


def test_a_fresh_start_holds_exactly_the_files_tensors(task_module):
    from trainproof.tasks import load_task
    from trainproof.train.pretrained import start_from_pretrained
    from trainproof.train.run import build_run

    _, path, weights = task_module
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    task = load_task("pretask:factory", {"init_from": str(path), "init_sha256": sha})
    run_ = build_run(task, torch.device("cpu"), 1)
    before = {k: v.clone() for k, v in run_.model.state_dict().items()}
    report = start_from_pretrained(task.pretrained(), run_.parallel.load_initial, run_.model)
    assert report["tensors"] == len(weights) and report["files"] == [{"url": str(path), "sha256": sha}]
    for key, tensor in run_.model.state_dict().items():
        assert tensor.dtype == torch.float64 and torch.equal(tensor, weights[key].double()), key
        assert not torch.equal(tensor, before[key]), key  # the seeded initialisation was overwritten


@pytest.mark.slow  # two 2-rank launches; the replicated load is checked in process above
def test_a_sharded_run_starts_from_the_file_like_a_replicated_one(task_module, tmp_path):
    _, path, _ = task_module
    config = tmp_path / "init.json"
    config.write_text(f'{{"init_from": "{path}", "init_sha256": "{hashlib.sha256(path.read_bytes()).hexdigest()}"}}')
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    args = ("--task", "pretask:factory", "--config", str(config), "--nproc-per-node", "2", "--max-steps", "3")
    sharded, replicated = run(tmp_path / "fsdp", *args, "--fsdp", env=env), run(tmp_path / "ddp", *args, env=env)
    assert (sharded.code, replicated.code) == (0, 0), sharded.stderr[-2000:] + replicated.stderr[-2000:]
    assert sharded.last("pretrained")["tensors"] == replicated.last("pretrained")["tensors"] == 4
    losses = [[e["loss"] for e in r.events if e["event"] == "step"] for r in (sharded, replicated)]
    assert losses[0] == losses[1] and len(losses[0]) == 3, losses
    seeded = run(tmp_path / "seeded", "--task", "pretask:factory", "--nproc-per-node", "2", "--max-steps", "1", env=env)
    assert seeded.code == 0 and seeded.last("step")["loss"] != losses[0][0]  # the file, not the seeded init


def test_weights_that_do_not_hash_to_the_declared_sha256_end_the_run_with_exit_1_naming_the_file(task_module,
                                                                                                  tmp_path):
    """Stored content the operator can put back, not a flag error: exit 1 (the Job retries), never 2; nothing is
    committed, and the file put back lets the retry go on."""
    _, path, _ = task_module
    good = path.read_bytes()
    declared = hashlib.sha256(good).hexdigest()
    config = tmp_path / "init.json"
    config.write_text(f'{{"init_from": "{path}", "init_sha256": "{declared}"}}')
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    args = ("--task", "pretask:factory", "--config", str(config), "--max-steps", "2")
    result = run(tmp_path / "run", *args, env=env)
    assert result.code == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert len(errors) == 1 and errors[0].startswith(f"trainproof: error: pretrained weights {path}: its sha256 is "
                                                     f"{hashlib.sha256(path.read_bytes()).hexdigest()}, not the "
                                                     f"declared {declared}"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not list((tmp_path / "run").glob("step-*"))
    path.write_bytes(good)
    again = run(tmp_path / "run", *args, env=env)
    assert again.code == 0 and again.last("pretrained")["tensors"] == 4, again.stderr[-2000:]


def test_the_contract_holds_the_pretrained_sha256_and_a_chosen_precision_and_nothing_for_older_runs():
    """``init_sha256`` and ``precision`` enter the contract only when used: a run without them keeps the contract it
    always had (an upgrade refuses no existing run); with them, another file or precision is another experiment,
    named even when the task's settings do not mention it (the file in code, not in config())."""
    from trainproof.format.contract import build_plan, differences

    base = {"task": "t:f", "task_config": {}, "data_identity": "d" * 64, "seed": 1, "world": 1, "objective": "o",
            "code_version": "c"}
    plain = build_plan(**base)
    assert build_plan(**base, precision="auto", init=[])["contract"] == plain["contract"]
    assert "precision" not in plain and "init_sha256" not in plain
    a, b = build_plan(**base, init=["a" * 64]), build_plan(**base, init=["b" * 64])
    bf16 = build_plan(**base, precision="bf16")
    assert len({plain["contract"], a["contract"], b["contract"], bf16["contract"]}) == 4
    assert differences(a, b) == ["init_sha256: the pretrained weights (stored sha256 aaaaaaaaaaaa..., "
                                 "now sha256 bbbbbbbbbbbb...)"]
    assert differences(plain, a) == ["init_sha256: the pretrained weights (stored none: the seeded initialisation, "
                                     "now sha256 aaaaaaaaaaaa...)"]
    assert differences(plain, bf16) == ["precision (stored 'auto', now 'bf16')"]


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_download_file_spools_a_file_with_its_plain_sha256_and_refuses_what_it_must(kind, tmp_path):
    """The store call pretrained weights come through: the spool's sha256 is what ``sha256sum`` prints (not the part
    digest of a generation's manifest), and a missing file, a file over the cap or a path are refused."""
    import uuid

    from trainproof.storage import open_store

    store = open_store(f"memory://dl-{uuid.uuid4().hex[:8]}/m" if kind == "memory" else str(tmp_path / "m"))
    data = os.urandom(3 * 2**20 + 17)
    store.write_file("w.safetensors", data)
    spool = store.download_file("w.safetensors", directory=str(tmp_path))
    try:
        assert spool.sha256 == hashlib.sha256(data).hexdigest() and spool.size == len(data)
        with open(spool.path, "rb") as fh:
            assert fh.read() == data
    finally:
        spool.unlink()
    with pytest.raises(FileNotFoundError):
        store.download_file("missing.safetensors")
    with pytest.raises(ValueError, match="more than the 1024 allowed"):
        store.download_file("w.safetensors", max_bytes=1024)
    with pytest.raises(ValueError, match="path separator"):
        store.download_file("../w.safetensors")
