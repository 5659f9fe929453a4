"""Builders from a `RunConfig` to the run's parts, shared by the simulator and the reference recipe."""

from __future__ import annotations

from hf_fedtask.model.backbone import BaseModelRef, input_kind, resolve_base_model
from hf_fedtask.client.trainer import LocalTrainer, LocalTrainingArgs
from hf_fedtask.config import RunConfig
from hf_fedtask.model.host import PeftHost
from hf_fedtask.model.peft_methods import make_peft_config


def build_host(config: RunConfig) -> PeftHost:
    """The one in-memory PEFT model a run uses, from the config's model keys; the base model's
    architecture decides the modality (text or image) and so the PEFT head settings."""
    base = resolve_base_model(config.base_model, config.base_model_id)
    peft_config = make_peft_config(
        config.peft_method,
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
        num_virtual_tokens=config.num_virtual_tokens,
        modality=input_kind(base).modality,
        backbone=backbone_name(base) if config.peft_method == "full" else None,
    )
    return PeftHost(base, peft_config, seed=config.seed, max_length=config.max_length)


def backbone_name(base: BaseModelRef) -> str:
    """The classifier's attribute holding the pretrained trunk (`bert`, `vit`, ...), from its class."""
    import transformers
    from transformers.models.auto import modeling_auto

    model_type = transformers.AutoConfig.from_pretrained(base.load_path).model_type
    names = (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if input_kind(base).modality == "text"
             else modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
    return getattr(transformers, names[model_type]).base_model_prefix


def build_trainer(host: PeftHost, config: RunConfig) -> LocalTrainer:
    """The local-training recipe from the config's optimizer keys."""
    return LocalTrainer(
        host,
        LocalTrainingArgs(
            epochs=config.local_epochs,
            max_steps=config.local_steps,
            batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            lr_scheduler=config.lr_scheduler,
            warmup_steps=config.warmup_steps,
            weight_decay=config.weight_decay,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        ),
    )
