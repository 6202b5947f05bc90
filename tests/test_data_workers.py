"""Batches built ahead by DataLoader workers, resumed exactly (trainproof.train.pipeline), through real trainer processes.

``examples/tokenlm.py`` on a small packed dataset in a folder (windows of 17 tokens read through the verified part
cache, per-window input noise drawn from each window's own generator, dropout in the model):

- the same run with 0, 2 and 4 workers ends in identical states, under one contract;
- SIGTERMs at random steps with batches in flight: each stop exits 75 with its workers stopped (none left running),
  resumes with another worker count, and the run ends in the same state as the uninterrupted one; the same with the
  checkpoint taken from the workers' position (the negative control, TPHOOK_SAVE_PREFETCHED) ends elsewhere;
- ``verify`` catches the prefetched position saved at the cut (slow; tests/test_data_s3.py verifies with workers on
  S3 and catches it in the resumed path's checkpoints by default);
- a damaged shard read by a worker ends the run with one line naming it (exit 1), and so does a shard missing or
  resized at start-up, before any step; one damaged mid-run is met while the next step's micro-batches are built,
  so the step reached is committed first, and the retry after the shard is restored ends as the uninterrupted run; workers asked of a task that
  cannot use them is exit 2 before anything is written.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trainproof.train.data import EpochSampler
from trainproof.train.pipeline import Lookahead, micro_batches, next_step_micro_batches
from trainproof.train.rng import data_generator
from tests.support.timing import budget
from tests.test_examples import final_state, without_invocation
from tests.test_train_helpers import ROOT, differences, entry_module, finish, parse_events, start, train_cmd, train_env
from tests.test_verify_helpers import read_report

TASK = "examples.tokenlm:factory"
TARGET = 24  # 319 training windows in batches of 16: 20 steps an epoch, the last a tail of 15


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict[str, Any]:
    """The example's tokens packed into a folder (327 windows of 17 tokens in 3 shards of 2 parts), and its task
    settings (the last 8 windows held out)."""
    from examples.tokenlm import pack

    root = tmp_path_factory.mktemp("tokens")
    url = str(root / "dataset")
    identity = pack(url, context=16, mib=0.01, shard_mib=0.004, part_kib=4)
    config = root / "lm.json"
    config.write_text(json.dumps({"dataset": url, "context": 16, "eval_windows": 8, "d_model": 16, "n_heads": 2,
                                  "n_layers": 1, "d_ff": 32, "batch_size": 16, "micro_batch_size": 8}))
    return {"url": url, "identity": identity, "config": str(config), "cache": str(root / "cache")}


def train(store: Path, dataset: dict[str, Any], *args: str, env: dict[str, str] | None = None,
          group: bool = False) -> subprocess.Popen:
    """A training process of the example; ``group``: in a process group of its own (its workers join it)."""
    args = ("--task", TASK, "--config", dataset["config"], "--max-steps", str(TARGET), *args)
    env = {"TRAINPROOF_DATA_CACHE": dataset["cache"], **(env or {})}
    if not group:
        return start(store, *args, env=env)
    return subprocess.Popen(train_cmd(store, *args, module=entry_module(env)), cwd=ROOT, env=train_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def stop_at(proc: subprocess.Popen, step: int, *, group: bool = False) -> Any:
    """SIGTERM ``proc`` (its whole process group with ``group``: the workers get it too, as from a terminal's
    Ctrl-C or a shell's kill 0) once it reports ``step`` (the next batches are being built by then); its Result."""
    seen = []
    while True:
        line = proc.stdout.readline()
        assert line, f"the run ended before step {step}: {seen[-3:]} {proc.stderr.read()}"
        seen.append(line)
        if any(e.get("event") == "step" and e["step"] >= step for e in parse_events(line)):
            break
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    result = finish(proc)
    result.events = parse_events("".join(seen)) + result.events
    return result


def processes_of(store: Path) -> list[int]:
    """Live processes whose command line names ``store`` (the trainer and its forked DataLoader workers)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(store).encode() in cmdline and int(pid) != os.getpid():
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def continuous(dataset, tmp_path_factory) -> dict[int, Path]:
    """The uninterrupted run with 0, 2 and 4 workers (one after another: they share two cores)."""
    root = tmp_path_factory.mktemp("continuous")
    stores = {}
    for workers in (0, 2, 4):
        stores[workers] = root / f"w{workers}"
        result = finish(train(stores[workers], dataset, "--data-workers", str(workers)), timeout=budget(300))
        assert result.code == 0, result.stderr
        assert result.last("start")["data_workers"] == workers
    return stores


def test_zero_two_and_four_workers_end_in_identical_states(continuous, dataset):
    states = {w: final_state(store) for w, store in continuous.items()}
    assert states[0]["progress"]["step"] == TARGET and states[0]["ranks"][0]["data"]["epoch"] == 1
    for workers in (2, 4):
        assert differences(without_invocation(states[0]), without_invocation(states[workers])) == [], workers
        assert states[workers]["meta"]["trainer"]["data_workers"] == workers  # recorded per invocation only
    plans = [json.loads((store / "plan.json").read_text()) for store in continuous.values()]
    assert len({p["contract"] for p in plans}) == 1  # the worker count is not part of the contract
    assert plans[0]["data_pipeline"] == {"build": "build_batch", "sample_rng": "trainproof.sample-rng/1"}
    from trainproof.data import ShardedDataset

    packed = ShardedDataset(dataset["url"], cache_dir=dataset["cache"])
    assert packed.data_identity == dataset["identity"]
    assert plans[0]["data_identity"] == packed.take(0, len(packed) - 8).data_identity  # the training windows


def _interrupted(tmp_path: Path, dataset: dict[str, Any], env: dict[str, str] | None = None) -> tuple[Path, list]:
    """Two SIGTERMs at random steps (2 then 4 workers; the second to the whole process group, workers included),
    then the rest with none; the store and the stop steps."""
    store, draw = tmp_path / "run", random.Random()
    first = draw.randint(2, 9)
    second = draw.randint(first + 3, 19)
    env = {"TPHOOK_STEP_DELAY": "0.1", **(env or {})}  # steps long enough for the signal to land mid-run
    stops = []
    for workers, step, group in ((2, first, False), (4, second, True)):
        result = stop_at(train(store, dataset, "--data-workers", str(workers), env=env, group=group), step, group=group)
        stopped = result.last("stopped")
        assert result.code == 75 and stopped["reason"] == "signal", result.stderr
        assert stopped["committed_step"] == stopped["step"] >= step  # the step in flight finished and committed
        shut = result.last("data_workers_stopped")
        assert (shut["workers"], shut["left_running"], shut["step"]) == (workers, 0, stopped["step"])
        assert processes_of(store) == []  # no worker outlived the trainer
        stops.append(stopped["step"])
    last = finish(train(store, dataset, "--data-workers", "0", env=env), timeout=budget(300))
    assert last.code == 0 and last.last("resume")["step"] == stops[-1], last.stderr
    return store, stops


def test_sigterm_at_random_steps_with_batches_in_flight_resumes_bitwise(continuous, dataset, tmp_path):
    store, stops = _interrupted(tmp_path, dataset)
    expected, got = final_state(continuous[0]), final_state(store)
    assert differences(without_invocation(expected), without_invocation(got)) == [], f"stopped at {stops}"
    assert got["meta"]["trainer"]["data_workers"] == 0


@pytest.mark.slow  # the negative control of the test above; verify catches the same bug by default (test_data_s3)
def test_a_checkpoint_of_the_workers_position_instead_of_the_consumed_one_ends_elsewhere(continuous, dataset,
                                                                                          tmp_path):
    """The negative control of the test above: the same stops, each checkpoint holding where the workers had been
    asked to build up to (trainproof.train.pipeline's lookahead) instead of what the trainer consumed."""
    store, stops = _interrupted(tmp_path, dataset, {"TPHOOK_SAVE_PREFETCHED": "1"})
    expected, got = final_state(continuous[0]), final_state(store)
    found = differences(without_invocation(expected), without_invocation(got))
    assert any("sample_ids" in d for d in found), (stops, found[:5])


def test_the_lookahead_asks_for_exactly_what_the_steps_consume():
    """Rank 1 of 2, micro-batches of 3 out of 5 a rank: the lookahead's requests are the steps' own ids, across
    an epoch's tail (37 samples in global batches of 10) and into the next epoch."""
    original = EpochSampler(37, data_generator(7))
    ahead = Lookahead(original, seed=7, first=1, global_batch=10, world=2, rank=1, micro=3)
    requests = iter(ahead)
    consumed = EpochSampler(37, data_generator(7))
    for step in range(1, 10):
        ids = consumed.next_ids(10)
        for micro, chunk in enumerate(micro_batches(ids, 2, 1, 3)):
            request = next(requests)
            assert request.key() == (step, micro, consumed.epoch, tuple(chunk))
    assert consumed.epoch == 2 and ahead.sampler.epoch == 2
    assert (original.permutation, original.cursor) == (None, 0)  # the trainer's own sampler is never advanced


def test_the_next_steps_micro_batch_count_is_known_without_drawing():
    """What the trainer builds ahead of a step (to meet a damaged shard before the step takes anything) is exactly
    the step's micro-batches, across epoch tails, for every rank; the sampler is not advanced by asking."""
    for world, rank, micro in ((1, 0, 4), (2, 0, 3), (2, 1, 3), (3, 2, 2)):
        sampler = EpochSampler(37, data_generator(7))
        for _ in range(12):
            count = next_step_micro_batches(sampler, 5 * world, world, rank, micro)
            assert count == next_step_micro_batches(sampler, 5 * world, world, rank, micro)
            assert count == len(micro_batches(sampler.next_ids(5 * world), world, rank, micro))


def test_a_run_built_without_a_pipeline_trains_as_the_trainers_pipeline_does(dataset, monkeypatch):
    """build_run alone (no batch source given: what benchmarks and embedders use) builds a build_batch task's
    micro-batches in this process under the requests' own generators, exactly as the trainer's pipeline with
    zero workers does; before, it called make_batch, which DatasetTask does not implement."""
    import torch

    from trainproof.tasks import load_task
    from trainproof.train.pipeline import open_batches
    from trainproof.train.run import build_run, train_step

    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", dataset["cache"])
    config = json.loads(Path(dataset["config"]).read_text())
    runs = []
    for pipeline in (False, True):  # one after the other: build_run seeds the process's global generators
        run = build_run(load_task(TASK, config), torch.device("cpu"), 5)
        if pipeline:
            run.batches = open_batches(run.task, run.sampler, seed=5, first=1, world=1, rank=0, workers=0,
                                       prefetch=2, pin_memory=False)
        for _ in range(3):
            train_step(run)
        run.batches.close()
        runs.append(run)
    plain, piped = runs
    for (name, a), b in zip(plain.model.state_dict().items(), piped.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert plain.sampler.cursor == piped.sampler.cursor and plain.step == piped.step == 3


@pytest.mark.slow  # the default suite catches the same bug in the resumed path's checkpoints (test_data_s3)
def test_verify_catches_the_workers_position_saved_at_the_cut(dataset, tmp_path):
    """Every path saving the workers' position: the cut's checkpoint is ahead of what it trained on, so the resumed
    path skips the batches the cut's workers had built and its sample ids differ."""
    from tests.test_verify_helpers import trainproof

    store = str(tmp_path / "verify")
    result = trainproof("verify", "--store", store, "--task", TASK, "--config", dataset["config"], "--cuts", "5",
                        "--no-export", "--no-objective-check", "--id", "bad",
                        env={"TPHOOK_SAVE_PREFETCHED": "1", "TRAINPROOF_DATA_CACHE": dataset["cache"]})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    failing = read_report(store, "bad")["failing_checks"]
    assert {"resume.sample_ids", "resume.losses", "resume.parameters"} <= set(failing)


def test_a_damaged_shard_read_by_a_worker_ends_the_run_with_one_line_naming_it(dataset, tmp_path):
    import shutil

    from trainproof.data import ShardedDataset

    copy = tmp_path / "damaged"
    shutil.copytree(dataset["url"], copy)
    shard = ShardedDataset(str(copy)).manifest.shards[0].entry.name  # windows 0..122: trained on in every epoch
    data = bytearray((copy / shard).read_bytes())
    data[0] ^= 0xFF
    (copy / shard).write_bytes(bytes(data))
    config = json.loads(Path(dataset["config"]).read_text())
    (tmp_path / "lm.json").write_text(json.dumps({**config, "dataset": str(copy)}))
    result = finish(start(tmp_path / "run", "--task", TASK, "--config", str(tmp_path / "lm.json"), "--max-steps", "40",
                          "--data-workers", "2", env={"TRAINPROOF_DATA_CACHE": str(tmp_path / "cache")}), timeout=budget(300))
    assert result.code == 1, result.stderr  # stored content the operator can restore: a retry, never exit 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert len(errors) == 1 and f"shard {shard} part 1/" in errors[0] and "does not match its sha256" in errors[0]
    assert "Traceback" not in result.stderr


def damage_mid_run(dataset: dict[str, Any], store: Path, cache: Path, *args: str) -> tuple[Any, str, int]:
    """A run of the example whose first shard is damaged in the folder (and dropped from the cache) once it reports
    step 2, restored after it ended: its Result, the shard's name and the step its error line says is committed."""
    from trainproof.data import ShardedDataset

    shard = Path(dataset["url"]) / ShardedDataset(dataset["url"], cache_dir=str(cache.parent / "probe")).manifest.shards[
        0].entry.name  # windows 0..122: about every step has some
    good = shard.read_bytes()
    proc = train(store, dataset, *args, env={"TRAINPROOF_DATA_CACHE": str(cache)})
    seen: list[str] = []
    try:
        while not any(e.get("event") == "step" and e["step"] >= 2 for e in parse_events("".join(seen))):
            line = proc.stdout.readline()
            assert line, f"the run ended before step 2: {proc.stderr.read()}"
            seen.append(line)
        # damaged in the bucket (a folder here), in one atomic replace: a reader never sees it half-written ...
        damaged = shard.with_name(shard.name + ".damaged")
        damaged.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
        os.replace(damaged, shard)
        for part in cache.glob("*/*"):  # ... and no longer cached: the next read of it fetches the damaged bytes
            if not part.name.startswith("."):
                part.unlink()
        result = finish(proc, timeout=budget(300))
    finally:
        shard.write_bytes(good)  # the module's dataset
    result.events = parse_events("".join(seen)) + result.events
    assert result.code == 1, result.stderr  # stored content the operator can restore: a counted retry, never 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert any(f"shard {shard.name} part 1/" in e and "restore the shard" in e for e in errors), errors
    found = [re.search(r"; step (\d+) \(reached before it\) is committed; a retry resumes from it$", e) for e in errors]
    assert all(found) and len({f.group(1) for f in found if f}) == 1, errors
    committed = int(found[0].group(1)) if found[0] else -1
    assert 2 <= committed < TARGET and result.last("step")["step"] == committed  # no step took the damaged part
    assert (store / f"step-{committed:08d}" / "COMPLETE.json").is_file()
    return result, shard.name, committed


def test_a_shard_damaged_mid_run_is_met_before_its_step_which_commits_the_step_reached_and_exits_1(continuous,
                                                                                                   dataset, tmp_path):
    """The part is found damaged while the next step's micro-batches are built, before the step takes any: the run
    commits the step reached, exits 1 with one line naming the shard, the part and the committed step, and once the
    shard is restored the retry resumes from it and ends exactly as the uninterrupted run."""
    store, cache = tmp_path / "run", tmp_path / "cache"
    result, _, committed = damage_mid_run(dataset, store, cache, "--data-workers", "2")
    assert len([line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]) == 1
    again = finish(train(store, dataset, "--data-workers", "2", env={"TRAINPROOF_DATA_CACHE": str(cache)}),
                   timeout=budget(300))
    assert again.code == 0 and again.last("resume")["step"] == committed, again.stderr
    assert differences(without_invocation(final_state(continuous[2])), without_invocation(final_state(store))) == []


def test_a_shard_damaged_mid_run_on_one_rank_has_every_rank_commit_the_step_reached(dataset, tmp_path):
    """Two ranks: the rank that meets the damage says so at the step boundary's agreement, so both commit the step
    reached and exit 1 (the world's exit 1), each with one line; the retry resumes from that step."""
    store, cache = tmp_path / "run", tmp_path / "cache"
    result, _, committed = damage_mid_run(dataset, store, cache, "--nproc-per-node", "2", "--data-workers", "1")
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert sorted(line.split(": ")[2] for line in errors) == ["rank 0", "rank 1"], errors  # one line a rank
    again = finish(train(store, dataset, "--nproc-per-node", "2", "--data-workers", "1",
                         env={"TRAINPROOF_DATA_CACHE": str(cache)}), timeout=budget(300))
    assert again.code == 0 and again.last("resume")["step"] == committed, again.stderr


def test_a_shard_resized_before_the_first_step_ends_the_run_with_exit_1_naming_it(dataset, tmp_path):
    """Stored content, not the operator's flags: the Job retries (exit 1) and a restored shard lets it go on."""
    import shutil

    from trainproof.data import ShardedDataset

    copy = tmp_path / "resized"
    shutil.copytree(dataset["url"], copy)
    shard = ShardedDataset(str(copy)).manifest.shards[1].entry
    (copy / shard.name).write_bytes((copy / shard.name).read_bytes()[:-1])
    config = json.loads(Path(dataset["config"]).read_text())
    (tmp_path / "lm.json").write_text(json.dumps({**config, "dataset": str(copy)}))
    args = ("--task", TASK, "--config", str(tmp_path / "lm.json"), "--max-steps", "2")
    env = {"TRAINPROOF_DATA_CACHE": str(tmp_path / "cache")}
    result = finish(start(tmp_path / "run", *args, env=env), timeout=budget(300))
    assert result.code == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"trainproof: error: dataset {copy}: shard {shard.name} is {shard.size - 1} bytes, dataset.json says "
        f"{shard.size}: restore it or pack the dataset again"]
    shutil.copy(Path(dataset["url"]) / shard.name, copy / shard.name)  # the operator restores it: the retry goes on
    again = finish(start(tmp_path / "run", *args, env=env), timeout=budget(300))
    assert again.code == 0 and again.last("step")["step"] == 2, again.stderr


def test_workers_for_a_task_that_builds_in_the_training_process_are_refused_before_anything_is_written(tmp_path):
    result = finish(start(tmp_path / "run", "--task", "regression", "--data-workers", "2"))
    assert result.code == 2 and "data workers need a task that implements build_batch" in result.stderr
    assert not (tmp_path / "run" / "plan.json").exists()
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_bucket_dataset_example_of_the_docs_runs_as_written(tmp_path):
    """docs/tasks.md's tokenlm block in one bash script from the repository root, with its folders moved into tmp_path
    and its sizes cut (8 MiB to 0.1, 50 and 100 steps to 6 and 12): the second command resumes with four workers."""
    import re
    import shlex
    import sys

    text = (Path(__file__).resolve().parent.parent / "docs" / "tasks.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "examples.tokenlm" in b)
    script = (block.replace("./datasets/", f"{shlex.quote(str(tmp_path))}/datasets/")
              .replace("./runs/", f"{shlex.quote(str(tmp_path))}/runs/")
              .replace("> lm.json", f"> {shlex.quote(str(tmp_path / 'lm.json'))}")
              .replace("--config lm.json", f"--config {shlex.quote(str(tmp_path / 'lm.json'))}")
              .replace("--mib 8", "--mib 0.1").replace("--max-steps 50", "--max-steps 6")
              .replace("--max-steps 100", "--max-steps 12"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_") and k != "PYTHONPATH"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", TRAINPROOF_LOG_FORMAT="json",
               TRAINPROOF_DATA_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=Path(__file__).resolve().parent.parent,
                            env=env, text=True, capture_output=True, timeout=budget(600))
    assert result.returncode == 0, result.stderr[-3000:]
    starts = [e for e in parse_events(result.stdout) if e.get("event") == "start"]
    assert [(e["step"], e["data_workers"]) for e in starts] == [(0, 2), (6, 4)]
    assert final_state(tmp_path / "runs" / "lm")["progress"]["step"] == 12


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_data_worker_killed_mid_run_ends_the_run_with_one_line(dataset, tmp_path):
    """SIGKILL to one worker (what the kernel's OOM killer does): DataLoader notices in the training process, which
    ends with exit 1 (a restart resumes from the last commit) and one line naming the worker, not a traceback."""
    proc = train(tmp_path / "run", dataset, "--data-workers", "2", env={"TPHOOK_STEP_DELAY": "0.3"})
    seen = []
    while not any(e.get("event") == "step" and e["step"] >= 2 for e in parse_events("".join(seen))):
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        seen.append(line)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    result = finish(proc)
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert result.code == 1 and len(errors) == 1, result.stderr[-2000:]
    # Worded by DataLoader's SIGCHLD handler or by the step that found the worker gone, whichever saw it first
    assert "a data worker died: DataLoader worker (pid" in errors[0] and str(workers[0]) in errors[0], errors
    assert "Traceback" not in result.stderr and processes_of(tmp_path / "run") == []


@pytest.mark.slow  # two launches of two ranks; the lookahead's per-rank requests are checked by default (above)
def test_two_ranks_with_workers_end_as_two_ranks_without(dataset, tmp_path):
    """Two ranks (DDP on gloo), each with two workers building only its own micro-batches of every step, end in the
    state two ranks reach building them in their own processes."""
    runs = {w: finish(train(tmp_path / f"w{w}", dataset, "--nproc-per-node", "2", "--data-workers", str(w)),
                      timeout=budget(600)) for w in (0, 2)}
    assert [r.code for r in runs.values()] == [0, 0], [r.stderr[-2000:] for r in runs.values()]
    a, b = (final_state(tmp_path / f"w{w}") for w in (0, 2))
    assert a["meta"]["world"] == 2 and differences(without_invocation(a), without_invocation(b)) == []


class _Stuck:
    """A task whose batches never come from a worker (as a worker deadlocked at its fork): build_batch blocks."""

    builds_batches = True

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def build_batch(self, request):
        import os
        import time

        while os.getppid() != 1:  # until the trainer is gone (a deadlocked worker would never return at all)
            time.sleep(0.1)
        return self.task.build_batch(request)


def test_a_worker_that_delivers_nothing_ends_the_run_with_a_line_not_a_hang(dataset, monkeypatch):
    """A stuck worker (one deadlocked at its fork never delivers): after WORKER_TIMEOUT_S the next batch fails with
    one line (exit 1: the retry starts fresh workers), instead of the trainer waiting forever."""
    import torch

    from trainproof.errors import TrainError
    from trainproof.tasks import load_task
    from trainproof.train import pipeline
    from trainproof.train.run import build_run

    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", dataset["cache"])
    monkeypatch.setattr(pipeline, "WORKER_TIMEOUT_S", 2.0)
    run = build_run(load_task(TASK, json.loads(Path(dataset["config"]).read_text())), torch.device("cpu"), 5)
    batches = pipeline.open_batches(_Stuck(run.task), run.sampler, seed=5, first=1, world=1, rank=0, workers=1,
                                    prefetch=1, pin_memory=False)
    try:
        with pytest.raises(TrainError, match="delivered no batch for 2 s"):
            batches.check_next(1)
    finally:
        batches.close()
