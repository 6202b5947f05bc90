"""What each path of a verification exercised, and which checks it therefore proved nothing about.

A comparison that finds every difference 0 proves the resume right only for the code paths the run went through: a
task whose gradient norm never reaches ``grad_clip`` passes a resume that clips wrongly, a run without a GradScaler
passes a resume that loses it, a generator that never drew is "restored" whatever the restore does. So the verifier
records, for every path, what it exercised (from the ``step`` events the trainer prints: micro-batches per step,
gradient norm and whether clipping changed it, GradScaler; the epochs its steps were in), which of the trainer's
generators drew during the continuous path (its first and last generation's states), and whether the task keeps
state of its own; and names every check whose path was never exercised, with a hint (``not_exercised`` in
verification.json, printed under the verdict). Such a check is never counted as proved: its rows say
``"exercised": false`` and the summary shows them as ``n/a``.
"""

from __future__ import annotations

from typing import Any

from trainproof.proof.compare import Tolerance, diff_tree
from trainproof.proof.paths import PathResult

EXACT = Tolerance.exact("generator states: equal or not")


def path_exercised(result: PathResult) -> dict[str, Any] | None:
    """What one ``train`` process exercised, from its ``step`` events (None when it printed none)."""
    steps = [e for e in result.events if e.get("event") == "step"]
    if not steps:
        return None
    clipped = [e for e in steps if "clipped" in e]
    epochs = sorted({int(e["epoch"]) for e in steps if "epoch" in e})
    norms = [float(e["grad_norm"]) for e in clipped if isinstance(e.get("grad_norm"), (int, float))]
    return {
        "steps": [int(steps[0]["step"]), int(steps[-1]["step"])],
        "micro_batches_per_step": sorted({int(e["micro_batches"]) for e in steps if "micro_batches" in e}),
        "clipping": None if not clipped else {"active_steps": sum(bool(e["clipped"]) for e in clipped),
                                              "of_steps": len(clipped), "max_grad_norm": max(norms, default=None)},
        "grad_scaler": any(bool(e.get("grad_scaler")) for e in steps),
        "epochs": epochs,
        "epochs_crossed": (epochs[-1] - epochs[0]) if epochs else 0,
    }


def generators_drew(first: dict[str, Any], last: dict[str, Any]) -> dict[str, bool]:
    """Per generator of rank 0 (``python``, ``numpy``, ``torch``, ...): whether its state moved between two states
    of the same path."""
    a = (first.get("ranks") or [{}])[0].get("rng") or {}
    b = (last.get("ranks") or [{}])[0].get("rng") or {}
    # ``schema`` names the layout; a generator with no state (CUDA's on the CPU) does not exist in this run.
    return {name: not diff_tree(a[name], b.get(name), EXACT, name).within for name in a
            if name != "schema" and a[name] not in (None, [], {})}


def not_exercised(*, grad_clip: float | None, exercised: dict[str, dict[str, Any] | None], resumed: list[str],
                  drew: dict[str, bool], task_state: bool, cut: int) -> list[dict[str, str]]:
    """Every check whose code path no resumed path went through: ``{"what", "check", "hint"}``."""
    out: list[dict[str, str]] = []
    ran = {p: e for p, e in exercised.items() if p in resumed and e}
    if grad_clip and ran and not any((e.get("clipping") or {}).get("active_steps") for e in ran.values()):
        worst = max(((e.get("clipping") or {}).get("max_grad_norm") or 0.0 for e in ran.values()), default=0.0)
        out.append({"what": "gradient clipping", "check": "parameters",
                    "hint": f"grad_clip is {grad_clip:g} but no resumed step's gradient norm reached it (largest "
                            f"{worst:.3g}): a resume that clips wrongly would pass. Verify with a configuration whose "
                            "gradients reach the threshold (a lower grad_clip in --config) or more steps"})
    if ran and all(e.get("micro_batches_per_step") == [1] for e in ran.values()):
        out.append({"what": "gradient accumulation", "check": "optimizer",
                    "hint": "every step was one micro-batch: a resume that loses or repeats an accumulated "
                            "micro-batch would pass. Verify with micro_batch_size below batch_size in --config"})
    if ran and not any(e.get("grad_scaler") for e in ran.values()):
        out.append({"what": "GradScaler", "check": "grad_scaler",
                    "hint": "no path used a GradScaler (float16 autocast: precision fp16, or auto on CUDA), so its "
                            "restore was compared but not exercised"})
    if not task_state:
        out.append({"what": "task state", "check": "task_state",
                    "hint": "the task keeps no state of its own (Task.state_dict() is empty): nothing to restore"})
    for name, moved in drew.items():
        if not moved:
            out.append({"what": f"generator {name}", "check": "rng_states",
                        "hint": f"the {name} generator never drew during the continuous path, so its restore was "
                                "compared but not exercised (a lost restore of it would pass)"})
    if ran and not any(e.get("epochs_crossed") for e in ran.values()):
        out.append({"what": "an epoch boundary after a resume", "check": "data_position",
                    "hint": f"no resumed path (from step {cut} on) crossed into a new epoch: the restored data "
                            "generator never drew a permutation. Use --cuts or --steps reaching the next epoch"})
    return out
