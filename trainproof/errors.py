"""The training side's few domain exceptions, each carrying the exit code the CLI maps it to.

Exit codes are part of the contract (README, "Exit codes"): 2 means "retrying cannot help" (usage, configuration,
contract), 1 means "any other failure" (a Kubernetes Job retries it and counts the retry), damaged stored data
included (DataError).
"""

from __future__ import annotations


class TrainError(Exception):
    """A handled failure: the CLI prints its message as one line and exits with ``exit_code``."""

    exit_code = 1


class ConfigError(TrainError):
    """Bad option, config file or task specification (exit 2)."""

    exit_code = 2


class ContractError(TrainError):
    """The run's identity (plan.json / contract) does not match this invocation (exit 2)."""

    exit_code = 2


class StateError(TrainError):
    """A training state that is malformed, unsafe (pickled objects) or inconsistent with this run (exit 2).

    Raised by the loader instead of silently re-initialising whatever is missing.
    """

    exit_code = 2


class DataError(TrainError):
    """Stored data is not what its digest says (a damaged, missing or resized shard of a bucket dataset, pretrained
    weights that do not hash to the declared sha256, a sample that cannot be built): exit 1. It is stored content,
    not the operator's flags: a co-tenant of the bucket can damage it and the operator can restore it, so the Job
    retries (counted against backoffLimit, so lasting damage still ends it) and a restored object lets it go on.
    Not 75: that exit is "resume me" and is not counted, so a shard damaged for good would restart the run forever."""

    exit_code = 1
