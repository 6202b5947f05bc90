"""``train --fsdp``: FSDP2 on two gloo ranks (CPU), real launches. A run cut and resumed, and a run stopped by a
SIGTERM to one rank, end bit for bit equal to an uninterrupted one (the sharded model and optimizer gathered
whole here, in the test; the training state and rank files compared as for DDP); the sharded run equals the DDP
run step for step; a 2-rank generation resharded into one process loads exactly the saved state; a run cannot
switch between sharded and replicated training. ``trainproof export`` of the sharded run writes the weights of the
same run under DDP (bit for bit), and a changed byte in a shard makes the verifier's read and the export fail, naming
the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import warnings
from datetime import datetime
from pathlib import Path

import pytest
import torch

from trainproof.errors import ConfigError, ContractError, TrainError
from trainproof.proof.compare import SECTIONS, Tolerance, compare_all
from trainproof.proof.paths import RunReader
from trainproof.format.contract import build_plan, check_plan
from trainproof.export.bundle import FP_FILE, export
from trainproof.train.fsdp import complete_state
from trainproof.train.fsdp import full_state as gather
from trainproof.train.sharded import GenerationReader, ShardedLoadError
from trainproof.format.state import STATE_FILE, decode_generation, rank_file
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_dist_helpers import load_world_state, rank_pids, read_until, start_world
from tests.test_train_helpers import differences, finish, history_rows, run, startup_s, trajectory
from tests.test_verify_helpers import trainproof

TARGET, CUT = 9, 4  # 21 rows in global batches of 8: 3 steps an epoch; step 4 is mid-epoch (cursor 8)
CONFIG = {"rows": 21}  # the regression fixture otherwise: dropout, noise and gain draw from every generator
FSDP = ("--fsdp",)


def full_state(store, step: int | None = None) -> dict:
    """The sharded model and optimizer of generation ``step`` (default: the newest), gathered whole from every
    shard in this process (DCP reads through the generation reader: verified bytes), flattened to
    ``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``optim.param_groups``."""
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    s = open_store(str(store))
    step = step if step is not None else [g.step for g in s.scan() if g.status == "complete"][-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        nested = _load_state_dict_from_keys(storage_reader=GenerationReader(s, step))
    out: dict = {}

    def flat(value, prefix):
        if isinstance(value, dict):
            for k, v in value.items():
                flat(v, f"{prefix}.{k}" if prefix else k)
        else:
            out[prefix] = value

    flat(nested, "")
    return out


def shard_digests(store, step: int) -> dict[str, str]:
    files = open_store(str(store)).generation(step).manifest["files"]
    return {n: f["sha256"] for n, f in files.items() if n.endswith(".distcp")}


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """A continuous sharded run, the same run under DDP, and a sharded run cut at CUT then resumed."""
    d = tmp_path_factory.mktemp("fsdp2")
    (d / "cfg.json").write_text(json.dumps(CONFIG))
    common = ("--config", str(d / "cfg.json"))
    procs = {"cont": start_world(d / "cont", *FSDP, *common, "--max-steps", str(TARGET), "--checkpoint-every", "3"),
             "ddp": start_world(d / "ddp", *common, "--max-steps", str(TARGET)),
             "cut": start_world(d / "cut", *FSDP, *common, "--max-steps", str(CUT))}
    results = {k: finish(p, timeout=budget(300)) for k, p in procs.items()}
    assert [r.code for r in results.values()] == [0, 0, 0], [r.stderr[-2000:] for r in results.values()]
    results["resume"] = finish(start_world(d / "cut", *FSDP, *common, "--max-steps", str(TARGET)), timeout=budget(300))
    assert results["resume"].code == 0, results["resume"].stderr
    return {"dir": d, "common": common, "results": results, "reference": trajectory(load_world_state(d / "cont")),
            "reference_shards": full_state(d / "cont")}


def test_a_sharded_generation_lists_every_shard_beside_the_state_in_one_manifest(fsdp2):
    info = open_store(str(fsdp2["dir"] / "cont")).generation(TARGET)
    files = set(info.manifest["files"])
    own = {STATE_FILE, "history.pt", rank_file(1), "dcp.metadata", "shard-00000.distcp", "shard-00001.distcp"}
    assert own <= files
    assert files - own <= {
        "values-00000.distcp", "values-00001.distcp"}
    assert info.manifest["extra"]["sharded"]["shards"] == ["shard-00000.distcp", "shard-00001.distcp"]
    assert info.manifest["dcp_metadata_sha256"] == info.manifest["files"]["dcp.metadata"]["sha256"]
    state = load_world_state(fsdp2["dir"] / "cont")
    assert state["model"] == {} and state["optimizer"] == {} and state["meta"]["fsdp"] is True  # only in shards
    plan = json.loads((fsdp2["dir"] / "cont" / "plan.json").read_text())
    assert plan["fsdp"] is True and fsdp2["results"]["cont"].last("start")["fsdp"] is True


def test_the_sharded_run_equals_the_ddp_run_step_for_step(fsdp2):
    ddp = load_world_state(fsdp2["dir"] / "ddp")
    ref = fsdp2["reference"]
    assert [r["loss"] for r in history_rows(ddp)] == [r["loss"] for r in history_rows(ref)]  # exactly
    assert differences({k: v for k, v in ddp.items() if k not in ("meta", "model", "optimizer")},
                       {k: v for k, v in ref.items() if k not in ("meta", "model", "optimizer")}) == []
    shards, names = fsdp2["reference_shards"], list(ddp["model"])
    assert differences(ddp["model"], {n: shards[f"model.{n}"] for n in names}) == []
    for i, name in enumerate(names):  # DDP's optimizer state is keyed by index, DCP's by parameter name
        assert differences(ddp["optimizer"]["state"][i],
                           {k: shards[f"optim.state.{name}.{k}"] for k in ddp["optimizer"]["state"][i]}) == [], name
    assert shards["optim.param_groups"][0]["lr"] == ddp["optimizer"]["param_groups"][0]["lr"]


def test_a_cut_sharded_run_resumes_bitwise(fsdp2):
    cut = fsdp2["dir"] / "cut"
    assert fsdp2["results"]["resume"].last("resume")["step"] == CUT
    assert differences(fsdp2["reference"], trajectory(load_world_state(cut))) == []
    assert differences(fsdp2["reference_shards"], full_state(cut)) == []
    assert shard_digests(cut, TARGET) == shard_digests(fsdp2["dir"] / "cont", TARGET)  # the very same bytes


def test_sigterm_to_one_rank_commits_once_exits_75_and_resumes_bitwise(fsdp2, tmp_path):
    store = tmp_path / "chain"
    proc = start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET),
                       env={"TPHOOK_STEP_DELAY": "0.3"})  # test-only: lets the signal land mid-run
    lines: list[str] = []
    pids = rank_pids(proc, lines)
    read_until(proc, lambda e: e.get("event") == "step" and e["step"] >= 2, lines)
    os.kill(pids[1], signal.SIGTERM)  # a single worker
    result = finish(proc, timeout=budget(120))
    assert result.code == 75, result.stderr
    assert result.last("world_exit")["codes"] == [75, 75]
    stopped = result.last("stopped")
    assert stopped["reason"] == "signal" and stopped["ranks_signalled"] == 1 and stopped["step"] < TARGET
    commits = [e for e in result.events if e.get("event") == "checkpoint"]
    assert [c["step"] for c in commits] == [stopped["step"]]  # one commit, of the step every rank agreed on
    assert [g.step for g in open_store(str(store)).scan() if g.status == "complete"] == [stopped["step"]]
    final = finish(start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert final.code == 0 and final.last("resume")["step"] == stopped["step"], final.stderr
    assert differences(fsdp2["reference"], trajectory(load_world_state(store))) == []
    assert differences(fsdp2["reference_shards"], full_state(store)) == []


def test_a_rank_killed_mid_save_leaves_no_complete_json_and_the_restart_resumes_the_previous_bitwise(fsdp2, tmp_path):
    """SIGKILL of rank 1 inside the sharded save of step 6 (its shard written, its rank file pausing 1 s): rank 0
    fails the commit at once (exit 1, no hang), step 6 has no COMPLETE.json, and the restart resumes step 3 and
    ends with the uninterrupted run's bytes (the leftover shard of the killed attempt stays beside the new one)."""
    store = tmp_path / "killed"
    proc = start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET), "--checkpoint-every", "3",
                       env={"TPHOOK_SAVE_DELAY": "3.0"})  # test-only: each rank's save pauses 3 s
    lines: list[str] = []
    pids = rank_pids(proc, lines)
    read_until(proc, lambda e: e.get("event") == "checkpoint_begin" and e["step"] == 6, lines)
    part = store / "step-00000006" / rank_file(1)
    deadline = time.monotonic() + budget(60)
    while not part.exists():  # rank 1 wrote its shard and rank file, and sleeps before handing it over
        assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never wrote its part of step 6"
        time.sleep(0.01)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    result = finish(proc, timeout=budget(120))
    assert time.monotonic() - t0 < budget(30), "rank 0 must give up at once (peer gone)"
    assert result.code == 1 and result.last("world_exit")["codes"] == [1, -signal.SIGKILL], result.stderr[-2000:]
    assert not (store / "step-00000006" / "COMPLETE.json").exists()
    assert [g.step for g in open_store(str(store)).scan() if g.status == "complete"] == [3]
    restart = finish(start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert restart.code == 0 and restart.last("resume")["step"] == 3, restart.stderr[-2000:]
    assert differences(fsdp2["reference"], trajectory(load_world_state(store))) == []
    assert shard_digests(store, TARGET) == shard_digests(fsdp2["dir"] / "cont", TARGET)


def test_a_corrupt_shard_is_quarantined_and_the_previous_generation_resumed_to_the_same_end(fsdp2, tmp_path):
    """One flipped byte in rank 1's shard of the newest generation: DCP tells every rank, rank 0 quarantines it
    (one warning naming the file), every rank falls back to the generation before, and the run retrains the
    lost steps to the very bytes of the uninterrupted run."""
    store = tmp_path / "flipped"
    shutil.copytree(fsdp2["dir"] / "cont", store)
    complete = [g.step for g in open_store(str(store)).scan() if g.status == "complete"]
    assert complete[-1] == TARGET and len(complete) >= 2, complete
    shard = store / f"step-{TARGET:08d}" / "shard-00001.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))

    result = finish(start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert result.code == 0, result.stderr[-3000:]
    assert result.last("resume")["step"] == complete[-2]  # the generation before the corrupt one
    assert f"skipping step-{TARGET:08d} (corrupt)" in result.stderr and "shard-00001.distcp" in result.stderr
    quarantined = open_store(str(store)).quarantined()
    assert [folder.split("-")[1] for folder, _reason in quarantined] == [f"{TARGET:08d}"]
    assert "shard-00001.distcp" in quarantined[0][1]
    assert shard_digests(store, TARGET) == shard_digests(fsdp2["dir"] / "cont", TARGET)  # retrained: same bytes
    assert differences(fsdp2["reference"], trajectory(load_world_state(store))) == []


def test_when_every_generation_has_a_corrupt_shard_the_run_stops_instead_of_starting_fresh(fsdp2, tmp_path):
    """A failed load may already have copied verified parts into the model: no fresh start from those tensors.
    Every generation is quarantined (kept), every rank exits 1 with the reason, and nothing is committed."""
    store = tmp_path / "all-flipped"
    shutil.copytree(fsdp2["dir"] / "cont", store)
    complete = [g.step for g in open_store(str(store)).scan() if g.status == "complete"]
    for step in complete:
        shard = store / f"step-{step:08d}" / "shard-00001.distcp"
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0x01
        shard.chmod(0o644)
        shard.write_bytes(bytes(raw))
    result = finish(start_world(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET)), timeout=budget(300))
    assert result.code == 1 and result.last("world_exit")["codes"] == [1, 1], result.stderr[-3000:]
    assert f"had a corrupt shard file (quarantined, the last step-{complete[0]:08d})" in result.stderr
    assert "run it again to start from step 0" in result.stderr
    assert sorted(int(f.split("-")[1]) for f, _ in open_store(str(store)).quarantined()) == complete
    assert open_store(str(store)).scan() == []


def test_two_rank_shards_reshard_into_one_process_exactly(fsdp2, tmp_path):
    store = tmp_path / "one"
    shutil.copytree(fsdp2["dir"] / "cont", store)
    dumped = tmp_path / "loaded.pt"
    result = run(store, *FSDP, *fsdp2["common"], "--max-steps", str(TARGET + 2), "--allow-world-change",
                 env={"TPHOOK_DUMP_LOADED": str(dumped)})
    assert result.code == 0, result.stderr
    assert result.last("resume")["world_change"] == {"step": TARGET, "from": 2, "to": 1}
    loaded = torch.load(dumped, weights_only=True)  # what the one process held right after loading the shards
    assert differences(fsdp2["reference_shards"], loaded) == []
    assert len([k for k, v in loaded.items() if isinstance(v, torch.Tensor)]) == 16  # 4 params, 3 Adam tensors each
    state = load_world_state(store)
    assert state["meta"]["world"] == 1 and state["meta"]["world_changes"] == [{"step": TARGET, "from": 2, "to": 1}]
    assert [r["step"] for r in history_rows(state)] == list(range(1, TARGET + 3))
    info = open_store(str(store)).generation(TARGET + 2)
    assert info.manifest["world"] == 1 and info.manifest["extra"]["sharded"]["shards"] == ["shard-00000.distcp"]


def test_a_sharded_deadline_run_exports_its_gathered_model_before_the_deadline(fsdp2, tmp_path):
    """``--deadline`` with ``--fsdp`` on 2 ranks: the last generation is committed, then exported (the model gathered
    from its shards, the files written tensor by tensor) and reload-checked, before the deadline; every rank exits 0."""
    from safetensors.torch import load

    store = tmp_path / "run"
    started = startup_s(tmp_path / "probe")  # of one process: two ranks on these cores start slower, hence 6 x
    seconds = round(30 + 6 * started)
    result = finish(start_world(store, *FSDP, *fsdp2["common"], "--max-steps", "1000000", "--deadline",
                                f"{seconds}s", env={"TPHOOK_STEP_DELAY": "0.05"}), timeout=budget(300))
    assert result.code == 0, result.stderr[-3000:]
    record = json.loads((store / "deadline.json").read_text())
    assert time.time() <= datetime.fromisoformat(record["at"]).timestamp() + budget(5)  # ended by it
    done = result.last("done")
    assert done["reason"] == "deadline" and done["export"]["ok"], done
    step = done["step"]
    bundle = store / "exports" / f"step-{step:08d}"
    weights = load((bundle / "model.safetensors").read_bytes())
    gathered = {k.removeprefix("model."): v for k, v in full_state(store, step).items() if k.startswith("model.")}
    assert weights.keys() == gathered.keys() and all(torch.equal(weights[k], gathered[k]) for k in weights)
    check = json.loads((store / "exports" / f"step-{step:08d}.reload-check.json").read_text())
    assert check["passed"] and check["step"] == step


# -- export and reads of a sharded run (copies of the module's runs: the tests write exports into them) ----------
@pytest.fixture(scope="module")
def runs(fsdp2, tmp_path_factory):
    """``fsdp``: the continuous sharded run; ``ddp``: the same run under DDP (copies)."""
    d = tmp_path_factory.mktemp("export-fsdp")
    for name, src in (("fsdp", "cont"), ("ddp", "ddp")):
        shutil.copytree(fsdp2["dir"] / src, d / name)
    return d


def test_a_sharded_run_exports_the_weights_of_the_same_run_under_ddp(runs):
    result = trainproof("export", "--store", str(runs / "fsdp"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reload check (mse)" in result.stdout and "passed" in result.stdout
    ddp_bundle = export(open_store(str(runs / "ddp")), task="regression")  # in this process: the same function
    from safetensors.torch import load

    sharded = open_store(str(runs / "fsdp" / "exports")).load(TARGET).files
    replicated = ddp_bundle.dest.load(TARGET).files
    weights = load(sharded[FP_FILE])
    assert differences(weights, load(replicated[FP_FILE])) == []  # bit for bit
    assert differences(weights, load_world_state(runs / "ddp")["model"]) == []
    gathered = gather(open_store(str(runs / "fsdp")), TARGET, load_world_state(runs / "fsdp"))
    assert differences(weights, gathered["model"]) == []
    metrics = [json.loads(files["metrics.json"])["eval"] for files in (sharded, replicated)]
    assert metrics[0]["value"] == metrics[1]["value"] and metrics[0]["value_bf16"] == metrics[1]["value_bf16"]
    # and the Adam state gathered from the shards is the DDP run's (keyed by name there, by index under DDP)
    ddp = load_world_state(runs / "ddp")
    for i, name in enumerate(gathered["model"]):
        assert differences(gathered["optimizer"]["state"][name], ddp["optimizer"]["state"][i]) == [], name


def test_the_weights_alone_are_read_without_allocating_the_optimizer(runs, monkeypatch):
    """What an export asks for (``optimizer=False``): the same model tensors, an empty optimizer, and not one
    optimizer tensor allocated (every target DCP fills is allocated by full_state, counted here)."""
    import trainproof.train.fsdp as fsdp_module

    s = open_store(str(runs / "fsdp"))
    state = load_world_state(runs / "fsdp")
    allocated: list[tuple[int, ...]] = []
    empty = torch.empty
    monkeypatch.setattr(fsdp_module.torch, "empty",
                        lambda size, **kw: allocated.append(tuple(size)) or empty(size, **kw))
    both = complete_state(s, TARGET, state)
    n_both = len(allocated)
    allocated.clear()
    weights = complete_state(s, TARGET, state, optimizer=False)
    assert weights["optimizer"] == {} and differences(weights["model"], both["model"]) == []
    assert len(allocated) == len(both["model"]) < n_both  # one target per model tensor, none for Adam's moments


def _tamper(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("exports"))  # a bundle an earlier test made
    path = dst / f"step-{TARGET:08d}" / name
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("name", ["shard-00001.distcp", "dcp.metadata"])
def test_a_changed_byte_in_a_shard_fails_the_verifiers_read_naming_the_file(runs, tmp_path, name):
    store = _tamper(runs / "fsdp", tmp_path / "run", name)
    good = RunReader("good", str(runs / "fsdp"), open_store).state(TARGET)
    with pytest.raises(ShardedLoadError) as caught:  # the metadata when the shards are opened, a shard when compared
        compare_all(good, {"tampered": RunReader("tampered", str(store), open_store).state(TARGET)}, Tolerance(),
                    frozenset(good[SECTIONS].entries))
    assert caught.value.corrupt and name in str(caught.value)
    assert isinstance(caught.value, TrainError)  # verify: "verification incomplete", exit 2; never a pass


def test_export_of_a_tampered_sharded_run_fails_and_commits_nothing(runs, tmp_path):
    store = _tamper(runs / "fsdp", tmp_path / "run", "shard-00000.distcp")
    result = trainproof("export", "--store", str(store))
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "shard-00000.distcp" in result.stderr
    assert not (store / "exports").exists() or not any((store / "exports").glob("step-*/COMPLETE.json"))


def test_a_replicated_state_is_returned_as_it_is(runs):
    s = open_store(str(runs / "ddp"))
    state = decode_generation(s.load(TARGET).files)
    assert complete_state(s, TARGET, state) is state


# -- cheap checks --------------------------------------------------------------------------------------------

def _plan(fsdp: bool = False):
    from trainproof.format.layout import Layout

    return build_plan(task="regression", task_config={}, data_identity="d" * 64, seed=1, world=2,
                      objective="mse_mean_v1", code_version="test", layout=Layout.choose(world=2, fsdp=fsdp))


def test_fsdp_is_part_of_the_plan_and_a_switch_is_refused_by_name():
    ddp, sharded = _plan(), _plan(fsdp=True)
    assert "fsdp" not in ddp and sharded["fsdp"] is True
    assert ddp["contract"] != sharded["contract"]
    for stored, now, words in ((sharded, ddp, "fsdp (stored True, now False)"),
                               (ddp, sharded, "fsdp (stored False, now True)")):
        with pytest.raises(ContractError, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_plan(stored, now, where="memory://run")
    check_plan(sharded, _plan(fsdp=True), where="memory://run")  # the same run: accepted


def test_a_replicated_run_keeps_its_contract():
    # The field enters the hash only when set: every existing (DDP) run's contract is unchanged.
    from trainproof.format.contract import canonical_json, sha256_hex

    plan = _plan()
    fields = {k: plan[k] for k in ("config_sha256", "state_schema", "data_identity", "world", "objective", "seed")}
    assert plan["contract"] == sha256_hex(canonical_json(fields))


def test_the_layout_is_recorded_and_a_plan_from_before_layouts_still_reads():
    from trainproof.format.contract import contract_of
    from trainproof.format.layout import Layout, sharded

    new = _plan(fsdp=True)
    assert new["layout"] == {"name": "fully_sharded", "dp_replicate": 1, "dp_shard": 2}
    assert _plan()["layout"] == {"name": "replicated", "dp_replicate": 2, "dp_shard": 1}
    old = {k: v for k, v in new.items() if k != "layout"}  # what plan.json held before layouts were recorded
    assert sharded(old) and sharded(new) and not sharded(_plan()) and not sharded({})
    assert contract_of(old) == contract_of(new) == new["contract"]
    check_plan(old, _plan(fsdp=True), where="memory://run")  # an old sharded run resumes under this code
    with pytest.raises(ContractError, match=r"fsdp \(stored True, now False\)"):
        check_plan(old, _plan(), where="memory://run")
    with pytest.raises(ConfigError, match="hybrid sharding"):
        Layout(world=4, dp_shard=2, sharded=True)
    assert Layout.choose(world=4, fsdp=False).dp_replicate == 4


def test_train_help_names_the_flag():
    from typer.testing import CliRunner

    import trainproof.cli.train  # noqa: F401 - registers the command
    from trainproof.cli.app import app

    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--fsdp" in result.output and "FSDP2" in result.output
