"""``python -m tests.support.hooked <trainproof args>``: trainproof with faults injected, for tests only.

The product reads no test switch: a pod spec cannot turn any of this on. Tests that need a slow step, a
slow save or a deliberately broken resume start this wrapper instead of ``python -m trainproof``; it patches the
trainer's functions in its own process, points :data:`trainproof.train.launch.ENTRY_MODULE` at itself (so the ranks
and verifier paths it starts are wrapped too) and runs the real command line. What it injects comes from
``TPHOOK_*`` variables, which processes inherit (the verifier passes only ``TRAINPROOF_*`` store settings on):

=======================  ==================================================================================
``TPHOOK_STEP_DELAY``    seconds to sleep after each optimizer step (lets a signal land mid-run)
``TPHOOK_COMMIT_INTERFERENCE`` seconds each optimizer step sleeps while a commit is in progress (what a
                         background commit sharing the machine costs the steps beside it)
``TPHOOK_SAVE_DELAY``    seconds to sleep inside a save: after the state was written and read back, before
                         ``COMPLETE.json``; and after a rank wrote its part (lets a signal or a kill land
                         mid-save)
``TPHOOK_PER_RANK_MEAN`` ``1``: every run normalises its loss per rank (a trainer bug on every path)
``TPHOOK_ATTEMPT_REFRESH`` seconds between rewrites of the attempt record while steps run (``0``: after every
                         step, so a SIGKILLed attempt's record says which step it reached)
``TPHOOK_FULL_AT_STEP``  a step: every write into that step's folder of a local store fails as a full disk does
                         (``ENOSPC``), so its commit fails; other steps are written normally
``TPHOOK_SABOTAGE``      break the *resume* on purpose, the bugs the verifier claims to catch
                         (comma-separated; a fresh start is never affected):
                         ``skip_optimizer`` load the optimizer's hyper-parameters but not its state;
                         ``rebuild_scheduler`` construct the scheduler again after loading it;
                         ``reseed_rng`` re-seed every generator instead of restoring them;
                         ``lose_cursor`` restart the epoch's permutation from its first sample;
                         ``repeat_batch`` step the cursor back one batch;
                         ``regen_permutation`` re-derive the epoch's permutation (and the data generator)
                         from (seed, epoch) instead of restoring them: right in epoch 0 only;
                         ``lose_python_rng`` / ``lose_numpy_rng`` re-seed only Python's ``random`` / only
                         the run's NumPy generator after the restore (one generator family lost);
                         ``rng_mismatch`` restore Python's generator from another state, so the resume's
                         own restore self-check fails (the trainer exits 2 with a
                         ``restore_check_failed`` event);
                         ``crash`` fail while restoring (the process exits 1);
                         ``sqrt_square`` replace Adam's second moment by the square of its square root (a
                         ~1e-17 drift: passes any absolute tolerance, fails an exact comparison);
                         ``late_repeat_batch`` step the cursor back one batch, only when the restored position
                         is in epoch 2 or later (a restore bug from epoch 2 on);
                         ``second_resume`` re-seed Python's ``random``, only when the restored state was written
                         by a process that had itself resumed (``meta.trainer.resumed_from``);
                         ``clip_after_resume`` halve the task's ``grad_clip`` on resume (clipping restored wrong);
                         ``reshard_zero_steps`` zero the optimizer's step counters (Adam's ``step``), only when the
                         generation was written by another world size (``--allow-world-change``: a reshard bug);
                         ``clip_second_resume`` halve the task's ``grad_clip`` only when the restored state was
                         written by a process that had itself resumed (clipping wrong only on a resume of a resume);
                         ``scheduler_step_on_restore`` step the learning-rate scheduler once right after restoring;
                         ``other_base`` the frozen parameters (requires_grad=False) restored 1e-3 off, as from
                         another base model;
                         ``lookahead_restart`` the data lookahead (trainproof.train.pipeline) restarts at the
                         restored step instead of the next one: the resumed process's batches are out of step
                         and it fails at its first step (a task that builds its batches: build_batch)
``TPHOOK_SAVE_PREFETCHED`` ``1``: every checkpoint holds the data position the DataLoader workers were asked to
                         build up to (trainproof.train.pipeline's lookahead) instead of the one the trainer consumed: the
                         bug of loaders that checkpoint their own prefetching iterator
``TPHOOK_SAVE_BUG``     ``scaler_tracker``: every checkpoint saves the GradScaler's growth tracker as 0 (the continuous
                         path's too, so stored states agree; only the live state shows the tracker it had)
``TPHOOK_DUMP_LOADED``   a path: right after a sharded run (``--fsdp``) loaded its model and optimizer shards,
                         gather them whole (every rank) and ``torch.save`` them there (rank 0), flattened to
                         ``model.<fqn>`` / ``optim.state.<fqn>.<key>`` / ``optim.param_groups``: a test compares
                         them with the generation (the product never gathers the full state)
=======================  ==================================================================================

Tests in the same process as the verifier (CliRunner) set the variables and monkeypatch ``ENTRY_MODULE``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

MODULE = "tests.support.hooked"
SABOTAGES = ("skip_optimizer", "rebuild_scheduler", "reseed_rng", "lose_cursor", "repeat_batch", "regen_permutation",
             "lose_python_rng", "lose_numpy_rng", "rng_mismatch", "crash", "sqrt_square",
             "late_repeat_batch", "second_resume", "clip_after_resume", "reshard_zero_steps", "clip_second_resume",
             "scheduler_step_on_restore", "lookahead_restart", "other_base")


class SabotageCrash(RuntimeError):
    """The ``crash`` sabotage: a resume that fails outright."""


def _seconds(name: str) -> float:
    return float(os.environ.get(name) or 0.0)


def _sabotages() -> frozenset[str]:
    names = frozenset(n.strip() for n in os.environ.get("TPHOOK_SABOTAGE", "").split(",") if n.strip())
    unknown = sorted(names - set(SABOTAGES))
    if unknown:  # a typo must not pass for a clean run
        raise ValueError(f"TPHOOK_SABOTAGE: unknown sabotage {unknown}; known: {', '.join(SABOTAGES)}")
    return names


def _state_to_restore(kinds: frozenset[str], state: dict[str, Any]) -> dict[str, Any]:
    print(f"warning: TPHOOK_SABOTAGE={','.join(sorted(kinds))}: this resume is broken on purpose",
          file=sys.stderr, flush=True)
    if "crash" in kinds:
        raise SabotageCrash("TPHOOK_SABOTAGE=crash: failing the restore on purpose")
    if "rng_mismatch" in kinds:
        import random

        saved = random.getstate()
        random.seed(987654321)  # another state than the one saved: its next draw differs from the recorded one
        version, internal, gauss = random.getstate()
        random.setstate(saved)
        part = {**state["ranks"][0], "rng": {**state["ranks"][0]["rng"],
                                             "python": {"version": version, "internal": list(internal),
                                                        "gauss_next": gauss}}}
        state = {**state, "ranks": [part, *state["ranks"][1:]]}
    if "skip_optimizer" in kinds:
        # Only the hyper-parameters survive: the "continue" looks fine, the moments start from zero.
        state = {**state, "optimizer": {"state": {}, "param_groups": state["optimizer"]["param_groups"]}}
    return state


def _after_restore(kinds: frozenset[str], run: Any, state: dict[str, Any]) -> None:
    from trainproof.train import rng

    if "other_base" in kinds:  # the frozen parameters (a LoRA run's base) restored from another base
        import torch

        with torch.no_grad():
            for p in run.model.parameters():
                if not p.requires_grad:
                    p.add_(1e-3)

    if "rebuild_scheduler" in kinds and run.scheduler is not None:
        # Constructing a scheduler resets the optimizer's learning rate to the schedule's start.
        run.scheduler = run.task.build_scheduler(run.optimizer)
    if "reseed_rng" in kinds:
        fresh = rng.seed_all(state["meta"]["seed"])  # Python, NumPy global, torch: re-seeded in place
        run.np_gen.bit_generator.state = fresh.bit_generator.state  # the sampler holds this very object
    if "lose_python_rng" in kinds:
        import random

        random.seed(state["meta"]["seed"])
    if "lose_numpy_rng" in kinds:
        import numpy as np

        run.np_gen.bit_generator.state = np.random.Generator(np.random.PCG64(state["meta"]["seed"])).bit_generator.state
    if "regen_permutation" in kinds and run.sampler.permutation is not None:
        import numpy as np

        # The plausible bug: one stream per epoch, keyed by (seed, epoch). Epoch 0's coincides with the real
        # data stream (its first permutation), so it hides until a run is cut after epoch 0.
        gen = np.random.Generator(np.random.PCG64([state["meta"]["seed"], rng.DATA_STREAM + run.sampler.epoch]))
        run.sampler.permutation = gen.permutation(run.sampler.num_samples).astype(np.int64)
        run.sampler.restore_generator({"generator": gen.bit_generator.state})
    if "sqrt_square" in kinds:
        import torch

        with torch.no_grad():
            for slot in run.optimizer.state.values():
                if "exp_avg_sq" in slot:
                    slot["exp_avg_sq"].copy_(slot["exp_avg_sq"].sqrt() ** 2)
    if "late_repeat_batch" in kinds and run.sampler.epoch >= 2 and run.sampler.cursor >= run.global_batch:
        run.sampler.cursor -= run.global_batch
    if "second_resume" in kinds and (state["meta"].get("trainer") or {}).get("resumed_from") is not None:
        import random

        random.seed(state["meta"]["seed"])
    if "clip_after_resume" in kinds and run.task.grad_clip:
        run.task.grad_clip = run.task.grad_clip * 0.5
    if "clip_second_resume" in kinds and run.task.grad_clip and \
            (state["meta"].get("trainer") or {}).get("resumed_from") is not None:
        run.task.grad_clip = run.task.grad_clip * 0.5
    if "scheduler_step_on_restore" in kinds and run.scheduler is not None:
        run.scheduler.step()
    if "lookahead_restart" in kinds:
        _RESTORED.append(run.step)
    if "lose_cursor" in kinds:
        run.sampler.cursor = 0
    if "repeat_batch" in kinds:
        run.sampler.cursor = max(0, run.sampler.cursor - run.global_batch)


def _zero_step_counters(optimizer: Any) -> None:
    """Every per-parameter ``step`` counter of ``optimizer`` set to 0 (a tensor in place, else the number)."""
    for slot in optimizer.state.values():
        if "step" in slot:
            if hasattr(slot["step"], "zero_"):
                slot["step"].zero_()
            else:
                slot["step"] = 0


_RESTORED: list[int] = []
"""The steps this process restored (``lookahead_restart``: its first batch source starts at the restored step)."""


def _lookahead_restart() -> None:
    """After a restore, the first batch source's lookahead starts at the restored step instead of the next one."""
    from trainproof.train import loop

    open_batches = loop.open_batches

    @functools.wraps(open_batches)
    def restarted(*args: Any, first: int, **kwargs: Any) -> Any:
        if _RESTORED and first == _RESTORED[0] + 1:
            first = _RESTORED.pop()
        return open_batches(*args, first=first, **kwargs)

    loop.open_batches = restarted


def _dump_full(model: Any, optimizer: Any, path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    def flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(value, dict):
            for k, v in value.items():
                flat(v, f"{prefix}.{k}", out)
        else:
            out[prefix] = value.full_tensor() if isinstance(value, DTensor) else value  # collective: every rank
        return out

    msd, osd = get_state_dict(model, optimizer)
    full = flat({"model": msd, "optim": osd}, "", {})
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({k.lstrip("."): v for k, v in full.items()}, path)


def _save_prefetched() -> None:
    from trainproof.train import loop, run

    part, open_batches, opened = run.capture_rank_part, loop.open_batches, []

    @functools.wraps(open_batches)
    def remembered(*args: Any, **kwargs: Any) -> Any:
        batches = open_batches(*args, **kwargs)
        opened.append(batches)  # the final commit comes after the workers were stopped: remember where they were
        return batches

    @functools.wraps(part)
    def prefetched_part(live: Any) -> dict[str, Any]:
        ahead = getattr(opened[-1], "lookahead", None) if opened else None
        if ahead is None:
            return part(live)
        consumed, live.sampler = live.sampler, ahead.sampler  # where the workers are, not where the trainer is
        try:
            return part(live)
        finally:
            live.sampler = consumed

    loop.open_batches = remembered
    run.capture_rank_part = loop.capture_rank_part = prefetched_part


def _save_scaler_tracker_zero() -> None:
    """Every captured state's GradScaler growth tracker is 0: a save bug in every generation."""
    from trainproof.train import loop

    capture = loop.capture_state

    @functools.wraps(capture)
    def wrong_capture(run: Any, meta: dict[str, Any]) -> dict[str, Any]:
        state = capture(run, meta)
        if "_growth_tracker" in state["scaler"]:
            state["scaler"] = {**state["scaler"], "_growth_tracker": 0}
        return state

    loop.capture_state = wrong_capture


def _disk_full_at(step: int) -> None:
    """Writes into ``step-<step>/`` of a local store fail with ENOSPC (a disk that filled up at that step)."""
    import errno

    from trainproof.storage.backend import LocalBackend

    write, folder = LocalBackend.write, f"{os.sep}step-{step:08d}{os.sep}"

    @functools.wraps(write)
    def full_write(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if folder in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(self, path, *args, **kwargs)

    LocalBackend.write = full_write  # type: ignore[method-assign]


def install() -> None:
    """Patch the trainer in this process as the ``TPHOOK_*`` variables say, and wrap the processes it starts."""
    from trainproof.train import checkpoint, launch, loop, resume
    from trainproof.format.state import STATE_FILE

    launch.ENTRY_MODULE = MODULE
    step_delay, save_delay = _seconds("TPHOOK_STEP_DELAY"), _seconds("TPHOOK_SAVE_DELAY")
    interference = _seconds("TPHOOK_COMMIT_INTERFERENCE")
    committing = [0]  # commits in progress, on any thread
    if step_delay > 0 or interference > 0:
        step = loop.train_step

        @functools.wraps(step)
        def slow_step(run: Any) -> dict[str, Any]:
            record = step(run)
            # a signal does not cut this short in effect: the handler only sets a flag
            time.sleep(step_delay + (interference if committing[0] else 0.0))
            return record

        loop.train_step = slow_step
    if interference > 0:
        commit = checkpoint.Checkpointer.commit

        @functools.wraps(commit)
        def counted_commit(self: Any, c: Any) -> Any:
            committing[0] += 1
            try:
                return commit(self, c)
            finally:
                committing[0] -= 1

        checkpoint.Checkpointer.commit = counted_commit
    if save_delay > 0:
        check, own_part = checkpoint.Checkpointer._check, checkpoint.Checkpointer._write_own_part

        def slow_check(self: Any, name: str, stored: bytes) -> None:
            if name == STATE_FILE:
                time.sleep(save_delay)
            check(self, name, stored)

        def slow_part(self: Any, *args: Any, **kwargs: Any) -> bytes:
            frame = own_part(self, *args, **kwargs)
            time.sleep(save_delay)
            return frame

        checkpoint.Checkpointer._check, checkpoint.Checkpointer._write_own_part = slow_check, slow_part
    refresh = os.environ.get("TPHOOK_ATTEMPT_REFRESH")
    if refresh:
        from trainproof.train import attempts

        attempts.REFRESH_S = float(refresh)
    full = os.environ.get("TPHOOK_FULL_AT_STEP")
    if full:
        _disk_full_at(int(full))
    if os.environ.get("TPHOOK_PER_RANK_MEAN") == "1":
        build = loop.build_run
        loop.build_run = functools.wraps(build)(lambda *a, **kw: build(*a, **{**kw, "per_rank_mean": True}))
    dump = os.environ.get("TPHOOK_DUMP_LOADED")
    if dump:
        from trainproof.train import fsdp

        load = fsdp.load_generation

        @functools.wraps(load)
        def dumping_load(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            info = load(model, optimizer, *args, **kwargs)
            _dump_full(model, optimizer, dump)
            return info

        fsdp.load_generation = dumping_load
    save_bug = os.environ.get("TPHOOK_SAVE_BUG")
    if save_bug:
        if save_bug != "scaler_tracker":  # a typo must not pass for a clean run
            raise ValueError(f"TPHOOK_SAVE_BUG: unknown save bug {save_bug!r}; known: scaler_tracker")
        _save_scaler_tracker_zero()
    if os.environ.get("TPHOOK_SAVE_PREFETCHED") == "1":
        _save_prefetched()
    kinds = _sabotages()
    if kinds:
        restore = resume.restore_state

        @functools.wraps(restore)
        def broken_restore(run: Any, state: dict[str, Any], **kwargs: Any) -> None:
            restore(run, _state_to_restore(kinds, state), **kwargs)
            _after_restore(kinds, run, state)
            if "reshard_zero_steps" in kinds and kwargs.get("rederive_at") is not None:  # another world wrote it
                _zero_step_counters(run.optimizer)

        resume.restore_state = broken_restore
        if "lookahead_restart" in kinds:
            _lookahead_restart()


if __name__ == "__main__":
    install()
    from trainproof.cli import main

    sys.argv[0] = "trainproof"
    main()
