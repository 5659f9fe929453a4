"""Quantized bases (QLoRA, Dettmers et al., 2023, arXiv:2305.14314): the frozen base model loaded in
4-bit (NF4 with double quantization by default, as QLoRA; FP4 and single quantization on request) or 8-bit
through bitsandbytes, LoRA modules trained in fp32 on top. Task vectors, uploads
and exports are the LoRA parameters only, so an exported adapter is an ordinary adapter over the
unquantized base id."""

from __future__ import annotations

import importlib.util

import torch

from hf_fedtask.errors import ConfigError
from hf_fedtask.model.host import HEAD_MODULES  # kept in full precision: the heads are trained and exported

# what stays unquantized: the classification heads, and a causal LM's output layer (`lm_head`, which shares
# its weight with the input embeddings in tied models such as SmolLM2: a given skip list replaces
# transformers' own, which would name it, and bitsandbytes fails on a tied 4-bit lm_head)
SKIP_MODULES = sorted(HEAD_MODULES | {"lm_head"})


def quantization_config(load_in_4bit: bool, load_in_8bit: bool, *, peft_method: str, device: torch.device,
                        mixed_precision: str = "no", quant_type: str = "nf4", double_quant: bool = True):
    """transformers' `BitsAndBytesConfig` for the requested bits (4-bit: `quant_type` nf4|fp4, `double_quant`),
    or None; refused with one line where the PEFT method is not LoRA, bitsandbytes is not installed, or the
    model is not on a CUDA device."""
    if not (load_in_4bit or load_in_8bit):
        return None
    flag = "load_in_4bit" if load_in_4bit else "load_in_8bit"
    if peft_method != "lora":
        raise ConfigError(f"{flag}: a quantized base trains LoRA modules only (QLoRA); peft_method is {peft_method!r}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{flag}: needs the bitsandbytes package (pip install bitsandbytes), which is not installed")
    if device.type != "cuda":
        raise ConfigError(f"{flag}: bitsandbytes quantization runs on a CUDA device; the model is on {device}")
    from transformers import BitsAndBytesConfig

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    if load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                  bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute,
                                  llm_int8_skip_modules=SKIP_MODULES)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=SKIP_MODULES)
