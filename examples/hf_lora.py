"""LoRA fine-tuning of a Hugging Face Llama with ``peft``, from a published (sharded) model directory, offline.

What most fine-tuning runs look like, small enough for a CPU: a model directory as published (``config.json``,
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, the tokenizer's files) that this example
writes for itself (``python -m examples.hf_lora write-base DIR``: a seeded ``LlamaForCausalLM`` as in
examples/hf_llama.py, saved with ``save_pretrained(max_shard_size=...)``; nothing is downloaded), LoRA adapters on its
attention projections (``peft.get_peft_model``: the base's parameters are frozen, ``requires_grad=False``, and only
the adapters train), bf16 autocast. ``peft`` and ``transformers`` are optional extras::

    pip install -e '.[hf]'        # transformers, tokenizers, peft (scripts/dev.sh's test install has them too)
    export PYTHONPATH="$PWD"
    python -m examples.hf_lora write-base ./models/llama-base
    trainproof digest ./models/llama-base        # prints the directory's digest, for init_sha256
    trainproof train --store ./runs/lora --task examples.hf_lora:factory --config lora.json --max-steps 40

(``lora.json``: ``{"init_from": "./models/llama-base", "init_sha256": "<the digest>"}``; docs/tasks.md "Fine-tuning a
published model with LoRA" has every step.) The base directory is loaded into the ``peft`` model by its published
names (:func:`trainproof.tasks.peft_base_name`: ``base_model.model.X.base_layer.weight`` is the base's ``X.weight``);
the adapters keep their seeded initialisation (``lora_B`` zero: the run starts at the base's own loss). The export
writes the adapter (``exports/hf-adapter/step-N/``: ``adapter_config.json``, ``adapter_model.safetensors``, what
``PeftModel.from_pretrained(base, folder)`` loads) and the merged model (``exports/hf/step-N/``, what
``AutoModelForCausalLM.from_pretrained`` loads).

Settings (``--config`` JSON): every :class:`examples.hf_llama.HFLlamaConfig` field (the defaults here are its quick,
bf16 ones) and the adapters' ``lora_r``, ``lora_alpha``, ``lora_dropout`` and ``lora_targets``; ``base_shards``
(write-base only: how many weights files the base directory gets).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach for the network

import torch  # noqa: E402
from torch import nn  # noqa: E402

from examples.charlm import warmup_then_inverse_sqrt  # noqa: E402
from examples.hf_llama import (  # noqa: E402
    HFLlamaConfig,
    TokenWindows,
    build_llama,
    make_tokenizer,
    per_token_loss,
    pretrained,
    token_ids,
)
from trainproof.tasks import DatasetTask, config_from_dict, peft_base_name, require, sha256_of  # noqa: E402

BASE_SEED = 1234
"""The seed of the base model ``write-base`` makes (a stand-in for a published model's weights)."""


@dataclass(kw_only=True)
class HFLoraConfig(HFLlamaConfig):
    """The Llama's settings (small: one file of text, a 32-wide model) and the adapters'."""

    files: list[str] = field(default_factory=lambda: ["colorsys.py"])
    eval_files: list[str] = field(default_factory=lambda: ["bisect.py"])
    hidden_size: int = 32
    intermediate_size: int = 64
    batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-2
    warmup_steps: int = 5
    precision: str = "bf16"
    lora_r: int = 4
    """The adapters' rank."""
    lora_alpha: int = 8
    """Their scale is lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """The Linear layers (by name) that get adapters."""
    base_shards: int = 3
    """``write-base``: the weights files of the base directory (``save_pretrained``'s ``max_shard_size`` is chosen
    for it). Not part of a training run's settings (it is left out of the task's config)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.lora_r >= 1 and self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
                "hf_lora: need lora_r >= 1, lora_alpha > 0, 0 <= lora_dropout < 1")
        require(len(self.lora_targets) >= 1, "hf_lora: lora_targets names at least one layer, e.g. q_proj")
        require(self.base_shards >= 1, "hf_lora: base_shards must be >= 1")


def build_lora(cfg: HFLoraConfig, vocab_size: int) -> nn.Module:
    """The base Llama (seeded, then overwritten by the base directory on a fresh start) with LoRA adapters: a
    ``PeftModelForCausalLM`` whose base parameters are frozen."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(build_llama(cfg, vocab_size), lora)


def factory(config: dict[str, Any]) -> DatasetTask:
    """``--task examples.hf_lora:factory``: the task for ``config`` (any :class:`HFLoraConfig` fields)."""
    cfg = config_from_dict(HFLoraConfig, config)
    tokenizer = make_tokenizer()
    digests: list[tuple[str, str]] = []
    train = torch.tensor(list(token_ids(cfg.files, tokenizer, digests)), dtype=torch.long)
    held_out = torch.tensor(list(token_ids(cfg.eval_files, tokenizer, digests)), dtype=torch.long)
    vocab_size = len(tokenizer)
    settings = {k: v for k, v in asdict(cfg).items() if k != "base_shards"}
    return DatasetTask(
        dataset=TokenWindows(train, cfg.context), eval_dataset=TokenWindows(held_out, cfg.context),
        build_model=lambda: build_lora(cfg, vocab_size), per_sample_loss=per_token_loss,
        targets_per_sample=cfg.context, config=settings,
        data_identity=sha256_of("hf-llama-stdlib-v1", digests, tokenizer.backend_tokenizer.to_str(), cfg.context),
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        optimizer="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, optimizer_options={"betas": [0.9, 0.95]},
        lr_schedule=warmup_then_inverse_sqrt(cfg.warmup_steps), grad_clip=cfg.grad_clip or None,
        objective="token_mean_v1", eval_metric="heldout_token_loss", default_steps=40, cpu_threads=1,
        precision=cfg.precision, tokenizer=tokenizer,
        pretrained=[pretrained(cfg.init_from, cfg.init_sha256)] if cfg.init_from else [],
        pretrained_name=peft_base_name,
    )


def write_base(folder: str, config: dict[str, Any]) -> list[str]:
    """A published-style model directory at ``folder`` for the config's model: the seeded base Llama in float32,
    ``save_pretrained`` in ``base_shards`` weights files with the index, and the tokenizer's files. Returns its
    files' names."""
    cfg = config_from_dict(HFLoraConfig, {k: v for k, v in config.items() if k not in ("init_from", "init_sha256")})
    require(not os.path.exists(folder) or not os.listdir(folder), f"hf_lora: {folder} exists and is not empty")
    tokenizer = make_tokenizer()
    torch.manual_seed(BASE_SEED)
    model = build_llama(cfg, len(tokenizer))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=max(total // cfg.base_shards + 1, largest), safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sorted(os.listdir(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.hf_lora", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    base = sub.add_parser("write-base", help="write the sharded base model directory the LoRA run starts from")
    base.add_argument("folder")
    base.add_argument("--config", help="a JSON file of HFLoraConfig settings (the model's size must be the run's)")
    args = parser.parse_args(argv)
    config = {}
    if args.config:
        with open(args.config) as fh:
            config = json.load(fh)
    files = write_base(args.folder, config)
    print(json.dumps({"folder": args.folder, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
