"""The live training objects of one run, one optimizer step, and state capture/restore.

Order matters and is the protocol's (docs/protocol.md):

1. seed the generators, build model, optimizer and scheduler (the scheduler is constructed *before*
   ``optimizer.load_state_dict``: constructing it afterwards would overwrite the restored learning rate);
2. load model, scheduler and optimizer states, GradScaler, data position, history, progress;
3. restore the random generators LAST, right before training continues, and prove the restore by
   re-observing the next draws recorded at save time.

With world > 1 every rank runs these same functions on its own slice of each step's global batch (see
:func:`train_step`); the model is wrapped in DistributedDataParallel with summed gradients (trainproof.train.dist).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from trainproof.errors import ConfigError, StateError
from trainproof.format.layout import Layout
from trainproof.format.state import STATE_SCHEMA, History
from trainproof.tasks.base import Task, TaskContext
from trainproof.tasks.batches import BatchRequest
from trainproof.train import rng
from trainproof.train.data import EpochSampler, permutation_of
from trainproof.train.dist import Collectives, DistEnv, rank_seed, rank_slice
from trainproof.train.parallel import Strategy, strategy_for
from trainproof.train.pipeline import BatchSource, InProcess, micro_batches
from trainproof.train.schedule import check_cadence, step_scheduler, takes_metric


@dataclass(kw_only=True)
class Run:
    """Everything that changes while training, in one place."""

    task: Task
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler
    sampler: EpochSampler
    np_gen: np.random.Generator
    use_amp: bool
    """Whether the forward passes run under autocast (in ``autocast``)."""
    autocast: torch.dtype | None = None
    """The autocast dtype (trainproof.tasks.Task ``autocast_dtype``): float16 with the GradScaler, bfloat16 without."""
    history: History = field(default_factory=History)
    step: int = 0
    samples_seen: int = 0
    targets_seen: int = 0
    env: DistEnv = field(default_factory=DistEnv)
    """This process's rank and the world size."""
    sync: Collectives | None = None
    """Collectives over the run's process group (local when world is 1)."""
    ddp: nn.Module | None = None
    """The DistributedDataParallel wrapper the forward passes go through (None when world is 1, or sharded)."""
    parallel: Strategy = field(default_factory=lambda: strategy_for(Layout(world=1)))
    """The layout's strategy (trainproof.train.parallel): how the model is placed, synchronised, saved and loaded."""
    per_rank_mean: bool = False
    """The verifier's negative control (the variant ``negative_control: per-rank-mean``): normalise each rank's loss by
    its *own* target count and average the ranks (the mean of per-rank means), the classic mistake the
    global objective avoids. Never on for training."""
    seed: int = 0
    """The run seed (the per-sample generators of batches built ahead derive from it)."""
    batches: BatchSource | None = None
    """Where each micro-batch comes from (trainproof.train.pipeline): None builds them with ``make_batch`` at the
    step."""
    microbatch_mean: bool = False
    """The objective check's negative control (the variant ``negative_control: mean-of-microbatch-means``): normalise
    each micro-batch by its *own* target count and average the step's micro-batches (over every rank), the mistake
    a ``loss_sum`` that returns a mean makes. Never on for training."""

    def __post_init__(self) -> None:
        self.sync = self.sync or Collectives(self.env)
        self.batches = self.batches or InProcess(self.task)

    @property
    def cuda(self) -> bool:
        """Whether CUDA generators are in play."""
        return self.device.type == "cuda"

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.task.batch_size * self.env.world

    def lr(self) -> float:
        """Learning rate the next optimizer step will apply (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])


def build_run(task: Task, device: torch.device, seed: int, *, env: DistEnv | None = None,
              sync: Collectives | None = None, per_rank_mean: bool = False, microbatch_mean: bool = False,
              layout: Layout | None = None) -> Run:
    """Seed every generator, then build model, optimizer, scheduler, scaler and sampler, in that order.

    Each rank seeds its own generators from ``rank_seed(seed, rank)``; the data generator is seeded from
    ``seed`` alone (one global data order). The layout's strategy places the model (trainproof.train.parallel): with
    world > 1 replicated under DDP, which broadcasts rank 0's initial weights to every rank, or sharded with FSDP2
    (any world; trainproof.train.fsdp) after the same broadcast, before the optimizer is built over its sharded
    parameters.
    """
    env = env or DistEnv()
    parallel = strategy_for(layout or Layout(world=env.world))
    np_gen = rng.seed_all(rank_seed(seed, env.rank))
    model, wrapper = parallel.place(task, device, env, sync)
    optimizer = task.build_optimizer(model)
    scheduler = task.build_scheduler(optimizer)
    check_cadence(task, scheduler)
    autocast = task.autocast_dtype(device)
    # A GradScaler only for float16: bfloat16 has float32's exponent range, so its gradients need no scaling.
    scaler = parallel.grad_scaler(device, autocast == torch.float16)
    sampler = EpochSampler(task.num_samples(), rng.data_generator(seed))
    return Run(task=task, device=device, model=model, optimizer=optimizer, scheduler=scheduler,
               scaler=scaler, sampler=sampler, np_gen=np_gen, use_amp=autocast is not None, autocast=autocast,
               env=env, sync=sync,
               ddp=wrapper, parallel=parallel, per_rank_mean=per_rank_mean, microbatch_mean=microbatch_mean,
               seed=seed)


def train_step(run: Run) -> dict[str, Any]:
    """One optimizer step over the next global batch, accumulated over this rank's micro-batches.

    The loss is the global mean over the step's real targets (rows, tokens), over every rank and
    micro-batch: each micro-batch's *sum* of target losses is divided by the target count of the whole
    step, all-reduced before the first backward, and DDP *sums* the ranks' gradients (trainproof.train.dist). So ranks
    and micro-batches holding different numbers of targets weigh exactly what their targets weigh, and
    W ranks reproduce the one-rank run up to the order of floating-point additions.
    """
    t0 = time.perf_counter()
    task, world = run.task, run.env.world
    ids = run.sampler.next_ids(run.global_batch)
    mine = rank_slice(ids, world, run.env.rank)
    chunks = micro_batches(ids, world, run.env.rank, task.micro_batch_size)
    counts = [task.count_targets(c) for c in chunks]
    local = sum(counts)
    # One all-reduce gives the global count and whether any rank has nothing to train on: every rank then
    # refuses together, instead of one rank raising while the others wait in DDP's all-reduce. (The number
    # of micro-batches only matters to the objective check's negative control.)
    count, empty, micro = run.sync.sum_ints([local, int(local < 1), len(chunks)], "count the step's targets")
    if empty:
        raise ConfigError(f"{empty} rank(s) count no targets in their samples of step {run.step + 1} "
                          f"(this rank's: {mine[:8]}...)")
    denominators = ([max(n, 1) * micro for n in counts] if run.microbatch_mean
                    else [local * world if run.per_rank_mean else count] * len(chunks))
    lr = run.lr()
    run.optimizer.zero_grad(set_to_none=True)
    loss_total = torch.zeros((), dtype=torch.float64, device=run.device)
    ctx = TaskContext(np_rng=run.np_gen, device=run.device)
    for i, chunk in enumerate(chunks):
        # Built ahead by workers, or here and now (trainproof.train.pipeline); either way for exactly these ids.
        batch = run.batches.batch(BatchRequest(seed=run.seed, step=run.step + 1, micro=i, epoch=run.sampler.epoch,
                                               sample_ids=tuple(chunk)), ctx)
        # Gradients are reduced once per step, on the last micro-batch's backward; the earlier ones accumulate.
        with run.parallel.accumulate(run.model, run.ddp, last=i == len(chunks) - 1):
            with _autocast(run):
                loss_sum = task.loss_sum(run.ddp or run.model, batch)
            run.scaler.scale(loss_sum / denominators[i]).backward()
        loss_total += loss_sum.detach().to(torch.float64)
    norm = _optimizer_update(run)
    run.step += 1
    run.samples_seen += len(ids)
    run.targets_seen += count
    loss = run.sync.sum_float(float(loss_total), "sum the step's loss") / count
    step_scheduler(run, loss)  # after the update; a ReduceLROnPlateau on this step's loss (or a metric)
    run.history.append(step=run.step, epoch=run.sampler.epoch, loss=loss, lr=lr, targets=count, sample_ids=ids)
    # What the step exercised (the verifier reports a path that never clipped, accumulated or scaled): this rank's
    # micro-batches, the gradient norm before clipping and whether the clip changed the gradients.
    exercised = {"micro_batches": len(chunks), "grad_scaler": run.scaler.is_enabled()}
    if norm is not None:
        exercised |= {"grad_norm": norm, "clipped": norm > task.grad_clip}
    return {"step": run.step, "epoch": run.sampler.epoch, "loss": loss, "lr": lr, "samples": len(ids),
            "targets": count, **exercised, "step_seconds": time.perf_counter() - t0}


def _autocast(run: Run) -> contextlib.AbstractContextManager[Any]:
    if run.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=run.device.type, dtype=run.autocast)


def _optimizer_update(run: Run) -> float | None:
    """Unscale and clip (when asked), step through the GradScaler. Returns the global gradient norm before clipping
    (None without clipping). The schedule advances after it (trainproof.train.schedule ``step_scheduler``)."""
    norm = None
    if run.task.grad_clip:
        run.scaler.unscale_(run.optimizer)
        total = nn.utils.clip_grad_norm_(run.model.parameters(), run.task.grad_clip)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    return norm


def capture_rank_part(run: Run) -> dict[str, Any]:
    """This rank's part of the state: its generators, the data position and the next draws.

    Rank 0's ``data`` is the global data position (epoch, cursor, data generator pair); other
    ranks keep only epoch and cursor, which prove their file belongs to the same moment.
    """
    data = run.sampler.state_dict()
    if run.env.rank:
        data = {"epoch": data["epoch"], "cursor": data["cursor"]}
    draws = rng.observe_next_draws(run.np_gen, cuda=run.cuda)
    if run.env.rank == 0:
        draws["numpy_data"] = run.sampler.next_draw()
    # The draws are observed, then put back: they let the loader (and the verifier) prove the restore.
    return {"rank": run.env.rank, "rng": rng.capture(run.np_gen, cuda=run.cuda), "data": data, "next_draws": draws}


def capture_state(run: Run, meta: dict[str, Any]) -> dict[str, Any]:
    """The full training state at the current optimizer-step boundary, with this rank's part inline
    (see trainproof.format.state for the layout; rank 0's is the one saved in ``training_state.pt``)."""
    return {
        "schema": STATE_SCHEMA,
        "meta": meta,
        "progress": {"step": run.step, "epoch": run.sampler.epoch, "samples_seen": run.samples_seen,
                     "targets_seen": run.targets_seen, "next_lr": run.lr()},
        # Sharded (FSDP): the model and optimizer are saved as shards beside this state (trainproof.train.parallel).
        "model": run.model.state_dict() if run.parallel.inline_state else {},
        "optimizer": run.optimizer.state_dict() if run.parallel.inline_state else {},
        "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "history": run.history.state_dict(),  # the rows since the last committed generation
        "history_chain": run.history.chain(),
        "task_state": run.task.state_dict(),
        "ranks": [capture_rank_part(run)],
    }


def restore_state(run: Run, state: dict[str, Any], *, restore_rng: bool = True, rederive_at: int | None = None,
                  seed: int | None = None) -> None:
    """Load ``state`` into a freshly built run; generators last (skipped for the negative control).

    ``state["ranks"]`` must hold this rank's part (trainproof.format.state.decode_generation joins the rank files).
    ``rederive_at``: the world size changed at this step, so the saved per-rank streams do not fit any more:
    every rank re-derives its generators from ``rank_seed(seed, rank, step)`` instead, while the data
    generator (global) carries over.
    """
    data = state["ranks"][0]["data"]
    inline = run.parallel.inline_state  # else the model and optimizer were loaded from their shards already
    if inline:
        _load("model", lambda: run.model.load_state_dict(state["model"]))
    if (run.scheduler is None) != (state["scheduler"] is None):
        raise StateError("the state and the task disagree on whether a learning-rate scheduler exists")
    if run.scheduler is not None:
        _load("scheduler", lambda: run.scheduler.load_state_dict(state["scheduler"]))
    if inline:
        _load("optimizer", lambda: run.optimizer.load_state_dict(state["optimizer"]))
    _load_scaler(run, state["scaler"])
    run.sampler.load_state_dict(data)
    progress = state["progress"]
    # The rows up to the restored step live in the store's generations; this process records from the next step
    # on, chaining from the restored state's digest (trainproof.format.state.History).
    saved = History.from_state_dict(state["history"])
    run.history = History(first=progress["step"] + 1, before=state["history_chain"]["digest"], last=saved.last_row)
    run.step, run.samples_seen, run.targets_seen = progress["step"], progress["samples_seen"], progress["targets_seen"]
    # The task's own state (Task.state_dict) after everything the trainer owns and before the generators;
    # a state written before task state existed holds none ({}).
    _load("task", lambda: run.task.load_state_dict(state.get("task_state", {})))
    if not restore_rng:
        return
    if rederive_at is None:
        restore_generators(run, state["ranks"][run.env.rank], data)
    else:
        assert seed is not None, "re-deriving the streams needs the run seed"
        run.sampler.restore_generator(data)
        rng.reseed(run.np_gen, rank_seed(seed, run.env.rank, rederive_at))


def check_fits(run: Run, state: dict[str, Any]) -> None:
    """Refuse (StateError, naming the first misfit) a state whose model, optimizer, scheduler or data position does
    not have the shape of what this task built, before anything is loaded: what ``load_state_dict`` would accept
    but the first resumed step would fail on (an optimizer moment of another shape, a missing one, a scheduler
    field of another kind) is caught here, so a planted or damaged generation is passed over, never trained from.
    """
    if run.parallel.inline_state:
        _fits_model(run.model, state["model"])
        _fits_optimizer(run.optimizer, state["optimizer"])
    if run.scheduler is not None and state["scheduler"] is not None:
        _fits_like("scheduler", run.scheduler.state_dict(), state["scheduler"])
        _fits_schedule(run, state)
    _fits_position(run, state)
    _fits_progress(state)
    if not run.cuda:  # on CUDA the per-device states are checked by their restore
        _fits_like("generators", rng.capture(run.np_gen, cuda=False), state["ranks"][0].get("rng"))


def _fits_schedule(run: Run, state: dict[str, Any]) -> None:
    """The scheduler has taken the steps the progress implies: one per optimizer step, or (stepped on a metric) one per
    ``scheduler_every`` of them."""
    if not takes_metric(run.scheduler):
        return  # checked with the state's own consistency (trainproof.format.state)
    step, taken = state["progress"]["step"], state["scheduler"].get("last_epoch")
    if taken != step // run.task.scheduler_every:
        raise StateError(f"the saved scheduler has taken {taken!r} steps, but {step} optimizer steps with "
                         f"scheduler_every {run.task.scheduler_every} make {step // run.task.scheduler_every}")


def _fits_progress(state: dict[str, Any]) -> None:
    """The progress counters are counts, its epoch is the data position's, and its learning rate is the one the
    restored optimizer will apply."""
    progress, data = state["progress"], state["ranks"][0]["data"]
    for key in ("samples_seen", "targets_seen", "epoch"):
        value = progress.get(key)
        if type(value) is not int or value < 0:
            raise StateError(f"the saved progress.{key} is {value!r}, not a count")
    if progress["epoch"] != data.get("epoch"):
        raise StateError(f"the saved progress.epoch is {progress['epoch']}, the data position's is {data.get('epoch')}")
    groups = state["optimizer"].get("param_groups") if isinstance(state["optimizer"], dict) else None
    lr = groups[0].get("lr") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    if type(progress.get("next_lr")) is not float or (lr is not None and progress["next_lr"] != float(lr)):
        raise StateError(f"the saved progress.next_lr is {progress.get('next_lr')!r}, the optimizer's is {lr!r}")


def _fits_model(model: nn.Module, saved: Any) -> None:
    own = model.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(own):
        keys = sorted(map(str, set(saved) ^ set(own))) if isinstance(saved, dict) else type(saved).__name__
        raise StateError(f"the saved model does not have this task's tensors (differing: {str(keys)[:200]})")
    for name, tensor in own.items():
        got = saved[name]
        if not isinstance(got, torch.Tensor) or got.shape != tensor.shape or got.dtype != tensor.dtype:
            what = f"{got.dtype}{tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise StateError(f"the saved model's {name} is {what}, this task's is {tensor.dtype}{tuple(tensor.shape)}")


def _fits_optimizer(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise StateError("the saved optimizer state is not {state, param_groups}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups) or any(
            not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(o["params"])
            for g, o in zip(groups, optimizer.param_groups)):
        raise StateError("the saved optimizer's parameter groups do not match this task's")
    for g, o in zip(groups, optimizer.param_groups):
        for key, value in o.items():
            if key != "params" and (key not in g or type(g[key]) is not type(value)):
                raise StateError(f"the saved optimizer's {key!r} is {type(g.get(key)).__name__}, "
                                 f"this task's is {type(value).__name__}")
    ids = [i for g in groups for i in g["params"]]
    if sorted(ids, key=str) != sorted(set(ids), key=str) or any(type(i) is not int for i in ids):
        raise StateError("the saved optimizer's parameter ids are not distinct integers")
    index = dict(zip(ids, params))
    group_of = {pid: n for n, g in enumerate(groups) for pid in g["params"]}
    templates: dict[tuple, tuple[torch.Size, dict[str, Any] | None]] = {}
    for pid, moments in saved["state"].items():
        if pid not in index or not isinstance(moments, dict):
            raise StateError(f"the saved optimizer holds state for parameter {pid!r}, which this task lacks")
        param, group = index[pid], optimizer.param_groups[group_of[pid]]
        kind = (group_of[pid], param.dim(), param.dtype)
        if kind not in templates:
            templates[kind] = _moment_template(optimizer, param, group)
        _fits_moments(pid, param, moments, *templates[kind])


def _moment_template(optimizer: torch.optim.Optimizer, like: torch.Tensor,
                     group: dict[str, Any]) -> tuple[torch.Size, dict[str, Any] | None]:
    """(probe shape, state) of one step of this optimizer, with the settings of ``like``'s parameter group (a scheduler
    may have changed them: OneCycleLR turns SGD's momentum on), on a throw-away parameter of ``like``'s dtype and number
    of dimensions (at most 2 elements along each: an optimizer whose state depends on the shape, a factored one,
    keeps the same kinds of values): what a saved state of such a parameter must look like. The state is None when
    the optimizer cannot be stepped that way (then only the shapes of the values are checked)."""
    probe = torch.zeros(tuple(min(int(d), 2) for d in like.shape), dtype=like.dtype, requires_grad=True)
    options = {k: group.get(k, v) for k, v in optimizer.defaults.items()}
    try:
        other = type(optimizer)([probe], **options)
        probe.grad = torch.zeros_like(probe)
        other.step()
    except Exception:  # an optimizer that needs a closure or other arguments
        return probe.shape, None
    return probe.shape, dict(other.state[probe])


def _fits_moments(pid: int, param: torch.Tensor, moments: dict[str, Any], probe: torch.Size,
                  template: dict[str, Any] | None) -> None:
    if template is not None and set(moments) != set(template):
        raise StateError(f"the saved optimizer state of parameter {pid} has {sorted(map(str, moments))}, "
                         f"this optimizer keeps {sorted(template)}")
    for key, value in moments.items():
        like = None if template is None else template[key]
        if isinstance(like, torch.Tensor) and like.shape == probe and like.dim():  # one value per element
            ok = isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == like.dtype
        elif isinstance(like, torch.Tensor):  # a scalar (Adam's step) or a factored value: its kind and rank
            ok = isinstance(value, torch.Tensor) and value.dim() == like.dim() and value.dtype == like.dtype
        elif like is None and isinstance(value, torch.Tensor) and value.dim():
            ok = value.shape == param.shape or value.dim() < param.dim()
        else:
            ok = like is None or type(value) is type(like)
        if not ok:
            what = f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise StateError(f"the saved optimizer's {key!r} of parameter {pid} is {what}, which does not fit "
                             f"the parameter ({param.dtype}{tuple(param.shape)})")


def _fits_like(what: str, own: Any, saved: Any, path: str = "") -> None:
    """``saved`` has the structure of ``own``: the same keys, the same kinds of values, lists of the same length."""
    where = f"the saved {what}{path}"
    if isinstance(own, dict):
        if not isinstance(saved, dict) or set(saved) != set(own):
            raise StateError(f"{where} does not have this task's fields")
        for k in own:
            _fits_like(what, own[k], saved[k], f"{path}.{k}")
    elif isinstance(own, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(own):
            raise StateError(f"{where} is not a list of {len(own)}")
        for i, (a, b) in enumerate(zip(own, saved)):
            _fits_like(what, a, b, f"{path}[{i}]")
    elif isinstance(own, bool) or isinstance(saved, bool):
        if type(saved) is not type(own):
            raise StateError(f"{where} is {type(saved).__name__}, not {type(own).__name__}")
    elif isinstance(own, (int, float)):
        if not isinstance(saved, (int, float)):
            raise StateError(f"{where} is {type(saved).__name__}, not a number")
    elif own is not None and type(saved) is not type(own):
        raise StateError(f"{where} is {type(saved).__name__}, not {type(own).__name__}")


def _fits_position(run: Run, state: dict[str, Any]) -> None:
    """The data position is where the newest recorded step's samples end: its row's sample ids are the last ones
    taken from the epoch's permutation (redrawn from the position, which ``permutation_of`` checks)."""
    data = state["ranks"][0]["data"]
    perm = permutation_of(data, run.sampler.num_samples)
    last = History.from_state_dict(state["history"]).last_row
    if perm is None or last is None:
        return
    ids, cursor = last["sample_ids"], data["cursor"]
    taken = perm[max(0, cursor - len(ids)):cursor].tolist()
    if last["epoch"] != data["epoch"] or taken != ids:
        raise StateError(f"the data position (epoch {data['epoch']}, cursor {cursor}) is not where step "
                         f"{last['step']}'s recorded samples end")


def restore_generators(run: Run, rank_part: dict[str, Any], data: dict[str, Any] | None = None) -> None:
    """Restore every generator and check that each one's next draw is the one observed at save time.

    ``data``: the global data position whose generator is restored too (rank 0's part holds it).
    """
    rng.restore(rank_part["rng"], run.np_gen, cuda=run.cuda)
    observed = rng.observe_next_draws(run.np_gen, cuda=run.cuda)
    data = rank_part["data"] if data is None else data
    if "generator" in data:
        run.sampler.restore_generator(data)
        observed["numpy_data"] = run.sampler.next_draw()
    saved = rank_part.get("next_draws", {})
    differing = sorted(k for k in observed if k in saved and observed[k] != saved[k])
    if differing:
        raise RestoreCheckError("rng_restore", differing,
                                f"restored generators {differing} do not reproduce the draws observed at save time")


class RestoreCheckError(StateError):
    """A resume's own self-check failed (e.g. a restored generator does not reproduce its recorded next draw).

    The trainer reports it as a ``restore_check_failed`` event naming ``check`` before exiting 2, so the verifier
    can count it as a failed comparison (exit 1) rather than a verification that could not complete."""

    def __init__(self, check: str, differing: list[str], message: str) -> None:
        super().__init__(message)
        self.check, self.differing = check, differing


def _load(what: str, load: Any) -> None:
    try:
        load()
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, ConfigError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateError(f"the saved {what} state does not fit this task's {what}: {first}") from None


def _load_scaler(run: Run, scaler_state: dict[str, Any]) -> None:
    if run.scaler.is_enabled():
        if not scaler_state:
            raise StateError("the state has no GradScaler state but this run trains with AMP")
        _load("GradScaler", lambda: run.scaler.load_state_dict(scaler_state))
