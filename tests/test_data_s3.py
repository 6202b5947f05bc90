"""A dataset in the bucket, over S3 on loopback (the suite's S3 server, ``s3_env``): packed with ``trainproof data
pack``, trained on by ``examples/tokenlm.py`` with DataLoader workers reading every part through the store layer
(ranged GETs, verified, cached), checkpoints in the same bucket, resumed and verified; a flipped byte in a shard is
refused by name and a missing shard is a one-line error (exit 1: stored content the operator can restore).

The default test packs a small dataset; the slow one packs 256 MiB in 64 shards (``TRAINPROOF_SLOW=1``).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainproof.data import ShardedDataset, pack_records, token_windows
from trainproof.errors import DataError
from trainproof.storage import open_store
from trainproof.storage.backend import join
from tests.support.timing import budget
from tests.test_examples import final_state, without_invocation
from tests.test_train_helpers import differences, finish, parse_events, start
from tests.test_verify_helpers import HOOKED, checks, cli, read_report, trainproof  # noqa: F401  (cli)

pytestmark = pytest.mark.s3
TASK = "examples.tokenlm:factory"
MODEL = {"context": 16, "eval_windows": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "batch_size": 16,
         "micro_batch_size": 8}


def _config(tmp_path: Path, dataset: str) -> str:
    path = tmp_path / "lm.json"
    path.write_text(json.dumps({**MODEL, "dataset": dataset}))
    return str(path)


def test_a_bucket_dataset_trains_with_workers_resumes_and_verifies_on_s3(cli, s3_env, tmp_path, monkeypatch):  # noqa: F811
    """Packed from a token file with the CLI into the bucket; the protocol (two DataLoader workers in every path,
    the example's default) passes with the run in the same bucket; the resumed path again, each of its checkpoints
    holding the workers' position instead of the consumed one (TPHOOK_SAVE_PREFETCHED): caught."""
    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", str(tmp_path / "cache"))
    from examples.tokenlm import stdlib_tokens

    np.save(tmp_path / "tokens.npy", stdlib_tokens(11_000))
    dataset = f"s3://{s3_env}/datasets/lm"
    packed = cli("data", "pack", dataset, "--tokens", str(tmp_path / "tokens.npy"), "--context", "16", "--shard-mib",
                 "0.004", "--part-kib", "4")
    assert packed.exit_code == 0, packed.output + packed.stderr
    assert json.loads(packed.stdout)["shards"] == 3

    store = f"s3://{s3_env}/runs/lm"
    common = ("--store", store, "--task", TASK, "--config", _config(tmp_path, dataset), "--cuts", "5", "--no-export",
              "--no-objective-check")
    result = cli("verify", *common, "--id", "ref", "--keep-evidence")
    assert result.exit_code == 0, result.output + result.stderr
    report = read_report(store, "ref")
    assert report["all_checks_passed"] and report["negative_divergence_detected"]
    assert checks(report, "resume")["sample_ids"]["max_abs_diff"] == 0.0

    monkeypatch.setenv("TPHOOK_SAVE_PREFETCHED", "1")  # inherited by the path processes
    monkeypatch.setattr("trainproof.train.launch.ENTRY_MODULE", HOOKED)
    result = cli("verify", *common, "--id", "prefetched", "--reuse-reference", "ref")
    assert result.exit_code == 1, result.output + result.stderr
    caught = read_report(store, "prefetched")
    assert not caught["all_checks_passed"] and "resume.data_position" in caught["failing_checks"]
    assert checks(caught, "resume")["losses"]["within_tolerance"]  # it trained right: what it saved is wrong


def _packed(bucket: str, tmp_path: Path) -> tuple[str, Any]:
    windows = token_windows(np.random.default_rng(3).integers(0, 256, 20_000).astype(np.uint16), 16)
    url = f"s3://{bucket}/datasets/tokens"
    return url, pack_records(url, windows, shard_bytes=16 * 1024, part_bytes=4096)


def test_a_flipped_byte_in_a_shard_on_s3_is_refused_by_name(cli, s3_env, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", str(tmp_path / "cache"))
    url, packed = _packed(s3_env, tmp_path)
    shard = packed.manifest.shards[1].entry
    bucket = open_store(url)
    data = bytearray(bucket.read_file(shard.name))
    data[4096 + 7] ^= 0x20  # part 2
    bucket.write_file(shard.name, bytes(data))  # same size: only the part's digest can tell
    dataset = ShardedDataset(url)
    first = packed.manifest.shards[0].samples
    with pytest.raises(DataError, match=f"shard {shard.name} part 2/4 \\(bytes 4096..8192\\) does not match"):
        dataset[first + 4096 // 34 + 1]
    result = cli("data", "verify", url)
    assert result.exit_code == 1 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error")]
    assert len(errors) == 1 and f"shard {shard.name} part 2/4" in errors[0]  # after a warning that it read it twice


def test_a_missing_shard_on_s3_is_a_one_line_error(cli, s3_env, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", str(tmp_path / "cache"))
    url, packed = _packed(s3_env, tmp_path)
    shard = packed.manifest.shards[2].entry.name
    bucket = open_store(url)
    bucket.backend.delete(join(bucket.root, shard))
    result = cli("train", "--store", f"s3://{s3_env}/runs/x", "--task", TASK, "--config",
                 _config(tmp_path, url))
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert result.exit_code == 1 and errors == [
        f"trainproof: error: dataset {url}: shard {shard} is missing (dataset.json lists it): restore it or pack the "
        "dataset again"]


@pytest.mark.slow
def test_a_256_mib_dataset_in_64_shards_trains_resumes_and_verifies_on_s3(s3_env, tmp_path):
    """256 MiB of token windows in 64 shards of 4 MiB (1 MiB parts): packed, read back whole by ``data verify``,
    trained on with two workers, SIGTERMed mid-run and resumed with four, bitwise equal to an uninterrupted run; then
    the protocol passes on it."""
    env = {"TRAINPROOF_DATA_CACHE": str(tmp_path / "cache")}
    dataset = f"s3://{s3_env}/datasets/big"
    packed = trainproof("data", "pack", dataset, "--tokens", str(_tokens_file(tmp_path, 256)), "--context", "16",
                        "--shard-mib", "4", env=env)
    assert packed.returncode == 0, packed.stderr
    info = json.loads(packed.stdout)
    assert info["shards"] >= 64 and info["bytes"] >= 256 * 2**20 - 34
    verified = trainproof("data", "verify", dataset, env=env)
    assert verified.returncode == 0 and json.loads(verified.stdout)["bytes_read"] == info["bytes"], verified.stderr

    config = _config(tmp_path, dataset)
    args = ("--task", TASK, "--config", config, "--max-steps", "30")
    reference = finish(start(f"s3://{s3_env}/runs/ref", *args, "--data-workers", "0", env=env), timeout=budget(600))
    assert reference.code == 0, reference.stderr
    victim = start(f"s3://{s3_env}/runs/cut", *args, "--data-workers", "2", env={**env, "TPHOOK_STEP_DELAY": "0.2"})
    seen = []
    while not any(e.get("event") == "step" and e["step"] >= 10 for e in parse_events("".join(seen))):
        line = victim.stdout.readline()
        assert line, victim.stderr.read()
        seen.append(line)
    victim.send_signal(signal.SIGTERM)
    stopped = finish(victim, timeout=budget(300))
    assert stopped.code == 75, stopped.stderr
    resumed = finish(start(f"s3://{s3_env}/runs/cut", *args, "--data-workers", "4", env=env), timeout=budget(600))
    assert resumed.code == 0, resumed.stderr
    expected, got = final_state(f"s3://{s3_env}/runs/ref"), final_state(f"s3://{s3_env}/runs/cut")
    assert differences(without_invocation(expected), without_invocation(got)) == []

    store = f"s3://{s3_env}/runs/verify"
    result = trainproof("verify", "--store", store, "--task", TASK, "--config", config, "--cuts", "5", "--no-export",
                        "--no-objective-check", "--id", "big", env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert read_report(store, "big")["all_checks_passed"]


def _tokens_file(tmp_path: Path, mib: int) -> Path:
    from examples.tokenlm import stdlib_tokens

    path = tmp_path / "tokens.npy"
    np.save(path, stdlib_tokens(mib * 2**20 + 2 * 17))
    return path
