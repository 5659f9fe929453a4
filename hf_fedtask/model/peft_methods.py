"""PEFT modules by short name. One place maps `--peft-method` to a `peft.PeftConfig`, so clients,
export and validation agree on the exact module shapes."""

from __future__ import annotations

from peft import (
    IA3Config,
    LoraConfig,
    PeftConfig,
    PrefixTuningConfig,
    PromptTuningConfig,
)
from peft.utils.constants import DUMMY_TARGET_MODULES

from hf_fedtask.errors import ConfigError
from hf_fedtask.model.backbone import INPUT_KINDS, PEFT_METHODS
from hf_fedtask.model.bottleneck import BottleneckConfig


def make_peft_config(
    method: str = "lora",
    *,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    num_virtual_tokens: int = 20,
    modality: str = "text",
    backbone: str | None = None,
) -> PeftConfig:
    """A PEFT config whose `modules_to_save` holds the classification head: text models use PEFT's
    SEQ_CLS task type (which adds the head itself), image models name their `classifier` explicitly,
    and a causal LM (`modality="causal_lm"`, the input kind) has PEFT's CAUSAL_LM type and no head.
    `target_modules=None` takes PEFT's per-architecture defaults (query/value for BERT); PEFT has
    none for ViT, whose query/value projections transformers 5 names q_proj/v_proj. "bottleneck" is
    hf_fedtask's Houlsby adapter (`hf_fedtask.model.bottleneck`), `r` its bottleneck width; its defaults
    cover BERT-like models and ViT. "full" trains the whole `backbone` (the classifier's trunk
    attribute, e.g. "bert") as a module to save beside the head, in a LoRA config whose target is
    PEFT's dummy `target_modules` (no LoRA layer): full-update training that loads with stock PEFT.
    "probe" trains the head alone over the frozen backbone (linear probing, F²L²'s FM-LP): the same
    dummy-target config with only the head to save, so no module is shared."""
    if modality not in INPUT_KINDS:
        raise ConfigError(f"unknown modality {modality!r}; choose one of {', '.join(INPUT_KINDS)}")
    head = INPUT_KINDS[modality].peft_head
    if method == "lora":
        return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules, **head)
    if method == "ia3":
        return IA3Config(target_modules=target_modules, **head)
    if method == "bottleneck":
        return BottleneckConfig(bottleneck_dim=r, target_modules=target_modules, **head)
    if method == "full":
        if not backbone:
            raise ConfigError("peft_method 'full' needs the base model's backbone name (e.g. backbone='bert')")
        modules = [backbone, *head.get("modules_to_save", [])]
        return LoraConfig(target_modules=DUMMY_TARGET_MODULES, **{**head, "modules_to_save": modules})
    if method == "probe":
        return LoraConfig(target_modules=DUMMY_TARGET_MODULES, **head)
    if method in ("prompt", "prefix") and modality == "image":
        raise ConfigError(
            f"peft_method {method!r} prepends virtual tokens and needs a text model; use lora, ia3 or bottleneck"
        )
    if method == "prompt":
        return PromptTuningConfig(num_virtual_tokens=num_virtual_tokens, **head)
    if method == "prefix":
        return PrefixTuningConfig(num_virtual_tokens=num_virtual_tokens, **head)
    raise ConfigError(f"unknown peft_method {method!r}; choose one of {', '.join(PEFT_METHODS)}")
