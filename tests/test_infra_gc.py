"""The clean-up CronJob of verification data (infra/k8s/base/verify-gc-cronjob.yaml): it keeps the N newest
verifications of the same run the training Job writes and the audit CronJob checks, and passes the same
locked-down pod checks as every other workload (tests/test_infra.py renders and checks every pod)."""

from __future__ import annotations

from tests.test_infra import _train_container, only, rendered  # noqa: F401  (rendered: a fixture)


def test_verification_gc_cronjob_keeps_the_newest_verifications_of_the_run(rendered):  # noqa: F811
    cron = only(rendered["base"], "CronJob", "trainproof-verify-gc")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "gc" and int(args[args.index("--keep-verifications") + 1]) >= 1 and "--keep" not in args
    assert args[args.index("--store") + 1] == _train_container(only(rendered["base"], "Job"))["args"][2]
    audit = only(rendered["base"], "CronJob", "trainproof-verify")
    assert audit["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["verify", "--audit"]
