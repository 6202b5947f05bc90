"""``trainproof verify --world W`` (W > 1): the world-size equivalence check and its negative control.

The four-path protocol proves that a W-rank resume equals the W-rank continuous run (bitwise on the CPU).
This module proves something else: that W ranks train the *same model* as one rank with the same global
batch. It runs three extra ``train`` processes under ``<id>/world_equivalence/``:

- ``one_rank``: one rank, per-rank batch ``W * b`` (the global batch);
- ``w_ranks``: W ranks (trainproof's launcher, gloo on the CPU), per-rank batch ``b``;
- ``per_rank_mean``: the same W ranks with the loss normalised per rank (the mean of per-rank means, the
  variant ``negative_control: per-rank-mean`` of the path's ``train``): the negative control, which must be
  detected.

Why an internal configuration and not the user's task: each rank draws dropout masks and noise from its
own stream (:func:`trainproof.train.dist.rank_seed`), so with per-rank randomness a W-rank run is another, equally
valid, random realisation and cannot be compared with a one-rank run. The check therefore runs on a documented
deterministic configuration (:data:`EQUIVALENCE_CONFIG`): the regression task in float64 with dropout,
gain and noise off, whose epoch ends in a tail of ``W + 1`` rows that the ranks split unevenly (2 + 1 + ...),
so a wrong normalisation changes the objective.

Why a tolerance and not bitwise: the ranks hold other slices of each step than the single process (the
tail is split unevenly), and the gradient all-reduce adds the ranks' sums in the backend's order;
floating-point addition is not associative, so the results may differ in the last bits. In float64 those
differences stay around 1e-12 (tests/test_dist_equivalence.py measured it over 12 steps, tinylm and
regression); :data:`TOLERANCE` (1e-9) leaves three orders of margin, and a real change of the objective
(the negative control) moves them by far more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainproof.format.layout import flag as layout_flag
from trainproof.proof.check import AFTER, Check, Job, Results
from trainproof.proof.equivalence import max_differences, same_experience
from trainproof.proof.paths import Opener, PathResult, RunReader, VerificationIncomplete, job_argv, require_success
from trainproof.train.variant import Variant

TOLERANCE = 1e-9
"""Absolute, float64: measured W vs 1 differences are ~1e-12 (tests/test_dist_equivalence.py)."""
PER_RANK_BATCH = 4
EQUIVALENCE_TASK = "regression"
CHECKS = ("parameters", "optimizer", "losses")
RUNS = ("one_rank", "w_ranks", "per_rank_mean")
REASON = ("not bitwise: the W ranks split each step (and the epoch's tail, unevenly) differently from the one "
          "process, and the gradient all-reduce sums the ranks' contributions in the backend's order; "
          "floating-point addition is not associative. Runs on an internal deterministic configuration "
          "(regression, float64, dropout/gain/noise off) because with per-rank randomness a W-rank run is "
          "another random realisation, not comparable with one rank.")


def equivalence_config(world: int) -> dict[str, Any]:
    """The deterministic regression settings for ``world`` ranks (without ``batch_size``).

    Two full epochs' worth of global batches plus a tail of ``world + 1`` rows: the tail gives the first rank
    two rows and every other rank one, so per-rank and global normalisation differ there.
    """
    return {"rows": 2 * world * PER_RANK_BATCH + world + 1, "dropout": 0.0, "gain": 0.0, "noise": 0.0}


def equivalence_steps(world: int) -> int:
    """Two epochs (each ending in the uneven tail): the check crosses an epoch boundary."""
    return 2 * 3


class WorldEquivalence(Check):
    """The three world-equivalence runs under ``root_url``, started after the protocol's paths were compared."""

    def __init__(self, *, world: int, root_url: str, seed: int, device: str, store_args: list[str], opener: Opener,
                 fsdp: bool = False) -> None:
        self.world, self.root_url, self.seed, self.device = world, root_url.rstrip("/"), seed, device
        self.store_args, self.opener = store_args, opener
        self.fsdp = fsdp
        """Every run sharded (``train --fsdp``), the one-rank reference too: the same state format on both sides."""
        self.urls = {r: f"{self.root_url}/{r}" for r in RUNS}
        self.started = False
        """Whether its runs were started: before, its block of verification.json is null (the verification stopped
        earlier), as is its verdict false."""
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, float]] = {}
        self.same_experience: dict[str, bool] = {}

    def _config_file(self, scratch: Path, name: str, batch: int) -> str:
        path = scratch / f"world-equivalence-{name}.json"
        path.write_text(json.dumps({**equivalence_config(self.world), "batch_size": batch}))
        return str(path)

    def argv(self, run: str, scratch: Path) -> list[str]:
        """The command line of one equivalence run (its task settings written under ``scratch``)."""
        one = run == "one_rank"
        cfg = self._config_file(scratch, "one" if one else "w", PER_RANK_BATCH * (self.world if one else 1))
        world = [] if one else ["--nproc-per-node", str(self.world)]
        # The negative control is an explicit (hidden) option of the path's command line, never an environment
        # variable a pod spec could set by mistake.
        negative = Variant(negative_control="per-rank-mean").argv() if run == "per_rank_mean" else []
        return job_argv("train", "--store", self.urls[run], *world, *negative, "--task", EQUIVALENCE_TASK,
                        "--config", cfg, "--seed", str(self.seed), "--steps", str(equivalence_steps(self.world)),
                        "--checkpoint-every", "0", "--checkpoint-every-seconds", "0", "--keep", "0",
                        "--resume", "never", "--device", self.device, "--log-format", "json", *self.store_args,
                        *layout_flag(self.fsdp))

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """The three runs (the negative one with the variant ``negative_control: per-rank-mean``), after the protocol's
        paths: they need nothing of them, and W-rank runs beside the protocol's W-rank paths would crowd the machine."""
        if phase != AFTER:
            return []
        self.started = True
        return [(r, self.urls[r], self.argv(r, scratch)) for r in RUNS]

    def record(self, phase: str, results: list[PathResult]) -> None:
        """Its runs' entries, in the ``world_equivalence`` block."""
        if phase == AFTER:
            self.paths = {r.name: r.to_json() for r in results}

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Read the three runs back from the store and compare W ranks (and the negative control) with one rank."""
        if phase != AFTER:
            return
        require_success(results)
        steps = equivalence_steps(self.world)
        self.compare_states({r: RunReader(f"world_equivalence/{r}", self.urls[r], self.opener).state(steps, whole=True)
                             for r in RUNS})

    def compare_states(self, states: dict[str, dict[str, Any]]) -> None:
        """Compare the runs' final states (by run name) with ``one_rank``; VerificationIncomplete when a run did not
        train with the world it was started with."""
        if states["w_ranks"]["meta"].get("world") != self.world or states["one_rank"]["meta"].get("world") != 1:
            raise VerificationIncomplete(f"world-equivalence runs ran with worlds "
                                         f"{states['one_rank']['meta'].get('world')} / "
                                         f"{states['w_ranks']['meta'].get('world')}, not 1 / {self.world}")
        for r in ("w_ranks", "per_rank_mean"):
            self.same_experience[r] = same_experience(states["one_rank"], states[r])
            self.diffs[r] = max_differences(states["one_rank"], states[r])

    @property
    def passed(self) -> bool:
        """W ranks saw the same data as one rank and every difference is within the tolerance."""
        d = self.diffs.get("w_ranks")
        return bool(d) and self.same_experience.get("w_ranks", False) and all(v <= TOLERANCE for v in d.values())

    @property
    def negative_detected(self) -> bool:
        """The per-rank-mean run (same data) differs beyond the tolerance in parameters and optimizer."""
        d = self.diffs.get("per_rank_mean")
        return (bool(d) and self.same_experience.get("per_rank_mean", False)
                and d["parameters"] > TOLERANCE and d["optimizer"] > TOLERANCE)

    def failing(self) -> list[str]:
        """Failed checks, named like the protocol's."""
        out = []
        if self.diffs.get("w_ranks") is not None:
            if not self.same_experience.get("w_ranks"):
                out.append("world_equivalence.experience")
            out += [f"world_equivalence.{k}" for k, v in self.diffs["w_ranks"].items() if not v <= TOLERANCE]
        if self.diffs.get("per_rank_mean") is not None and not self.negative_detected:
            out.append("world_negative: per-rank mean not detected")
        return out

    def verdicts(self) -> dict[str, bool]:
        """``world_equivalence_passed`` and ``world_negative_detected``."""
        return {"world_equivalence_passed": self.passed, "world_negative_detected": self.negative_detected}

    def sections(self) -> dict[str, Any]:
        """``world_equivalence``: :meth:`to_json` once its runs started, null before."""
        return {"world_equivalence": self.to_json() if self.started else None}

    def to_json(self) -> dict[str, Any]:
        """The ``world_equivalence`` block of verification.json."""
        return {
            "world": self.world, "tolerance": {"atol": TOLERANCE, "rtol": 0.0, "dtype": "float64"},
            "max_abs_diff": self.diffs.get("w_ranks"), "same_experience": self.same_experience.get("w_ranks"),
            "passed": self.passed, "reason": REASON,
            "configuration": {"task": EQUIVALENCE_TASK, **equivalence_config(self.world),
                              "per_rank_batch_size": PER_RANK_BATCH,
                              "global_batch_size": PER_RANK_BATCH * self.world,
                              "steps": equivalence_steps(self.world), "seed": self.seed},
            "negative_control": {"what": "loss normalised per rank (mean of per-rank means) on steps whose "
                                         "ranks hold uneven target counts (variant negative_control=per-rank-mean)",
                                 "max_abs_diff": self.diffs.get("per_rank_mean"),
                                 "detected": self.negative_detected},
            "paths": self.paths,
        }
