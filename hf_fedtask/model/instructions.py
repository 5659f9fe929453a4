"""Classification tasks as instructions for a causal LM: each example rendered through the tokenizer's
chat template, answered by its label's word (the *verbalizer*), trained with the loss on the answer
tokens only and scored as lm-evaluation-harness scores multiple-choice tasks.

- **Prompt**: one user turn, `instruction` + "Answer with one of: <words>." + the input, through
  `tokenizer.apply_chat_template(..., add_generation_prompt=True)`: exactly what
  `pipeline("text-generation")` sends when given the same user message, so an exported adapter answers
  a stock pipeline as it was trained. `prompt_template` writes the template out for model cards.
- **Training**: prompt + answer word + the template's end-of-turn token; the labels of the prompt
  and of padding are -100, so the causal-LM loss is the answer's alone (`AnswerOnlyCollator`).
  Batches are bucketed by length by the Trainer (`group_by_length`).
- **Scoring**: the prediction is the label whose word has the highest log-likelihood after the prompt
  (Σ log p over the word's tokens, lm-evaluation-harness's `loglikelihood` of each choice). The prompt
  is run once and every choice's tokens continue from its cached keys and values; a model that
  cannot continue a cache (a linearized model, prompt or prefix tuning) scores each prompt + choice
  sequence whole, which gives the same numbers. `generate_answers` is greedy generation, for exact
  match.
- **Free-text tasks** (prompt/response rows, `Task.free_text`): the prompt is the instruction, if any, and
  the input; the answer is the response's tokens and the end-of-turn token, trained with the same
  answer-only loss. They are scored on the reference answers, teacher-forced, in one forward pass:
  each example's correct greedy tokens, answer tokens and summed negative log-likelihood
  (`answer_statistics`, `hf_fedtask.metrics.free_text_scores`).

Written here because neither transformers nor peft has a multiple-choice scorer for a PEFT model in
memory (lm-evaluation-harness does, for whole models behind its own model classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from hf_fedtask.errors import ConfigError
from hf_fedtask.model.lm_loss import IGNORE_INDEX

if TYPE_CHECKING:  # torch is imported where it is used: `hf_fedtask.model.backbone` (and so RunConfig) imports this
    import torch
    from datasets import Dataset

CHOICES_LINE = "Answer with one of: {words}."


def label_words(label_names: Sequence[str]) -> list[str]:
    """The verbalizer: the word a label is answered with (its name, underscores as spaces)."""
    return [str(name).replace("_", " ") for name in label_names]


def user_message(instruction: str, words: Sequence[str], text: str) -> str:
    """The user turn of one example: the task's instruction and its answer words, then the input. A
    task without an instruction (a prompt/answer dataset) sends its input alone; a free-text task (no
    words) its instruction and the input."""
    if not instruction:
        return text
    if not words:
        return f"{instruction}\n\n{text}"
    return f"{instruction}\n{CHOICES_LINE.format(words=', '.join(words))}\n\n{text}"


def render_prompt(tokenizer, instruction: str, words: Sequence[str], text: str) -> str:
    """The prompt string: the user turn through the chat template, with the assistant turn opened."""
    messages = [{"role": "user", "content": user_message(instruction, words, text)}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_template(tokenizer, instruction: str, words: Sequence[str]) -> str:
    """The prompt with `{input}` where the example goes: what a model card shows."""
    return render_prompt(tokenizer, instruction, words, "{input}")


def end_of_turn(tokenizer) -> str:
    """What the chat template writes after an assistant answer, up to its end-of-turn token."""
    messages = [{"role": "user", "content": "x"}]
    opened = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    closed = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "ANSWER"}], tokenize=False)
    tail = closed[len(opened):].split("ANSWER", 1)[-1]
    eos = tokenizer.eos_token or ""
    return tail[:tail.index(eos) + len(eos)] if eos and eos in tail else tail.rstrip()


class InstructionInputs:
    """Inputs of a causal LM (`AutoModelForCausalLM`): tasks rendered as instructions (module docstring).
    The prepared dataset holds `input_ids` (prompt + answer), `prompt_length`, `choice_ids` (each
    label's word as token ids) and `labels` (the class id, for scoring)."""

    modality = "text"  # what tasks it takes; `kind` tells it apart from the classifier's text inputs
    kind = "causal_lm"
    auto_model = "AutoModelForCausalLM"
    peft_head: ClassVar[dict] = {"task_type": "CAUSAL_LM"}  # no head: the LM head answers in words
    group_by_length = True

    def __init__(self, processor, max_length: int = 128):
        if processor.pad_token is None:
            processor.pad_token = processor.eos_token
        if not getattr(processor, "chat_template", None):
            raise ConfigError(f"{processor.name_or_path}: the tokenizer has no chat template; instruction tasks "
                              "are rendered through it")
        self.processor = processor
        self.max_length = max_length
        self.collator = AnswerOnlyCollator(processor.pad_token_id)
        self.eval_collator = ScoringCollator(processor.pad_token_id)
        self.answer_end = end_of_turn(processor)

    @classmethod
    def load(cls, ref, max_length: int = 128) -> InstructionInputs:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(ref.load_path), max_length)

    def _ids(self, text: str) -> list[int]:
        return self.processor(text, add_special_tokens=False)["input_ids"]

    def choice_ids(self, words: Sequence[str]) -> list[list[int]]:
        return [self._ids(word) for word in words]

    def check_room(self, task) -> None:
        """Refuse a `max_length` that leaves a task's inputs no room (a ConfigError naming the room needed),
        before anything is prepared or written."""
        if task.free_text:
            self.encode_free_text(task.instruction, ["x" * 8], ["y"])
            return
        words = label_words(task.label_names)
        self.encode(task.instruction, words, ["x" * 8] * len(words), list(range(len(words))))

    def encode(self, instruction: str, words: Sequence[str], texts: Sequence[str], answers: Sequence[int]) -> dict:
        """Token ids of prompt + answer for each example; an input too long for `max_length` is cut
        (its tokens, never the instruction or the answer)."""
        out = {"input_ids": [], "prompt_length": []}
        ends = [self._ids(word + self.answer_end) for word in words]
        for text, answer in zip(texts, answers, strict=True):
            prompt = self._fitted_prompt(instruction, words, text, self.max_length - len(ends[answer]))
            out["input_ids"].append(prompt + ends[answer])
            out["prompt_length"].append(len(prompt))
        return out

    def _fitted_prompt(self, instruction: str, words: Sequence[str], text: str, room: int) -> list[int]:
        """The prompt's token ids within `room` tokens: the input cut (its tokens, never the instruction or
        the template) until it fits; a ConfigError naming the room needed where even no input does not."""
        prompt = self._ids(render_prompt(self.processor, instruction, words, text))
        if len(prompt) <= room:
            return prompt
        text_ids = self._ids(text)
        cut = len(text_ids) - (len(prompt) - room)
        if cut < 1:
            fixed = len(prompt) - len(text_ids) + self.max_length - room
            raise ConfigError(f"max_length {self.max_length} leaves no room for the input after the prompt "
                              f"template, instruction and answer ({fixed} tokens); raise max_length "
                              f"(e.g. --max-length {32 * (fixed // 32 + 2)})")
        cut_text = self.processor.decode(text_ids[:cut])
        return self._ids(render_prompt(self.processor, instruction, words, cut_text))[:room]

    def encode_free_text(self, instruction: str, texts: Sequence[str], answers: Sequence[str]) -> dict:
        """Token ids of prompt + free-text answer + end of turn for each example, at most `max_length`: an
        example too long keeps its prompt whole when that leaves the answer half the room (else the input is
        cut to half the room), and its answer is cut at `max_length` (losing the end of turn)."""
        out = {"input_ids": [], "prompt_length": [], "answer_length": []}
        for text, answer in zip(texts, answers, strict=True):
            reply = self._ids(str(answer) + self.answer_end)
            prompt = self._fitted_prompt(instruction, (), text, max(self.max_length - len(reply),
                                                                     self.max_length // 2))
            reply = reply[:self.max_length - len(prompt)]
            out["input_ids"].append(prompt + reply)
            out["prompt_length"].append(len(prompt))
            out["answer_length"].append(len(reply))
        return out

    def prepare(self, dataset: Dataset, task) -> Dataset:
        """Model inputs, `prompt_length`, `choice_ids` and `labels` (a free-text task: `answer_length`
        instead of the last two), computed once by an in-memory map."""
        from hf_fedtask.data.task import prepared

        if task.free_text:
            instruction, text_column, label_column = task.instruction, task.text_column, task.label_column
            return prepared(dataset, lambda b: self.encode_free_text(instruction, b[text_column], b[label_column]),
                            f"{self.processor.name_or_path}|{len(self.processor)}|{self.max_length}|free_text|"
                            f"{instruction}|{text_column}|{label_column}")
        words = label_words(task.label_names)
        choices = self.choice_ids(words)
        instruction, text_column, label_column = task.instruction, task.text_column, task.label_column

        def encode(batch):
            enc = self.encode(instruction, words, batch[text_column], batch[label_column])
            enc["labels"] = batch[label_column]
            enc["choice_ids"] = [choices] * len(enc["labels"])
            return enc

        return prepared(dataset, encode, f"{self.processor.name_or_path}|{len(self.processor)}|{self.max_length}|"
                                         f"{instruction}|{words}|{text_column}|{label_column}")

    def batch(self, texts: list[str], instruction: str = "", words: Sequence[str] = ()) -> dict:
        """Left-padded prompt tensors for raw texts, ready for `model.generate(**batch)`."""
        prompts = [self._ids(render_prompt(self.processor, instruction, words, t)) for t in texts]
        return self.eval_collator([{"input_ids": p, "prompt_length": len(p)} for p in prompts])

    def predict_batch(self, model, batch: dict) -> torch.Tensor:
        """Each example's label: the choice of highest log-likelihood (`choice_loglikelihoods`); for a
        free-text task's batch, each example's answer statistics (`answer_statistics`)."""
        if "choice_ids" not in batch:
            return answer_statistics(model, batch)
        return choice_loglikelihoods(model, batch).argmax(-1)


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> torch.Tensor:
    import torch

    width = max(len(r) for r in rows)
    padded = [([value] * (width - len(r)) + list(r)) if left else (list(r) + [value] * (width - len(r))) for r in rows]
    return torch.tensor(padded, dtype=torch.long)


class AnswerOnlyCollator:
    """Training batches: prompt + answer, right-padded; `labels` are the answer's tokens (-100 on the
    prompt and on padding), so the causal-LM loss is the answer's alone."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        ids = [f["input_ids"] for f in features]
        labels = [[IGNORE_INDEX] * f["prompt_length"] + list(f["input_ids"][f["prompt_length"]:]) for f in features]
        return {"input_ids": _pad(ids, self.pad_token_id),
                "attention_mask": _pad([[1] * len(r) for r in ids], 0),
                "labels": _pad(labels, IGNORE_INDEX)}


class PromptCollator:
    """Scoring batches: each prompt alone, left-padded (so every prompt ends at the last position),
    with explicit `position_ids`, the task's `choice_ids` and the class `labels` when present."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        prompts = [list(f["input_ids"][:f["prompt_length"]]) for f in features]
        mask = _pad([[1] * len(p) for p in prompts], 0, left=True)
        import torch

        batch = {"input_ids": _pad(prompts, self.pad_token_id, left=True), "attention_mask": mask,
                 "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        if "choice_ids" in features[0]:
            batch["choice_ids"] = features[0]["choice_ids"]  # one task per dataset: the same for every row
        if "labels" in features[0]:
            batch["labels"] = torch.tensor([f["labels"] for f in features])
        return batch


class ScoringCollator:
    """Scoring batches: a classification task's prompts (`PromptCollator`), or, for a free-text task's rows
    (they carry `answer_length`), whole prompt + answer sequences with answer-only labels
    (`AnswerOnlyCollator`), scored teacher-forced."""

    def __init__(self, pad_token_id: int):
        self.prompts = PromptCollator(pad_token_id)
        self.answers = AnswerOnlyCollator(pad_token_id)

    def __call__(self, features: list[dict]) -> dict:
        return (self.answers if "answer_length" in features[0] else self.prompts)(features)


def answer_statistics(model, batch: dict) -> torch.Tensor:
    """(batch, 3) float rows for teacher-forced reference answers (`AnswerOnlyCollator` batches): the answer
    tokens that are the model's greedy next token, the answer tokens, and their summed negative
    log-likelihood (`hf_fedtask.metrics.free_text_scores` turns them into the metrics)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["labels"][:, 1:].to(logits.device)
        scored = targets != IGNORE_INDEX
        safe = targets.clamp(min=0)
        # a row at a time: a float32 log-softmax over (positions, vocabulary), not over the whole batch at once
        nll = -torch.stack([_token_logprobs(logits[i], safe[i]) for i in range(len(logits))]) * scored
        correct = (logits.argmax(-1) == safe) & scored
    return torch.stack([correct.sum(-1).float(), scored.sum(-1).float(), nll.sum(-1).float()], dim=-1)


def _can_continue_cache(model) -> bool:
    """Whether the model's forward continues a key/value cache: not a linearized wrapper, and not
    prompt or prefix tuning (which manage the cache themselves)."""
    from peft import PeftModel

    from hf_fedtask.model.linearize import LinearizedModel

    if isinstance(model, LinearizedModel):
        return False
    return not (isinstance(model, PeftModel) and model.peft_config[model.active_adapter].is_prompt_learning)


def choice_loglikelihoods(model, batch: dict) -> torch.Tensor:
    """(batch, choices) log-likelihoods Σ_j log p(c_j | prompt, c_<j) of every choice's tokens after each
    left-padded prompt of `batch` (`PromptCollator`)."""
    import torch

    choices = batch["choice_ids"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        if _can_continue_cache(model):
            return _cached_choices(model, inputs, choices)
        return torch.stack([_whole_choice(model, inputs, c) for c in choices], dim=-1)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _cached_choices(model, inputs: dict, choices: list[list[int]]) -> torch.Tensor:
    """The prompt once with a cache; every choice's later tokens continue from it, all choices at once."""
    import torch

    out = model(**inputs, use_cache=True)
    first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    n, k = inputs["input_ids"].shape[0], len(choices)
    scores = first[:, [c[0] for c in choices]]  # (n, k): each choice's first token
    longest = max(len(c) for c in choices)
    if longest == 1:
        return scores
    device = inputs["input_ids"].device
    rest = _pad([c[1:] for c in choices], 0).to(device)  # (k, longest-1) tokens after the first
    feed = _pad([c[:-1] for c in choices], 0).to(device)  # the tokens that predict them
    valid = _pad([[1] * (len(c) - 1) for c in choices], 0).to(device).bool()
    cache = out.past_key_values
    cache.batch_repeat_interleave(k)
    mask = inputs["attention_mask"].repeat_interleave(k, 0)
    start = inputs["position_ids"][:, -1:].repeat_interleave(k, 0) + 1
    steps = feed.shape[1]
    more = model(input_ids=feed.repeat(n, 1), past_key_values=cache, use_cache=True,
                 attention_mask=torch.cat([mask, torch.ones(n * k, steps, dtype=mask.dtype, device=device)], -1),
                 position_ids=start + torch.arange(steps, device=device))
    logp = _token_logprobs(more.logits, rest.repeat(n, 1)) * valid.repeat(n, 1)
    return scores + logp.sum(-1).view(n, k).to(scores.device)


def _whole_choice(model, inputs: dict, choice: list[int]) -> torch.Tensor:
    """One choice scored on whole prompt + choice sequences (no cache)."""
    import torch

    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    n, m = ids.shape[0], len(choice)
    tail = torch.tensor(choice, device=ids.device).expand(n, m)
    full_mask = torch.cat([mask, torch.ones(n, m, dtype=mask.dtype, device=ids.device)], -1)
    out = model(input_ids=torch.cat([ids, tail], -1), attention_mask=full_mask,
                position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    logits = out.logits[:, ids.shape[1] - 1:-1]  # the positions predicting each choice token
    return _token_logprobs(logits, tail).sum(-1)


def generate_answers(model, tokenizer, batch: dict, max_new_tokens: int) -> list[str]:
    """Greedy answers to left-padded prompts (`PromptCollator`), decoded without special tokens."""
    import torch

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return [t.strip() for t in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)]
