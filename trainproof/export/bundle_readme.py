"""The export bundle's README.md: what each file holds, how to check it, and a snippet that loads the model and
reproduces the recorded metric with only ``torch`` and ``safetensors`` installed (no trainproof)."""

from __future__ import annotations

from trainproof.export.standalone import EVAL_DATA_FILE, MODEL_FILE, PROGRAM_FILE, PROGRAM_INPUTS_FILE, STANDALONE_RTOL

INSTALL = ("a checkout of its repository\n(`bash scripts/dev.sh ...`, or `pip install -e .` in it) or its container "
           "image (`docker build -t trainproof:local .`\nin the checkout)")
"""Where trainproof comes from: never the public package index, where the name ``trainproof`` belongs to another
project."""

SNIPPET = """\
import json, torch
from safetensors.torch import load_file
import model as bundle  # model.py, next to this README

config, metrics = json.load(open("config.json")), json.load(open("metrics.json"))
torch.set_num_threads(metrics["eval"]["threads"])  # the thread count of the recorded evaluation
net = bundle.build_model(config)
net.load_state_dict(load_file("model.safetensors"))
value = bundle.evaluate(net, load_file("eval_data.safetensors"))
print(metrics["eval"]["metric"], value, "recorded:", metrics["eval"]["value"])
"""

PROGRAM_SNIPPET = """\
import torch
from safetensors.torch import load_file

program = torch.export.load("model.pt2")  # the traced model: no Python source of it needed
example = load_file("program_inputs.safetensors")
args = [example[f"arg_{i}"] for i in range(len(example) - 1)]
output = program.module()(*args)
print("max |output - recorded|:", float((output - example["output"]).abs().max()))
"""


HF_SNIPPET = """\
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{folder}")  # a local copy of that folder
"""


def readme(*, metric_name: str, metric: float, fp_name: str, bf16_names: list[str], has_model_py: bool,
           program_note: str | None, has_plot: bool, hf_folder: str | None = None, hf_eval: bool = False,
           others: dict[str, float] | None = None) -> str:
    """The bundle's README.md (``hf_folder``: where the Hugging Face directory of a ``transformers`` model lies,
    relative to the bundles' folder; ``hf_eval``: the bundle holds ``hf_eval.py`` and its data; ``others``: the
    task's other metrics of the same evaluation)."""
    also = "".join(f", {name} {value:.6g}" for name, value in (others or {}).items())
    rows = [
        (", ".join(f"`{n}`" for n in bf16_names), "model weights, floating tensors in bfloat16"),
        (f"`{fp_name}`", "the same weights in full precision"),
        ("`config.json`", "task, task settings (`task_config`), dtype, "
                          "seed, run contract, source generation, versions"),
        ("`metrics.json`", f"final loss, evaluation ({metric_name} {metric:.6g}{also} "
                           "in full precision), steps, samples seen"),
        ("`data.json`", "data identity (sha256) and data position"),
    ]
    if has_model_py:
        rows.append((f"`{MODEL_FILE}`", "the architecture and the evaluation in "
                                        "plain torch (`build_model`, `evaluate`)"))
        rows.append((f"`{EVAL_DATA_FILE}`", "the exact batches of the recorded evaluation"))
    traced = bool(program_note and program_note.startswith("traced"))
    if traced:
        rows.append((f"`{PROGRAM_FILE}`", f"a `torch.export` program of the model ({program_note})"))
        rows.append((f"`{PROGRAM_INPUTS_FILE}`", "an input it was traced on (`arg_0`, ...) and the model's `output`"))
    if has_plot:
        rows.append(("`loss.png`", "the training loss per step"))
    if hf_eval:
        rows.append(("`hf_eval.py`, `hf_eval_data.safetensors`", "the held-out evaluation over the Hugging Face "
                                                                 "directory's model, and its batches"))
    rows.append(("`SHA256SUMS`", "checksums: `sha256sum -c SHA256SUMS`"))
    table = "\n".join(f"| {name} | {holds} |" for name, holds in rows)
    if has_model_py:
        load = f"""In a virtualenv with only `torch` and `safetensors` (`pip install torch safetensors`; no trainproof
needed), from this folder: it rebuilds the model from `config.json`, loads the full-precision weights and
re-runs the evaluation, which matches `metrics.json` within a relative {STANDALONE_RTOL:g} (exactly with the same
torch release and thread count).

```python
{SNIPPET}```

For the bfloat16 weights, load `model_bf16.safetensors` instead: `load_state_dict` casts them back to the
model's dtype (the metric then moves within `metrics.json`'s `bf16_tolerance`)."""
    elif traced:
        load = f"""This task's architecture is not known to the exporter, so there is no `model.py`;
`{PROGRAM_FILE}` runs the model without its code. In a virtualenv with only `torch` and `safetensors`, from this
folder (the difference is 0 with the same torch release and thread count; which input shapes the program
accepts is in the table above: with a dynamic batch, any number of rows):

```python
{PROGRAM_SNIPPET}```

To train further or evaluate, rebuild the model with the task's own code (`config.json` names it and its
settings) and load `{fp_name}` with `safetensors.torch.load_file`."""
    elif hf_folder:
        load = ("The model is a `transformers` model: load it from its Hugging Face directory (below), or rebuild it "
                f"with the task's own code (`config.json` names it and its settings) and load `{fp_name}`.")
    else:
        load = ("This task's architecture is not known to the exporter, so there is no `model.py`, and "
                f"`torch.export` could not trace it ({program_note}): rebuild the model with the task's own code "
                f"(`config.json` names it and its settings) and load `{fp_name}` with `safetensors.torch.load_file`.")
    if hf_folder:
        load += hf_section(hf_folder, hf_eval)
    return f"""# trainproof export bundle

| file | holds |
|---|---|
{table}

`COMPLETE.json` (written last) lists every file's size and sha256: the bundle is usable iff it exists.

## Load it

{load}

trainproof itself (to train, verify or export more) comes from {INSTALL}.
The package named `trainproof` on the public package index is another project.
"""


def hf_section(folder: str, hf_eval: bool) -> str:
    """The README's paragraph on the Hugging Face directory of a ``transformers`` model."""
    text = f"""

## Hugging Face

The model is a `transformers` model: `../{folder}/` (beside this bundle's folder, committed before it; `config.json`
lists each of its files with its sha256 under `hf`) is a Hugging Face directory: `config.json`, the weights
(`model.safetensors`, or shards with `model.safetensors.index.json`), the tokenizer files. With `transformers`
installed and no trainproof:

```python
{HF_SNIPPET.format(folder="../" + folder)}```"""
    if hf_eval:
        text += f"""

`python hf_eval.py ../{folder}` (from this folder) loads it that way and re-runs the held-out evaluation, printing
the value `metrics.json` records under `hf` (exactly, with the same torch release and thread count)."""
    return text
