"""PEFT modules by short name. One place maps `--peft-method` to a `peft.PeftConfig`, so clients,
export and validation agree on the exact module shapes."""

from __future__ import annotations

from peft import IA3Config, LoraConfig, PeftConfig, PrefixTuningConfig, PromptTuningConfig, TaskType

from .errors import ConfigError

PEFT_METHODS = ("lora", "ia3", "prompt", "prefix")


def make_peft_config(
    method: str = "lora",
    *,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    num_virtual_tokens: int = 20,
) -> PeftConfig:
    """A SEQ_CLS PEFT config; the classification head joins `modules_to_save` automatically.
    `target_modules=None` takes PEFT's per-architecture defaults (query/value for BERT)."""
    if method == "lora":
        return LoraConfig(
            task_type=TaskType.SEQ_CLS, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules
        )
    if method == "ia3":
        return IA3Config(task_type=TaskType.SEQ_CLS, target_modules=target_modules)
    if method == "prompt":
        return PromptTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=num_virtual_tokens)
    if method == "prefix":
        return PrefixTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=num_virtual_tokens)
    raise ConfigError(f"unknown peft_method {method!r}; choose one of {', '.join(PEFT_METHODS)}")
