"""What a user gets, compared: the continuous path's export against the resumed path's, at the same final step.

The protocol compares every state the paths committed; the export the verification makes (trainproof.proof.four_paths:
the resumed path's bundle, reloaded in a fresh process) is what a user takes away. An export is built from one
generation, but also by the task's code in the exporting process (``evaluate_metrics``, the model it builds): state
that lives outside the checkpoint and reaches the export there (an EMA of the weights kept on the task object, shared
by the process's instances; a module-level cache; an evaluation that is not a function of the weights alone) makes two
exports of equal states differ, and the reload check, which starts afresh in a fresh process, does not see it.

So once the resumed path's bundle is made and reload-checked, the continuous path's final generation is exported too
(in this process, without a reload check of its own: the resumed bundle's check covers the format) under
``<id>/continuous/exports/``, and the two bundles are compared: the full-precision weights (``weights``), the bf16
weights (``weights_bf16``) and every value of ``metrics.json`` (``metrics``: the evaluation metric and the others, the
final loss and learning rate, the step, epoch, samples and targets seen), with the protocol's tolerance (exact on the
CPU). A difference fails ``export_comparison.<what>`` (exit 1) with the first differing value.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainproof.export.bundle import BF16_SAFETENSORS, FP_FILE, export
from trainproof.proof.check import EXPORT, Check, Results
from trainproof.proof.compare import Diff, Tolerance, diff_tree
from trainproof.proof.four_paths import FourPaths
from trainproof.proof.paths import Opener, PathResult
from trainproof.proof.reload import MAX_RECORD_BYTES, SPOOL_FROM, _record, _weights
from trainproof.proof.settings import CPU_EXACT
from trainproof.storage import GenerationStore
from trainproof.storage.limits import loads_untrusted
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import spool_dir

log = logging.getLogger("trainproof.verify")
KEY = "export_comparison"


def bundle_parts(dest: GenerationStore, step: int) -> dict[str, Any]:
    """The compared parts of the bundle of ``step`` under ``dest``, read back and verified against its COMPLETE.json:
    ``weights``, ``weights_bf16`` (tensors by name) and ``metrics`` (metrics.json)."""
    loaded = dest.load(step, spool_dir=spool_dir(), spool_from=SPOOL_FROM)
    where = f"{dest.url}/{step_dir(step)}"
    try:
        return {"weights": _weights(loaded.files, FP_FILE, where),
                "weights_bf16": _weights(loaded.files, BF16_SAFETENSORS, where),
                "metrics": loads_untrusted(_record(loaded.files["metrics.json"], "metrics.json"),
                                           what="metrics.json", max_bytes=MAX_RECORD_BYTES)}
    finally:
        loaded.close()  # the mapped weights stay readable until they are dropped


NOT_COMPARED = {"history": ("generations_read",)}
"""Bookkeeping of metrics.json that differs by path, not by result: how many generations the loss curve was read
from (the resumed path's run holds copies of the cut's lineage, not every step's generation)."""
BF16_METRICS = ("value_bf16", "others_bf16")
"""The entries of metrics.json's ``eval`` computed from the bf16 weights."""
BF16_NOT_COMPARED = ("under a tolerance (not exact) the bf16 weights and their metrics are not compared: rounding to "
                     "bfloat16 turns a difference within the tolerance into a whole bf16 step; they are the "
                     "full-precision weights, compared, rounded")


def _compared_metrics(metrics: Any, *, bf16: bool) -> Any:
    """metrics.json without :data:`NOT_COMPARED` (and without :data:`BF16_METRICS` unless ``bf16``)."""
    if not isinstance(metrics, dict):
        return metrics
    left_out = {**NOT_COMPARED, **({} if bf16 else {"eval": BF16_METRICS})}
    return {k: {kk: vv for kk, vv in v.items() if kk not in left_out[k]}
            if k in left_out and isinstance(v, dict) else v for k, v in metrics.items()}


def compare_bundles(ref: dict[str, Any], other: dict[str, Any], tol: Tolerance) -> dict[str, Diff]:
    """Each part of :func:`bundle_parts` of ``other`` against ``ref``'s (trainproof.proof.compare.diff_tree); the
    bf16 parts only in an exact comparison (:data:`BF16_NOT_COMPARED`)."""
    exact = tol.mode == "exact"
    out = {"weights": diff_tree(ref["weights"], other["weights"], tol)}
    if exact:
        out["weights_bf16"] = diff_tree(ref["weights_bf16"], other["weights_bf16"], tol)
    out["metrics"] = diff_tree(_compared_metrics(ref["metrics"], bf16=exact),
                               _compared_metrics(other["metrics"], bf16=exact), tol)
    return out


class ExportComparison(Check):
    """The continuous path's export against the resumed path's (made by :class:`trainproof.proof.four_paths.FourPaths`
    in the ``export`` phase, which comes first)."""

    def __init__(self, *, four: FourPaths, root_url: str, opener: Opener, steps: int, task: str,
                 tolerance: Tolerance | None) -> None:
        self.four, self.opener, self.steps, self.task = four, opener, steps, task
        self.tol = tolerance or Tolerance.exact(CPU_EXACT)
        """The protocol's comparison (resolved from the device before any check is built; exact on the CPU)."""
        self.dest_url = f"{root_url.rstrip('/')}/continuous/exports"
        self.diffs: dict[str, Diff] = {}
        self.location: str | None = None

    def record(self, phase: str, results: list[PathResult]) -> None:
        """It starts no process."""

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """In the ``export`` phase, once the resumed path's bundle exists: export the continuous path's final
        generation and compare the two bundles."""
        if phase != EXPORT or self.four.export is None:
            return
        t0 = time.monotonic()
        dest = self.opener(self.dest_url)
        bundle = export(self.opener(self.four.urls["continuous"]), step=self.steps, dest=dest, task=self.task)
        self.location = bundle.url
        resumed = self.opener(self.four.urls["resume"]).child("exports")
        self.diffs = compare_bundles(bundle_parts(dest, self.steps), bundle_parts(resumed, self.steps), self.tol)
        log.info("export of the continuous path, compared with the resumed path's: %.1f s", time.monotonic() - t0)

    @property
    def ran(self) -> bool:
        return bool(self.diffs)

    @property
    def passed(self) -> bool:
        """The two exports are equal (True until they were compared: the export phase comes last)."""
        return all(d.within for d in self.diffs.values())

    def failing(self) -> list[str]:
        """``export_comparison.<weights|weights_bf16|metrics>``."""
        return [f"{KEY}.{name}" for name, d in self.diffs.items() if not d.within]

    def diagnosis(self) -> list[str]:
        """What differs, and why states that compared equal can give other exports."""
        failed = [(name, d) for name, d in self.diffs.items() if not d.within]
        if not failed:
            return []
        what = "; ".join(f"{name}: {d.detail or '; '.join(d.problems[:2])}" for name, d in failed)
        return [f"{KEY}: the continuous and resumed paths' exports of step {self.steps} differ ({what}) although "
                "every state they committed compared equal: the export depends on something outside the checkpoint, "
                "state the task keeps in the exporting process (on the task object shared by its instances, a "
                "class attribute, a module-level cache) or an evaluation that is not a function of the weights alone"]

    def verdicts(self) -> dict[str, bool]:
        """``export_comparison_passed``, once the exports were compared."""
        return {f"{KEY}_passed": self.passed} if self.ran else {}

    def sections(self) -> dict[str, Any]:
        """The ``export_comparison`` block: whether it ran, the continuous path's bundle, what was compared."""
        return {KEY: {"ran": self.ran, "continuous_export": self.location,
                      "resumed_export": None if self.four.export is None else self.four.export.get("location"),
                      "step": self.steps, "compared": {"weights": FP_FILE, "weights_bf16": BF16_SAFETENSORS,
                                                       "metrics": "metrics.json"},
                      **({} if self.tol.mode == "exact" else {"bf16": BF16_NOT_COMPARED}),
                      **({} if self.ran else {"why_not": "no export of the resumed path (--no-export, or a check "
                                                         "failed before the export)"})}}

    def checks(self) -> dict[str, dict[str, Diff]]:
        """Its rows of ``checks``: weights, weights_bf16, metrics."""
        return {KEY: self.diffs} if self.ran else {}
