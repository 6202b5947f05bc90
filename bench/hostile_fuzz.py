"""The hostile-bucket fuzzer (tests/support/hostile.py), run longer than the test suite does.

    .venv/bin/python bench/hostile_fuzz.py --rounds 40 [--per-round 25] [--seed 1000] [--s3]

Each round copies a genuine run (trained to 6), plants ``--per-round`` mutated generations plus a listing flood,
a LATEST hint, a deadline.json and a bundle, restarts ``train`` and checks that it ends as an untouched run would.
Prints one line per round and a summary (mutations, rounds, classes, failures); exit 1 when any round failed.
``--s3`` runs against a throw-away Ceph RADOS Gateway on loopback (tests/support/rgw.py) instead of a folder.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.hostile import FIRST_PLANT, TARGET, Planter, check_round, copy_run  # noqa: E402
from tests.test_train_helpers import run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--s3", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainproof-fuzz-"))
    base_url = str(work)
    if args.s3:
        from tests.support import rgw
        from tests.support.s3server import dummy_aws_env

        server = rgw.session_server()
        os.environ.update(dummy_aws_env())
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        base_url = f"s3://{server.create_bucket()}/fuzz"
    reference, genuine = work / "reference", work / "genuine"
    assert run(reference, "--max-steps", str(FIRST_PLANT + args.per_round), "--checkpoint-every", "1",
               "--keep", "0").code == 0
    assert run(genuine, "--max-steps", "6", "--checkpoint-every", "2", "--keep", "0").code == 0
    total, failed, classes = 0, [], collections.Counter()
    t0 = time.monotonic()
    for i in range(args.rounds):
        seed = args.seed + i
        url = f"{base_url}/run-{seed}"
        copy_run(genuine, url)
        planted = Planter(url, reference, random.Random(seed), local=not args.s3).round(args.per_round)
        result = run(url, "--max-steps", str(TARGET), "--keep", "0", "--deadline", "2h")
        problems = check_round(url, reference, planted, result)
        total += planted.count
        classes.update(planted.steps.values())
        classes.update(planted.others)
        print(f"round {i + 1}/{args.rounds} seed {seed}: {planted.count} mutations, "
              f"{'ok' if not problems else 'FAILED: ' + problems[0][:300]}", flush=True)
        if problems:
            failed.append((seed, sorted(set(planted.steps.values())), problems))
    print(f"{total} mutations in {args.rounds} rounds ({time.monotonic() - t0:.0f} s, "
          f"{'S3' if args.s3 else 'folder'}), {len(classes)} classes, {len(failed)} failed round(s)")
    for seed, kinds, problems in failed:
        print(f"  seed {seed}: {problems[0][:500]} (planted: {kinds})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
