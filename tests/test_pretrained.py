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
        files = [Pretrained(url=config["init_from"], sha256=config.get("init_sha256", ""),
                            digest=config.get("init_digest", ""))] if config.get("init_from") else []
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
@pytest.mark.parametrize("mib", [0, 3, 5, 40])
def test_download_file_spools_a_file_with_its_plain_sha256_and_refuses_what_it_must(kind, mib, tmp_path):
    """The store call pretrained weights come through: the spool's sha256 is what ``sha256sum`` prints (not the part
    digest of a generation's manifest), and a missing file, a file over the cap or a path are refused. Sizes on each
    side of what changes the path: a read hashed inline (under 4 MiB), hashed beside the spool's write (4 MiB and
    over), several ranged reads (over 8 MiB), several digest parts' worth (over 32 MiB)."""
    import uuid

    from trainproof.storage import open_store

    store = open_store(f"memory://dl-{uuid.uuid4().hex[:8]}/m" if kind == "memory" else str(tmp_path / "m"))
    data = os.urandom(mib * 2**20 + 17)
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
    with pytest.raises(ValueError, match=f"more than the {len(data) - 1} allowed"):
        store.download_file("w.safetensors", max_bytes=len(data) - 1)
    with pytest.raises(ValueError, match="path separator"):
        store.download_file("../w.safetensors")


# -- a Hugging Face model directory ---------------------------------------------------------------------------
SHARDS = {"model-00001-of-00002.safetensors": ("blocks.0.weight", "blocks.0.bias"),
          "model-00002-of-00002.safetensors": ("blocks.1.weight", "blocks.1.bias")}


def write_model_dir(folder, weights: dict, shards: dict = SHARDS, index: dict | None = None) -> None:
    """A published model's layout, as save_pretrained(max_shard_size=...) writes it: two shards, the index naming
    each tensor's shard, config.json and a tokenizer file (verified, never read by the trainer)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for shard, names in shards.items():
        save_file({n: weights[n] for n in names}, str(folder / shard))
    weight_map = index or {n: shard for shard, names in shards.items() for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text('{"architectures": ["Net"], "model_type": "net"}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')


def digest_cli(url, env: dict | None = None):
    """``trainproof digest URL`` in its own process: (exit code, the printed JSON or None, stderr)."""
    import json
    import subprocess
    import sys

    from tests.test_train_helpers import train_env

    proc = subprocess.run([sys.executable, "-m", "trainproof", "digest", str(url)], cwd=ROOT, text=True,
                          capture_output=True, env=train_env(env), timeout=300)
    out = json.loads(proc.stdout) if proc.returncode == 0 else None
    return proc.returncode, out, proc.stderr


def _dir_config(tmp_path, name: str, url, digest: str):
    config = tmp_path / f"{name}.json"
    config.write_text(f'{{"init_from": "{url}", "init_digest": "{digest}"}}')
    return str(config)


def _errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]


def test_a_sharded_directory_starts_a_run_from_the_digest_the_command_prints(task_module, tmp_path):
    """``trainproof digest`` lists the folder and prints the listing's sha256; a run declaring it loads the shards
    through the index (the same first loss as a run from one file holding the same tensors), records the digest in
    plan.json's contract, and a resume declaring another directory is refused (exit 2, naming the field)."""
    import json

    _, path, weights = task_module
    folder = tmp_path / "net"
    write_model_dir(folder, weights)
    code, printed, err = digest_cli(folder)
    assert code == 0, err
    listing = (folder / "trainproof-listing.json").read_bytes()
    assert printed["digest"] == hashlib.sha256(listing).hexdigest() and printed["listing"] == "written"
    assert printed["files"] == 5 and printed["weights"] == sorted(SHARDS) and printed["architectures"] == ["Net"]
    assert [f["name"] for f in json.loads(listing)["files"]] == sorted(p.name for p in folder.iterdir()
                                                                       if p.name != "trainproof-listing.json")
    assert digest_cli(folder)[1]["listing"] == "unchanged"  # run again: every file checked against the listing

    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    args = ("--task", "pretask:factory", "--max-steps", "2")
    from_dir = run(tmp_path / "run", *args, "--config", _dir_config(tmp_path, "dir", folder, printed["digest"]),
                   env=env)
    assert from_dir.code == 0, from_dir.stderr[-2000:]
    loaded = from_dir.last("pretrained")
    assert loaded["tensors"] == 4 and loaded["files"][0]["digest"] == printed["digest"]
    assert loaded["files"][0]["weights"] == sorted(SHARDS) and loaded["bytes"] == printed["bytes"]
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["init_sha256"] == [printed["digest"]]
    file_config = tmp_path / "file.json"
    file_config.write_text(f'{{"init_from": "{path}", "init_sha256": "{hashlib.sha256(path.read_bytes()).hexdigest()}"}}')
    from_file = run(tmp_path / "file-run", *args, "--config", str(file_config), env=env)
    assert from_file.code == 0, from_file.stderr[-2000:]
    losses = [[e["loss"] for e in r.events if e["event"] == "step"] for r in (from_dir, from_file)]
    assert losses[0] == losses[1] and len(losses[0]) == 2

    other = tmp_path / "other"
    write_model_dir(other, {k: v + 1 for k, v in weights.items()})
    other_digest = digest_cli(other)[1]["digest"]
    changed = run(tmp_path / "run", "--task", "pretask:factory", "--max-steps", "3", "--config",
                  _dir_config(tmp_path, "other", other, other_digest), env=env)
    assert changed.code == 2, changed.stderr[-2000:]
    assert "init_sha256: the pretrained weights (stored sha256 " in changed.stderr, changed.stderr[-2000:]


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": (lambda d: _flip(d / "model-00002-of-00002.safetensors"), 1,
                "pretrained weights {d}/model-00002-of-00002.safetensors: its sha256 is "),
    "missing": (lambda d: (d / "model-00001-of-00002.safetensors").unlink(), 1,
                "pretrained weights {d}: model-00001-of-00002.safetensors, listed in its trainproof-listing.json, "
                "is not in the directory"),
    "extra": (lambda d: (d / "modeling_net.py").write_text("import os"), 1,
              "pretrained weights {d}: 'modeling_net.py' is in the directory but not in its trainproof-listing.json"),
    "digest": (lambda d: None, 1, "pretrained weights {d}: its trainproof-listing.json hashes to "),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_directory_that_is_not_the_declared_one_is_refused_by_name_with_exit_1(task_module, tmp_path, damage):
    """Stored content the operator can put back: one line naming the file (a flipped byte in one shard, a shard
    gone, a file added) or the listing (another digest declared), exit 1, nothing committed."""
    _, _, weights = task_module
    folder = tmp_path / "net"
    write_model_dir(folder, weights)
    digest = digest_cli(folder)[1]["digest"]
    change, code, message = DAMAGE[damage]
    change(folder)
    declared = "0" * 64 if damage == "digest" else digest
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    result = run(tmp_path / "run", "--task", "pretask:factory", "--max-steps", "2", "--config",
                 _dir_config(tmp_path, "dir", folder, declared), env=env)
    assert result.code == code, result.stderr[-2000:]
    errors = _errors(result)
    assert len(errors) == 1 and errors[0].startswith("trainproof: error: " + message.format(d=folder)), errors
    assert "Traceback" not in result.stderr and not list((tmp_path / "run").glob("step-*"))


def test_a_directory_whose_names_do_not_fit_the_model_or_its_index_is_refused_naming_the_tensor(task_module, tmp_path):
    """What the declared directory holds but the model cannot take (exit 2, one line naming it): a tensor the model
    does not have, a tensor the index maps to a shard that lacks it, an index naming a shard the directory never
    had (refused by the digest command already)."""
    _, _, weights = task_module
    renamed = {**{k: v for k, v in weights.items() if k != "blocks.1.bias"}, "blocks.1.offset": weights["blocks.1.bias"]}
    folder = tmp_path / "renamed"
    write_model_dir(folder, renamed, shards={**SHARDS, "model-00002-of-00002.safetensors": ("blocks.1.weight",
                                                                                            "blocks.1.offset")})
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    result = run(tmp_path / "run", "--task", "pretask:factory", "--max-steps", "1", "--config",
                 _dir_config(tmp_path, "renamed", folder, digest_cli(folder)[1]["digest"]), env=env)
    assert result.code == 2, result.stderr[-2000:]
    errors = _errors(result)
    assert len(errors) == 1 and "hold 1 tensor(s) the model does not have: ['blocks.1.offset']" in errors[0], errors

    from trainproof.errors import ConfigError
    from trainproof.tasks import Pretrained, load_task
    from trainproof.train.pretrained import start_from_pretrained
    from trainproof.train.run import build_run

    task = load_task("pretask:factory", {})
    run_ = build_run(task, torch.device("cpu"), 1)
    lacking = tmp_path / "lacking"
    index = {n: shard for shard, names in SHARDS.items() for n in names}
    write_model_dir(lacking, weights, shards={**SHARDS, "model-00002-of-00002.safetensors": ("blocks.1.weight",)},
                    index=index)
    spec = Pretrained(url=str(lacking), digest=digest_cli(lacking)[1]["digest"])
    with pytest.raises(ConfigError, match=r"model-00002-of-00002.safetensors: tensor 'blocks.1.bias', which "
                                          r"model.safetensors.index.json maps to this shard, is not in it"):
        start_from_pretrained([spec], run_.parallel.load_initial, run_.model)

    unsharded = tmp_path / "unsharded"
    write_model_dir(unsharded, weights, index={**index, "blocks.1.bias": "model-00003-of-00003.safetensors"})
    code, _, err = digest_cli(unsharded)
    assert code == 2 and ("shard model-00003-of-00003.safetensors, which model.safetensors.index.json names for "
                          "tensor 'blocks.1.bias', is not in the directory") in err, err


def test_the_digest_command_names_a_file_that_differs_from_the_listing_and_refuses_a_subfolder(task_module, tmp_path):
    _, _, weights = task_module
    folder = tmp_path / "net"
    write_model_dir(folder, weights)
    assert digest_cli(folder)[0] == 0
    _flip(folder / "model-00001-of-00002.safetensors")
    code, _, err = digest_cli(folder)
    assert code == 1 and "holds a trainproof-listing.json that does not list its files: " \
                         "model-00001-of-00002.safetensors has sha256 " in err, err
    (tmp_path / "nested" / "original").mkdir(parents=True)
    (tmp_path / "nested" / "config.json").write_text("{}")
    code, _, err = digest_cli(tmp_path / "nested")
    assert code == 2 and "holds 'original', which is a folder or a link, not a file" in err, err


@pytest.mark.s3
def test_a_sharded_directory_in_a_bucket_starts_a_run(task_module, tmp_path, s3_env):
    """The same directory under an s3:// prefix: the digest command reads it through the store and writes its listing
    there; the run reads and verifies every object with the run's S3 settings and trains exactly as from the folder."""
    from trainproof.storage import open_store

    _, _, weights = task_module
    folder = tmp_path / "net"
    write_model_dir(folder, weights)
    url = f"s3://{s3_env}/models/net"
    bucket = open_store(url)
    for p in sorted(folder.iterdir()):
        bucket.write_file(p.name, p.read_bytes())
    code, printed, err = digest_cli(url)
    assert code == 0 and printed["files"] == 5 and printed["listing"] == "written", err
    assert printed["digest"] == digest_cli(folder)[1]["digest"]  # the same bytes, wherever they are
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    result = run(tmp_path / "run", "--task", "pretask:factory", "--max-steps", "2", "--config",
                 _dir_config(tmp_path, "s3", url, printed["digest"]), env=env)
    assert result.code == 0, result.stderr[-2000:]
    assert result.last("pretrained")["files"][0]["url"] == url and result.last("pretrained")["tensors"] == 4
    local = run(tmp_path / "local", "--task", "pretask:factory", "--max-steps", "2", "--config",
                _dir_config(tmp_path, "local", folder, printed["digest"]), env=env)
    assert local.code == 0, local.stderr[-2000:]
    assert [e["loss"] for e in result.events if e["event"] == "step"] == \
           [e["loss"] for e in local.events if e["event"] == "step"]
    bucket.write_file("model-00002-of-00002.safetensors",  # a co-tenant damages one shard
                      (folder / "model-00002-of-00002.safetensors").read_bytes()[:-1] + b"\x00")
    damaged = run(tmp_path / "damaged", "--task", "pretask:factory", "--max-steps", "1", "--config",
                  _dir_config(tmp_path, "s3", url, printed["digest"]), env=env)
    assert damaged.code == 1 and _errors(damaged)[0].startswith(
        f"trainproof: error: pretrained weights {url}/model-00002-of-00002.safetensors: its sha256 is "), \
        damaged.stderr[-2000:]
