"""Signed runs with real processes: planted generations are skipped on resume, and the verifier, the audit and
the export work on a signed run over S3 without any secret reaching a log line or a stored object.

Planted generations are made as an attacker with write access to the bucket (and, for the fork, a key holder's
abandoned branch) would make them: by running the real trainer in a copy of the run, then copying the resulting
step folder into the run byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from trainproof.storage.signing import key_id
from tests.support.timing import budget
from tests.test_train_helpers import ROOT, kept_differences, load_state, run, train_env

KEY = "tp-signing-key-9f1c2e7d5b3a"
OTHER = "tp-other-key-0a1b2c3d4e5f"
SIGNED = {"TRAINPROOF_SIGNING_KEY": KEY}


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """The reference: a signed run, 20 steps, checkpoints every 5."""
    store = tmp_path_factory.mktemp("untouched") / "run"
    result = run(store, "--max-steps", "20", "--checkpoint-every", "5", env=SIGNED)
    assert result.code == 0, result.stderr
    return _state(store)


def _state(store):
    # Loaded without a key: the state itself, whatever the signature (the tests check signing elsewhere); the default
    # --keep 3 deleted the oldest generations, so its history reaches back as far as the kept ones.
    return load_state(store, history="kept")


def _chain_like(store, planted: dict, *, signature: bool) -> dict:
    """A keyless forger's best: the planted manifest with this run's anchor and a predecessor that fits (both
    computable from the bucket's bytes), and, when ``signature``, a signature block copied from a genuine
    manifest. Only the MAC can then tell it apart."""
    genuine_raw = (store / "step-00000015" / "COMPLETE.json").read_bytes()
    genuine = json.loads(genuine_raw)
    forged = {k: v for k, v in planted.items() if k != "signature"}
    forged.update(anchor=genuine["anchor"], predecessor=hashlib.sha256(genuine_raw).hexdigest(), predecessor_step=15)
    return {**forged, "signature": genuine["signature"]} if signature else forged


@pytest.mark.parametrize("case", [pytest.param("unsigned", marks=pytest.mark.slow), "forged", pytest.param("other-key", marks=pytest.mark.slow),
                                  pytest.param("out-of-chain", marks=pytest.mark.slow)])
def test_a_planted_generation_is_skipped_and_the_run_reaches_the_untouched_state(tmp_path, untouched, case):
    store, copy = tmp_path / "run", tmp_path / "copy"
    assert run(store, "--max-steps", "10", "--checkpoint-every", "5", env=SIGNED).code == 0
    shutil.copytree(store, copy)  # the run as it was at step 10 (same plan.json, same chain)
    assert run(store, "--max-steps", "15", "--checkpoint-every", "5", env=SIGNED).code == 0
    env = {"unsigned": {}, "forged": {},
           "other-key": {"TRAINPROOF_SIGNING_KEY": OTHER, "TRAINPROOF_SIGNING_KEYS_ACCEPTED": KEY},
           "out-of-chain": SIGNED}[case]  # the fork: a key holder's branch from step 10 (step 15 continued it)
    made = run(copy, "--max-steps", "18", "--checkpoint-every", "9", env=env)
    assert made.code == 0, made.stderr
    shutil.copytree(copy / "step-00000018", store / "step-00000018")
    if case in ("unsigned", "forged"):
        marker = store / "step-00000018" / "COMPLETE.json"
        marker.write_text(json.dumps(_chain_like(store, json.loads(marker.read_text()), signature=case == "forged")))
    result = run(store, "--max-steps", "20", "--checkpoint-every", "5", env=SIGNED)
    assert result.code == 0, result.stderr
    assert result.last("resume")["step"] == 15, result.events
    assert len([l for l in result.stderr.splitlines() if "step-00000018" in l and "foreign" in l]) >= 1, result.stderr
    assert kept_differences(untouched, _state(store)) == []
    assert (store / "step-00000018" / "COMPLETE.json").exists()  # evidence: never deleted


def test_an_unsigned_plan_is_refused_with_a_key(tmp_path):
    store = tmp_path / "run"
    assert run(store, "--max-steps", "2").code == 0  # unsigned run
    result = run(store, "--max-steps", "4", env=SIGNED)
    assert result.code == 2 and "plan.json" in result.stderr and "unsigned" in result.stderr, result.stderr


def _job(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=ROOT, env=train_env(env), text=True,
                          capture_output=True, timeout=budget(900))


@pytest.mark.slow
def test_verify_audit_and_export_on_a_signed_s3_run_leak_no_secret(s3_env, s3_server, tmp_path):
    access, secret = "AKIATESTSECRET123456", "tpSecretAccessKey/Zq8wX3vB7nM2kL5pR9tY1uI4oE6a"
    env = {**SIGNED, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_ENDPOINT_URL": s3_server.endpoint}
    url = f"s3://{s3_env}/runs/signed"
    logs = []
    trained = run(url, "--max-steps", "10", "--checkpoint-every", "5", env=env)
    assert trained.code == 0, trained.stderr
    logs += [json.dumps(trained.events), trained.stderr]
    for args in (("verify", "--store", url, "--no-export"), ("verify", "--store", url, "--audit"),
                 ("export", "--store", url)):
        done = _job(*args, env=env)
        logs += [done.stdout, done.stderr]
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint, aws_access_key_id=access,
                      aws_secret_access_key=secret, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_env)
            for o in page.get("Contents", [])]
    assert any(k.endswith("exports/step-00000010/COMPLETE.json") for k in keys), keys
    assert any("/verification/" in k and k.endswith("verification.json") for k in keys), keys
    stored = {k: s3.get_object(Bucket=s3_env, Key=k)["Body"].read() for k in keys}
    for k, data in stored.items():  # every object: JSON files, states, the export bundle
        for value in (KEY, secret, access):
            assert value.encode() not in data, (k, "holds a secret")
    for text in logs:
        for value in (KEY, secret):
            assert value not in text
    for k, data in stored.items():  # and every generation, plan and export manifest is signed
        if k.endswith("COMPLETE.json") or k.endswith("/plan.json"):
            assert json.loads(data)["signature"]["alg"] == "hmac-sha256", k


def test_key_rotation_in_a_real_run(tmp_path, untouched):
    """Old key signs 5 and 10; the new key (old one accepted) resumes from 10 and signs 15 and 20, reaching the
    untouched state. Dropping the old key afterwards makes the plan.json it signed a contract error (exit 2):
    a person decides (SECURITY.md, rotation)."""
    store = tmp_path / "run"
    assert run(store, "--max-steps", "10", "--checkpoint-every", "5", env={"TRAINPROOF_SIGNING_KEY": OTHER}).code == 0
    rotated = run(store, "--max-steps", "20", "--checkpoint-every", "5",
                  env={"TRAINPROOF_SIGNING_KEY": KEY, "TRAINPROOF_SIGNING_KEYS_ACCEPTED": OTHER})
    assert rotated.code == 0, rotated.stderr
    assert rotated.last("resume")["step"] == 10
    assert kept_differences(untouched, _state(store)) == []
    signers = {step: json.loads((store / f"step-{step:08d}" / "COMPLETE.json").read_text())["signature"]["key_id"]
               for step in (5, 10, 15, 20) if (store / f"step-{step:08d}").exists()}
    assert signers[20] == key_id(KEY.encode()) and signers.get(10, key_id(OTHER.encode())) == key_id(OTHER.encode())
    dropped = run(store, "--max-steps", "25", env=SIGNED)
    assert dropped.code == 2 and "not accepted" in dropped.stderr, dropped.stderr
