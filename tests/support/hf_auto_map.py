"""``--task tests.support.hf_auto_map:factory``: examples/hf_llama.py whose model's config has ``auto_map`` (as a
custom model registered for the auto classes has), so its ``save_pretrained`` would write custom-code references."""

from __future__ import annotations

from typing import Any

from examples.hf_llama import factory as llama_factory

AUTO_MAP = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomLM"}


def factory(config: dict[str, Any]) -> Any:
    task = llama_factory(config)
    build = task._build_model

    def build_model() -> Any:
        model = build()
        model.config.auto_map = dict(AUTO_MAP)
        return model

    task._build_model = build_model
    return task
