"""What lets anyone load an export bundle with nothing but ``torch`` and ``safetensors``: a self-contained
``model.py`` (the task's architecture and evaluation in plain torch) and ``eval_data.safetensors`` (the exact
evaluation batches), plus, for any model ``torch.export`` can trace, ``model.pt2`` (a program that runs without
any Python source of the model).

``model.py`` is written by the exporter for the tasks it knows: ``regression``, ``tinylm`` and
``examples.charlm:factory``. The architecture is the task's own class source (``inspect.getsource``), not a
copy kept by hand, so it cannot drift from what was trained; the bundle's README test runs it in an
interpreter that cannot import ``job`` and checks it reproduces ``metrics.json``. Every ``model.py`` defines::

    build_model(config: dict) -> nn.Module          # config: the bundle's config.json
    evaluate(model, data: dict[str, Tensor]) -> float   # data: eval_data.safetensors; reproduces metrics.json

Other tasks get no ``model.py`` (their README says so) and rely on ``model.pt2`` where tracing works; its batch
dimension is dynamic where the model allows (any batch size from 1), else the traced shapes only.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import textwrap
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from trainproof.tasks import Task
from trainproof.tasks.batches import evaluation_generators

log = logging.getLogger("trainproof.export")

MODEL_FILE, EVAL_DATA_FILE, PROGRAM_FILE = "model.py", "eval_data.safetensors", "model.pt2"
PROGRAM_INPUTS_FILE = "program_inputs.safetensors"
STANDALONE_RTOL = 1e-6
"""What a consumer's re-evaluation must match (relative to ``metrics.json``). The same torch release and thread
count give the same bits (the bundle test finds an exact match); another CPU or torch build may round float32
reductions differently, which moves a loss of this size by well under 1e-6 relative."""

_HEADER = '''"""Plain-torch model and evaluation of this export bundle (written by trainproof's exporter; no trainproof
import). build_model(config) rebuilds the architecture from config.json; evaluate(model, data) re-runs the
evaluation recorded in metrics.json on the batches of eval_data.safetensors."""

from __future__ import annotations  # the class sources below annotate with names this file does not define

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

'''


@dataclass(kw_only=True)
class Standalone:
    """The bundle files of one task: ``model.py`` source, evaluation batches, arguments beyond task_config."""

    source: str
    eval_data: dict[str, torch.Tensor]
    model_args: dict[str, Any]


# -- per task ---------------------------------------------------------------------------------------------
_REGRESSION = '''
def build_model(config):
    """nn.Sequential(Linear(2, hidden), Tanh, Dropout, Linear(hidden, 1)) in the bundle's dtype."""
    c = config["task_config"]
    model = nn.Sequential(nn.Linear(2, c["hidden"]), nn.Tanh(), nn.Dropout(c["dropout"]), nn.Linear(c["hidden"], 1))
    return model.to(getattr(torch, config["dtype"]))


def evaluate(model, data):
    """Mean squared error over the clean rows (no gain, no noise), dropout off."""
    model.eval()
    with torch.no_grad():
        return float(((model(data["x"]) - data["y"]) ** 2).mean())
'''

_TOKEN_LOSS = '''

def evaluate(model, data):
    """Token-mean cross-entropy over the held-out batches (summed per batch in float32, accumulated in float64)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len([k for k in data if k.startswith("inputs_")])):
            inputs, targets = data[f"inputs_{i:04d}"], data[f"targets_{i:04d}"]
            logits = model({call})
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                                   reduction="sum")
            total += float(loss.double())
            count += int((targets != -100).sum())
    return total / count
'''


def _class_sources(module: Any, *names: str) -> str:
    return "\n\n".join(textwrap.dedent(inspect.getsource(getattr(module, n))) for n in names)


def _regression(task: Task, _model: nn.Module) -> Standalone:
    return Standalone(source=_HEADER + _REGRESSION.lstrip("\n"), model_args={},
                      eval_data={"x": task.x.contiguous(), "y": task.y.contiguous()})  # type: ignore[attr-defined]


def _tinylm(task: Task, _model: nn.Module) -> Standalone:
    from trainproof.tasks import tinylm

    cfg = task.cfg  # type: ignore[attr-defined]
    # The held-out slice exactly as TinyLMTask.evaluate builds it.
    heldout = tinylm.make_corpus(replace(cfg, corpus_seed=cfg.corpus_seed + 1,
                                         n_sequences=max(8, cfg.n_sequences // 4)))
    data: dict[str, torch.Tensor] = {}
    for i, start in enumerate(range(0, len(heldout), cfg.micro_batch_size)):
        batch = tinylm._pad(heldout[start : start + cfg.micro_batch_size], torch.device("cpu"))
        data.update({f"{k}_{i:04d}": v.contiguous() for k, v in batch.items()})
    source = (_HEADER + _class_sources(tinylm, "CausalSelfAttention", "Block", "TinyLM") + "\n\n"
              "def build_model(config):\n"
              '    """TinyLM from config.json\'s task_config."""\n'
              '    return TinyLM(SimpleNamespace(**config["task_config"])).to(getattr(torch, config["dtype"]))\n'
              + _TOKEN_LOSS.replace("{call}", 'inputs, data[f"key_real_{i:04d}"]'))
    return Standalone(source=source, eval_data=data, model_args={})


def _charlm(task: Task, model: nn.Module) -> Standalone:
    charlm = importlib.import_module("examples.charlm")
    ds, micro = task.eval_dataset, task.micro_batch_size  # type: ignore[attr-defined]
    data: dict[str, torch.Tensor] = {}
    for i, start in enumerate(range(0, len(ds), micro)):
        windows = [ds[j] for j in range(start, min(start + micro, len(ds)))]
        data[f"inputs_{i:04d}"] = torch.stack([w[0] for w in windows]).contiguous()
        data[f"targets_{i:04d}"] = torch.stack([w[1] for w in windows]).contiguous()
    source = (_HEADER + _class_sources(charlm, "CharTransformer") + "\n\n"
              "def build_model(config):\n"
              '    """CharTransformer from config.json (vocab_size: the characters of the training text)."""\n'
              '    cfg = SimpleNamespace(**config["task_config"])\n'
              '    model = CharTransformer(config["model_args"]["vocab_size"], cfg)\n'
              '    return model.to(getattr(torch, config["dtype"]))\n'
              + _TOKEN_LOSS.replace("{call}", "inputs"))
    return Standalone(source=source, eval_data=data, model_args={"vocab_size": int(model.tok.num_embeddings)})


WRITERS: dict[str, Callable[[Task, nn.Module], Standalone]] = {
    "regression": _regression, "tinylm": _tinylm, "examples.charlm:factory": _charlm,
}
"""Task spec (as in plan.json) -> the writer of its ``model.py`` and evaluation data."""


def standalone(spec: str, task: Task) -> Standalone | None:
    """The standalone files of task ``spec``, or None when the exporter does not know its architecture."""
    writer = WRITERS.get(spec)
    return None if writer is None else writer(task, task.build_model())


# -- torch.export -----------------------------------------------------------------------------------------
def export_program(task: Task, weights: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor], str]:
    """``model.pt2``: the model holding ``weights``, traced by ``torch.export`` on the first input of its evaluation.

    Returns (the ``torch.export.ExportedProgram``, for ``torch.export.save``; example, note): ``example`` holds that
    input (``arg_0``, ``arg_1``, ...) and the model's
    output on it (``output``), for ``program_inputs.safetensors``. (None, {}, why) when the model cannot be traced
    with positional tensor inputs and a tensor output (the bundle is still complete without it).
    """
    captured: list[tuple[tuple, dict]] = []

    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not captured:
            captured.append((args, kwargs))

    with evaluation_generators():  # as the export's evaluation draws (trainproof.export.bundle.evaluate_weights)
        model = task.build_model().to(dtype=task.dtype)
        model.load_state_dict(weights)  # copied (and cast) tensor by tensor into the model's own
        handle = model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            task.evaluate(model)  # only to see what the model is called with
        except NotImplementedError as exc:
            return None, {}, f"not traced: {exc}"
        finally:
            handle.remove()
    if not captured:
        return None, {}, "not traced: the evaluation never called the model"
    args, kwargs = captured[0]
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return None, {}, "not traced: the model takes keyword or non-tensor inputs"
    args = tuple(a.detach().cpu() for a in args)
    try:
        model.eval()
        with torch.no_grad():
            output = model(*args)
        if not isinstance(output, torch.Tensor):
            return None, {}, "not traced: the model's output is not one tensor"
        program, dynamic = _export_batch_dynamic(model, args)
    except Exception as exc:  # noqa: BLE001  (any tracing failure only means: no model.pt2)
        log.info("no %s: torch.export could not trace the model (%s)", PROGRAM_FILE, type(exc).__name__)
        return None, {}, f"not traced: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    example = {f"arg_{i}": a.contiguous() for i, a in enumerate(args)} | {"output": output.detach().contiguous()}
    shapes = [list(a.shape) for a in args]
    if dynamic:
        return program, example, (f"traced with torch.export on input shapes {shapes}, the first dimension (the "
                                  "batch) dynamic: any batch size from 1 runs")
    return program, example, f"traced with torch.export on input shapes {shapes} (static shapes: these only)"


def _export_batch_dynamic(model: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[Any, bool]:
    """``torch.export.export`` of ``model`` on ``args`` with their first dimension (the batch, the same size in every
    input) dynamic from 1 up, when the model allows it; otherwise with static shapes. Returns (program, dynamic)."""
    sizes = {a.shape[0] for a in args if a.dim() >= 1}
    if len(sizes) == 1 and all(a.dim() >= 1 for a in args):
        batch = torch.export.Dim("batch", min=1)
        try:
            return torch.export.export(model, args, dynamic_shapes=tuple({0: batch} for _ in args)), True
        except Exception as exc:  # noqa: BLE001  (a model that fixes its batch, e.g. by a reshape: static then)
            log.info("%s: the batch dimension cannot be dynamic (%s); static shapes", PROGRAM_FILE,
                     type(exc).__name__)
    return torch.export.export(model, args), False
