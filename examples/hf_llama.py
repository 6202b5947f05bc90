"""A Hugging Face ``transformers`` causal LM (Llama) trained on Python's own standard library sources, offline.

What a fine-tuning run looks like, small enough for a CPU: a ``LlamaForCausalLM`` built from a ``LlamaConfig`` made in
code (nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported), a real
``PreTrainedTokenizerFast`` made offline (byte-level: token id = byte value, plus ``<|endoftext|>``), next-token
cross-entropy over fixed windows, AdamW with warm-up. ``transformers`` is an optional extra::

    pip install -e '.[hf]'        # in the checkout (scripts/dev.sh's test install has it too)
    export PYTHONPATH="$PWD"
    trainproof train  --store ./runs/llama --task examples.hf_llama:factory --max-steps 100
    trainproof verify --store ./runs/llama --task examples.hf_llama:factory --config examples/hf_llama-quick.json
    trainproof export --store ./runs/llama --task examples.hf_llama:factory

The export holds a Hugging Face directory (``exports/hf/step-%08d/``: ``config.json``, ``model.safetensors``, the
tokenizer files) that ``AutoModelForCausalLM.from_pretrained`` loads without trainproof.

Settings (``--config`` JSON, any :class:`HFLlamaConfig` field): the model's size, ``precision`` (``bf16``: bfloat16
autocast without a GradScaler, on the CPU too), and ``init_from``/``init_sha256`` to start from pretrained weights
(a safetensors file with this model's tensor names, e.g. an export's ``model.safetensors``, and its sha256; or a
Hugging Face model directory, e.g. an export's ``hf/step-N/``, and the digest ``trainproof digest`` prints for it;
local path, ``file://`` or ``s3://``). The data comes from :func:`token_ids`, a function that yields the token ids
of the training text: swap it for another source of token ids and the rest stays.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach for the network

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from examples.charlm import warmup_then_inverse_sqrt  # noqa: E402  (the same schedule as the char-level example)
from trainproof.tasks import PRECISIONS, DatasetTask, Pretrained, config_from_dict, require, sha256_of  # noqa: E402

TRAIN_FILES = ["bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "queue.py", "sched.py", "shlex.py",
               "textwrap.py"]
"""Default training text (about 87 kB of standard library sources, present in every CPython 3.10+)."""
EVAL_FILES = ["graphlib.py"]
"""Default held-out text for the export's evaluation."""
END_OF_TEXT = "<|endoftext|>"


@dataclass(kw_only=True)
class HFLlamaConfig:
    """Data, model and optimisation settings; the defaults train a 2-layer Llama of ~100k parameters on one CPU."""

    files: list[str] = field(default_factory=lambda: list(TRAIN_FILES))
    """Training files, relative to the standard library folder."""
    eval_files: list[str] = field(default_factory=lambda: list(EVAL_FILES))
    """Held-out files for the export's evaluation."""
    context: int = 64
    """Tokens per training window (each window predicts ``context`` next tokens)."""
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """Grouped-query attention: key/value heads (must divide num_attention_heads)."""
    tie_word_embeddings: bool = False
    batch_size: int = 16
    micro_batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    grad_clip: float = 1.0
    precision: str = "auto"
    """``auto`` (float16 autocast + GradScaler on CUDA, float32 on the CPU), ``bf16``, ``fp16`` or ``fp32``."""
    init_from: str = ""
    """Pretrained weights to start from (path, file:// or s3:// URL): a safetensors file (a name ending in
    ``.safetensors``) or a Hugging Face model directory (any other name); empty: seeded init."""
    init_sha256: str = ""
    """The file's plain sha256 (``sha256sum`` prints it) or the directory's digest (``trainproof digest`` prints it):
    required with ``init_from``, and part of the contract."""

    def __post_init__(self) -> None:
        require(len(self.files) >= 1 and len(self.eval_files) >= 1, "hf_llama: need at least one file and eval file")
        require(self.context >= 2, "hf_llama: context must be >= 2")
        require(self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads == 0,
                "hf_llama: hidden_size must be a multiple of num_attention_heads")
        require(self.num_key_value_heads >= 1 and self.num_attention_heads % self.num_key_value_heads == 0,
                "hf_llama: num_key_value_heads must divide num_attention_heads")
        require(self.num_hidden_layers >= 1 and self.intermediate_size >= 1, "hf_llama: layers and width >= 1")
        require(1 <= self.micro_batch_size <= self.batch_size, "hf_llama: need 1 <= micro_batch_size <= batch_size")
        require(self.lr > 0 and self.weight_decay >= 0 and self.warmup_steps >= 1 and self.grad_clip >= 0,
                "hf_llama: need lr > 0, weight_decay >= 0, warmup_steps >= 1, grad_clip >= 0")
        require(self.precision in PRECISIONS, f"hf_llama: precision must be one of {list(PRECISIONS)}")
        require(bool(self.init_from) == bool(self.init_sha256),
                "hf_llama: init_from and init_sha256 go together (`sha256sum FILE` prints a file's sha256, `trainproof "
                "digest DIR` a model directory's digest)")


def pretrained(url: str, declared: str) -> Pretrained:
    """A safetensors file (its sha256) when ``url`` names one, else a Hugging Face model directory (its digest)."""
    is_file = url.rstrip("/").endswith(".safetensors")
    return Pretrained(url=url, sha256=declared) if is_file else Pretrained(url=url.rstrip("/"), digest=declared)


# -- tokenizer and data -------------------------------------------------------------------------------------
def byte_alphabet() -> list[str]:
    """The 256 printable characters that stand for the bytes 0..255 in byte-level tokenizers (GPT-2's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` made offline: token id ``b`` is byte ``b`` (no merges), id 256 is
    ``<|endoftext|>``. Deterministic by construction, so the data identity covers it through its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())} | {END_OF_TEXT: 256}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   unk_token=None, model_max_length=1 << 20)


def read_sources(names: list[str]) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each standard-library file, in order."""
    root = os.path.dirname(os.__file__)
    for name in names:
        path = os.path.join(root, name)
        require(os.path.isfile(path), f"hf_llama: {path} does not exist (choose files of this Python's stdlib)")
        with open(path, "rb") as f:
            yield name, f.read()


def token_ids(names: list[str], tokenizer: Any, digests: list[tuple[str, str]]) -> Iterator[int]:
    """The token ids of the files, each followed by ``<|endoftext|>``; appends each file's (name, sha256) to
    ``digests``. The one place the data comes from: another source of token ids (a sharded dataset) plugs in here."""
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    for name, raw in read_sources(names):
        digests.append((name, hashlib.sha256(raw).hexdigest()))
        yield from tokenizer(raw.decode("utf-8"), add_special_tokens=False)["input_ids"]
        yield end


class TokenWindows(Dataset):
    """Non-overlapping windows of a token sequence: sample ``i`` is (input ids, next-token targets), ``(context,)``."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context
        self.count = (len(tokens) - 1) // context
        require(self.count >= 1, f"hf_llama: the text has {len(tokens)} tokens, fewer than context + 1")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.context : (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


# -- model and loss -----------------------------------------------------------------------------------------
def build_llama(cfg: HFLlamaConfig, vocab_size: int) -> nn.Module:
    """A ``LlamaForCausalLM`` from a config made in code; its initialisation draws from torch's global generator,
    which the trainer seeds (and which pretrained weights then overwrite, on a fresh start)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.context,
                         tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=256, eos_token_id=256,
                         pad_token_id=None, use_cache=False)
    return LlamaForCausalLM(config)


def per_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of every next token, unreduced ``(B, context)``, from the model's logits (at least float32, so
    bf16/fp16 autocast logits do not lose digits in the softmax)."""
    inputs, targets = batch
    logits = model(input_ids=inputs, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="none").view(targets.shape)


def factory(config: dict[str, Any]) -> DatasetTask:
    """``--task examples.hf_llama:factory``: the task for ``config`` (any :class:`HFLlamaConfig` fields)."""
    cfg = config_from_dict(HFLlamaConfig, config)
    tokenizer = make_tokenizer()
    digests: list[tuple[str, str]] = []
    train = torch.tensor(list(token_ids(cfg.files, tokenizer, digests)), dtype=torch.long)
    held_out = torch.tensor(list(token_ids(cfg.eval_files, tokenizer, digests)), dtype=torch.long)
    vocab_size = len(tokenizer)
    return DatasetTask(
        dataset=TokenWindows(train, cfg.context), eval_dataset=TokenWindows(held_out, cfg.context),
        build_model=lambda: build_llama(cfg, vocab_size), per_sample_loss=per_token_loss,
        targets_per_sample=cfg.context, config=asdict(cfg),
        data_identity=sha256_of("hf-llama-stdlib-v1", digests, tokenizer.backend_tokenizer.to_str(), cfg.context),
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        optimizer="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, optimizer_options={"betas": [0.9, 0.95]},
        lr_schedule=warmup_then_inverse_sqrt(cfg.warmup_steps), grad_clip=cfg.grad_clip or None,
        objective="token_mean_v1", eval_metric="heldout_token_loss", default_steps=100, cpu_threads=1,
        precision=cfg.precision, tokenizer=tokenizer,
        pretrained=[pretrained(cfg.init_from, cfg.init_sha256)] if cfg.init_from else [],
    )
