"""Free-text tasks (instruction tuning on prompt/response rows) on the tiny random Llama: a string answer
column loads as a free-text task, the response's tokens are the only ones learned, the answer loss equals
transformers' own causal-LM loss and the token accuracy a hand count, a run learns the responses (token
accuracy above the base model's), the exported adapter reloaded with stock PEFT scores what results.json says,
greedy responses are scored by ROUGE-L as stock `generate` and `rouge_score` score them; what cannot apply to
free text is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_config
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from hf_fedtask.data import load_task
from hf_fedtask.data.partition import build_federation
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError, DataError
from hf_fedtask.metrics import free_text_scores
from hf_fedtask.model.backbone import resolve_base_model
from hf_fedtask.model.host import PeftHost
from hf_fedtask.model.instructions import IGNORE_INDEX, answer_statistics, render_prompt
from hf_fedtask.model.peft_methods import make_peft_config

TINY_LLAMA = "hf-fedtask/tiny-llama"
COLORS = ("red", "blue", "green")


def rows(n: int, offset: int = 0) -> dict[str, list[str]]:
    """Prompts naming a color and a count, answered by a sentence that repeats them: learnable from the prompt."""
    prompts, answers = [], []
    for i in range(offset, offset + n):
        color = COLORS[i % 3]
        prompts.append(f"Describe item {i % 7}: it is {color}.")
        answers.append(f"Item {i % 7} is {color} and nothing else.")
    return {"prompt": prompts, "answer": answers}


@pytest.fixture(scope="module")
def free_dir(tmp_path_factory) -> Path:
    """A save_to_disk folder of prompt/response rows whose card says `answers: free_text`."""
    from huggingface_hub import DatasetCard

    folder = tmp_path_factory.mktemp("free") / "describe"
    features = Features({"prompt": Value("string"), "answer": Value("string")})
    DatasetDict({"train": Dataset.from_dict(rows(120), features=features),
                 "test": Dataset.from_dict(rows(30, offset=1000), features=features)}).save_to_disk(str(folder))
    DatasetCard("---\nanswers: free_text\ninstruction: Describe the item.\n---\n").save(folder / "README.md")
    return folder


@pytest.fixture(scope="module")
def host():
    return PeftHost(resolve_base_model(TINY_LLAMA), make_peft_config("lora", r=4, modality="causal_lm"), max_length=256)


def test_a_string_answer_column_loads_as_a_free_text_task(free_dir, tmp_path):
    task = load_task(str(free_dir))
    assert task.free_text and task.metric == "token_accuracy" and task.label_names == [] and task.chance is None
    assert task.instruction == "Describe the item." and task.label_column == "answer"
    # a jsonl file, marked from Python; no test split: a plain seeded one
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output": a}) + "\n" for p, a in zip(*rows(50).values())))
    jsonl = load_task(str(path), answers="free_text")
    assert jsonl.free_text and jsonl.label_column == "output" and (len(jsonl.dataset["train"]),
                                                                   len(jsonl.dataset["test"])) == (40, 10)
    unmarked = load_task(str(path), label_column="output")  # unmarked, the answers become class labels, as before
    assert not unmarked.free_text and isinstance(unmarked.dataset["train"].features["output"], ClassLabel)
    with pytest.raises(DataError, match="answers must be one of labels, free_text, got 'words'"):
        load_task(str(path), answers="words")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"prompt": "p", "answer": i}) + "\n" for i in range(10)))
    with pytest.raises(DataError, match="free-text answers need a string column; 'answer' is"):
        load_task(str(numbers), answers="free_text")
    # label skew needs labels
    with pytest.raises(DataError, match="partition 'dirichlet' skews labels, and its answers are free text"):
        build_federation([task], 2, zeta=0.0, partition="dirichlet", alpha=0.5, seed=0)
    assert sum(len(c["describe"]) for c in build_federation([task], 2, zeta=0.0, partition="iid", seed=0)) == 120


def test_only_the_response_and_its_end_of_turn_are_learned_and_long_rows_are_cut(free_dir, host):
    task = load_task(str(free_dir))
    data = host.tokenize(task.dataset["train"].select(range(3)), task)
    tokenizer = host.inputs.processor
    raw = task.dataset["train"][1]
    row = data[1]
    prompt = render_prompt(tokenizer, task.instruction, (), raw["prompt"])
    assert prompt.endswith("<|im_start|>assistant\n") and "Describe the item.\n\n" + raw["prompt"] in prompt
    assert tokenizer.decode(row["input_ids"][:row["prompt_length"]]) == prompt
    assert tokenizer.decode(row["input_ids"][row["prompt_length"]:]) == raw["answer"] + "<|im_end|>"
    assert row["answer_length"] == len(row["input_ids"]) - row["prompt_length"]
    batch = host.inputs.collator([data[i] for i in range(3)])
    learned = batch["labels"][1][batch["labels"][1] != IGNORE_INDEX].tolist()
    assert learned == row["input_ids"][row["prompt_length"]:]
    # the scoring batches are the training's: whole sequences, answer-only labels
    scoring = host.inputs.eval_collator([data[i] for i in range(3)])
    assert torch.equal(scoring["labels"], batch["labels"]) and "choice_ids" not in scoring
    # too long: the answer keeps at least half of max_length, the input is cut, the total is max_length
    long = host.inputs.encode_free_text("", ["word " * 200], ["reply " * 200])
    assert len(long["input_ids"][0]) == 256 and long["prompt_length"][0] <= 128 and long["answer_length"][0] >= 128
    short_prompt = host.inputs.encode_free_text("", ["hi"], ["reply " * 200])
    prompt_ids = short_prompt["input_ids"][0][:short_prompt["prompt_length"][0]]
    assert tokenizer.decode(prompt_ids) == render_prompt(tokenizer, "", (), "hi")  # a short prompt stays whole


def test_answer_loss_is_transformers_causal_lm_loss_and_token_accuracy_a_hand_count(free_dir, host):
    task = load_task(str(free_dir))
    data = host.tokenize(task.dataset["test"].select(range(5)), task)
    batch = host.inputs.eval_collator([data[i] for i in range(5)])
    model = host.model.eval()
    torch.manual_seed(0)
    with torch.no_grad():  # a LoRA that is not zero, so the adapter takes part
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
        stats = answer_statistics(model, batch)
        scores = free_text_scores(stats.numpy())
        reference = model(**batch).loss  # transformers' loss: mean NLL over the labelled (answer) tokens
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert scores["answer_loss"] == pytest.approx(float(reference), rel=1e-5)
    correct = total = 0
    for i in range(5):
        for j in range(1, batch["input_ids"].shape[1]):
            target = int(batch["labels"][i, j])
            if target != IGNORE_INDEX:
                total += 1
                correct += int(logits[i, j - 1].argmax()) == target
    assert scores["token_accuracy"] == pytest.approx(correct / total) and total == stats[:, 1].sum()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


@pytest.fixture(scope="module")
def trained_free(free_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("free_run") / "run"
    config = make_config(None, [str(free_dir)], out, base_model=TINY_LLAMA, base_model_id=None, max_length=256,
                         num_clients=2, rounds=2, local_steps=15, learning_rate=1e-2, lora_r=8, export=True,
                         generation_eval=True)
    return config, run(config)


def test_a_run_learns_the_responses_and_the_stock_peft_reload_scores_the_same(trained_free, free_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.server import Server
    from hf_fedtask.export.standalone import evaluate_adapter

    config, results = trained_free
    r = results["tasks"]["describe"]
    assert r["metric"] == "token_accuracy" and r["chance"] is None and r["label_names"] == []
    env = Environment(config)
    base = Server(env).evaluate(env.initial)["describe"]  # the base model's own answers: LoRA B is zero
    assert r["token_accuracy"] >= base["token_accuracy"] + 0.3 and r["answer_loss"] < base["answer_loss"] - 1.0, (
        r, base)
    folder = Path(config.output_dir) / "adapters" / "describe"
    card = (folder / "README.md").read_text()
    assert "answers instructions in free text" in card and "max_new_tokens=256" in card
    assert "Label words" not in card and "token_accuracy" in card
    base_model = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY_LLAMA).load_path)
    model = PeftModel.from_pretrained(base_model, folder).eval()  # stock PEFT
    test = env.test_data("describe")
    loader = torch.utils.data.DataLoader(test, batch_size=8, collate_fn=env.host.inputs.eval_collator)
    reloaded = free_text_scores(torch.cat([answer_statistics(model, b) for b in loader]).numpy())
    assert reloaded["token_accuracy"] == pytest.approx(r["token_accuracy"], abs=1e-6)
    assert reloaded["answer_loss"] == pytest.approx(r["answer_loss"], rel=1e-4)
    standalone = evaluate_adapter(folder, str(free_dir), max_length=256, progress=False)
    assert standalone["token_accuracy"] == pytest.approx(r["token_accuracy"], abs=1e-6)


def test_greedy_responses_are_scored_by_rouge_l_as_stock_generate_and_rouge_score_score_them(trained_free):
    from peft import PeftModel
    from rouge_score import rouge_scorer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fedtask.engine.announce import end_lines

    config, results = trained_free
    r = results["tasks"]["describe"]
    assert results["mean_rougeL"] == r["rougeL"] and "exact_match" not in r
    assert any(line.startswith("generation ROUGE-L: mean ") for line in end_lines(results))
    folder = Path(config.output_dir) / "adapters" / "describe"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY_LLAMA).load_path),
                                      folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    test = load_task(config.tasks[0]).dataset["test"]
    end = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) + len(end) for a in test["answer"])
    scorer, scores = rouge_scorer.RougeScorer(["rougeL"]), []
    for row in test:
        messages = [{"role": "user", "content": f"Describe the item.\n\n{row['prompt']}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=longest, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        scores.append(scorer.score(row["answer"], reply)["rougeL"].fmeasure)
    assert r["rougeL"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.server import Server

    env = Environment(config)
    base = Server(env).evaluate_generation(env.initial)["describe"]["rougeL"]  # the base model's own responses
    print(f"ROUGE-L: base {base:.3f}, trained {r['rougeL']:.3f}")
    assert r["rougeL"] >= base + 0.05, (base, r["rougeL"])  # the trained adapter writes the responses' words


def test_what_needs_labels_is_refused_for_free_text_in_one_line(free_dir, tiny_bert_dir, tmp_path):
    common = dict(base_model=TINY_LLAMA, base_model_id=None, max_length=256, num_clients=2)
    with pytest.raises(ConfigError, match="backdoor_client: a backdoor flips labels; task 'describe'"):
        run(make_config(None, [str(free_dir)], tmp_path / "bd", backdoor_client=0, **common))
    with pytest.raises(ConfigError, match="task 'describe' answers in free text, which a causal LM writes; base "
                                          "model .* is a classifier"):
        run(make_config(tiny_bert_dir, [str(free_dir)], tmp_path / "cls", num_clients=2))
    assert not any((tmp_path / name).exists() for name in ("bd", "cls"))


@pytest.mark.parametrize("strategy,options,overrides", [
    ("matu", {"kappa": 1}, {"zeta": 0.5, "num_clients": 4}),  # masks, rescalers and the compact export
    ("fedper", {}, {}),  # evaluated on its clients: their answer statistics cross the wire
])
def test_other_strategies_score_and_export_a_free_text_task(strategy, options, overrides, free_dir, tmp_path):
    from hf_fedtask.export.compact import load_task_adapter

    values = dict(base_model=TINY_LLAMA, base_model_id=None, max_length=256, num_clients=2, local_steps=2,
                  strategy=strategy, strategy_options=options, export=True)
    results = run(make_config(None, [str(free_dir)], tmp_path / "run", **{**values, **overrides}))
    r = results["tasks"]["describe"]
    assert 0 <= r["token_accuracy"] <= 1 and r["answer_loss"] > 0 and r["chance"] is None
    if strategy == "matu":
        assert r["token_accuracy_compact"] == pytest.approx(r["token_accuracy"], abs=1e-6)
        model = load_task_adapter(tmp_path / "run" / "compact", "describe")
        assert type(model).__name__ == "PeftModelForCausalLM"
