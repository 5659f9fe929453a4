"""`hf-fedtask/tiny-llama`: a small randomly initialised `LlamaForCausalLM` (2 layers, width 64) with a
byte-level BPE tokenizer and SmolLM2's chat template, built offline and seeded. It runs every causal-LM
code path in seconds, so tests and quick checks need not load the real SmolLM2; accuracy claims need
the real model (`hf_fedtask.model.embedded_llm`).

The tokenizer is trained by `tokenizers` on a fixed text (the chat template's words and the builtin
tasks' label words and questions), so it is the same on every machine; byte-level, so any input text
(kaomoji, accents) encodes.
"""

from __future__ import annotations

from pathlib import Path

from hf_fedtask.core.files import built_once

TINY_LLAMA = "hf-fedtask/tiny-llama"
BUILDER_VERSION = "v3"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-Instruct's chat template (ChatML with a default system turn)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
               # 10x transformers' default: at 0.02 a 2-layer random model passes LoRA's change on too faintly
               # to learn a task in a test's few steps; at 0.2 it does
               "initializer_range": 0.2}


def _corpus() -> list[str]:
    from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS

    # the template's fixed text, weighted so that BPE merges it into few tokens (short prompts, fast tests)
    texts = 50 * ["You are a helpful AI assistant named SmolLM, trained by Hugging Face", "system user assistant",
                  "Answer with one of:"]
    for task in BUILTIN_TASKS.values():
        texts += [task.description, " ".join(task.labels)]
    return texts


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def materialize(cache_root: Path, seed: int = 0) -> Path:
    """The folder of `hf-fedtask/tiny-llama` (config, seeded weights, tokenizer) under `cache_root`,
    written once (`built_once`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(tmp: Path) -> None:
        tokenizer = _tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **LLAMA_SHAPE)
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return built_once(cache_root / "models" / f"tiny-llama-{BUILDER_VERSION}-seed{seed}", build)
