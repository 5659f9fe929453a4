"""Causal LMs answering instructions (`hf_fedtask.model.instructions`) on the tiny random Llama: prompts
through the chat template with the loss on the answer alone, multiple-choice scoring equal to a hand
computation, every strategy that shares PEFT modules running on it (TCT and F²L² refused in one line),
and exports that stock PEFT and a stock text-generation pipeline load."""

import dataclasses
import json

import pytest
import torch
from conftest import make_config

from hf_fedtask.cli import main
from hf_fedtask.config import RunConfig
from hf_fedtask.data import load_task
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.compact import load_task_adapter
from hf_fedtask.model.backbone import resolve_base_model
from hf_fedtask.model.host import PeftHost
from hf_fedtask.model.instructions import (
    IGNORE_INDEX,
    _cached_choices,
    _whole_choice,
    choice_loglikelihoods,
    label_words,
    render_prompt,
)
from hf_fedtask.model.peft_methods import make_peft_config

TINY_LLAMA = "hf-fedtask/tiny-llama"


@pytest.fixture(scope="module")
def host():
    return PeftHost(resolve_base_model(TINY_LLAMA), make_peft_config("lora", r=4, modality="causal_lm"), max_length=128)


@pytest.fixture(scope="module")
def colors(tiny_tasks_dir):
    return dataclasses.replace(load_task(tiny_tasks_dir[0]), instruction="Which color is named?")


def llm_config(tiny_tasks_dir, out, strategy="fedavg", options=None, **overrides) -> RunConfig:
    values = dict(base_model=TINY_LLAMA, base_model_id=None, max_length=128, strategy=strategy,
                  strategy_options=options or {})
    return make_config(None, tiny_tasks_dir, out, **{**values, **overrides})


def test_examples_go_through_the_chat_template_and_only_the_answer_is_learned(host, colors):
    data = host.tokenize(colors.dataset["train"].select(range(4)), colors)
    tokenizer = host.inputs.processor
    row = data[1]
    text, label = colors.dataset["train"][1]["text"], colors.dataset["train"][1]["label"]
    prompt = render_prompt(tokenizer, colors.instruction, label_words(colors.label_names), text)
    assert tokenizer.decode(row["input_ids"][:row["prompt_length"]]) == prompt
    assert "Answer with one of: red, blue, green." in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(row["input_ids"][row["prompt_length"]:]) == colors.label_names[label] + "<|im_end|>"
    assert row["labels"] == label and row["choice_ids"] == [tokenizer(w, add_special_tokens=False)["input_ids"]
                                                            for w in ("red", "blue", "green")]
    batch = host.inputs.collator([data[i] for i in range(4)])
    lm_labels = batch["labels"][1]
    answer = row["input_ids"][row["prompt_length"]:]
    assert lm_labels[:row["prompt_length"]].eq(IGNORE_INDEX).all()
    assert lm_labels[row["prompt_length"]:row["prompt_length"] + len(answer)].tolist() == answer
    assert lm_labels[row["prompt_length"] + len(answer):].eq(IGNORE_INDEX).all()  # padding


def test_a_long_input_is_cut_never_the_instruction_or_the_answer(host, colors):
    from hf_fedtask.model.instructions import InstructionInputs

    short = InstructionInputs(host.inputs.processor, max_length=100)
    enc = short.encode("Which color is named?", ["red", "blue"], ["red " * 200], [0])
    ids = enc["input_ids"][0]
    assert len(ids) <= 100
    decoded = short.processor.decode(ids)
    assert "Which color is named?" in decoded and decoded.endswith("red<|im_end|>")
    with pytest.raises(ConfigError, match="max_length 40 leaves no room"):
        InstructionInputs(host.inputs.processor, max_length=40).encode("Which color?", ["red"], ["red " * 50], [0])


def test_choice_scores_equal_a_hand_computation_with_and_without_the_cache(host):
    from hf_fedtask.data.builtin import load_builtin_task

    task = load_builtin_task("kaomoji_intent")  # six answers of one to five tokens ("cheer up", ...)
    with torch.no_grad():
        for p in host.model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    data = host.tokenize(task.dataset["test"].select(range(5)), task)
    batch = host.inputs.eval_collator([data[i] for i in range(5)])
    assert len({len(c) for c in batch["choice_ids"]}) > 1
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    host.model.eval()
    with torch.no_grad():
        cached = _cached_choices(host.model, inputs, batch["choice_ids"])
        whole = torch.stack([_whole_choice(host.model, inputs, c) for c in batch["choice_ids"]], -1)
        row = data[2]  # the hand computation: one unpadded sequence per choice
        prompt = row["input_ids"][:row["prompt_length"]]
        hand = []
        for choice in batch["choice_ids"]:
            logp = torch.log_softmax(host.model(input_ids=torch.tensor([prompt + choice])).logits[0], -1)
            hand.append(sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(choice)))
    torch.testing.assert_close(cached, whole, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cached[2], torch.stack(hand), atol=1e-4, rtol=1e-5)
    assert torch.equal(choice_loglikelihoods(host.model, batch).argmax(-1), cached.argmax(-1))


@pytest.fixture(scope="module")
def trained_llm(tiny_tasks_dir, tmp_path_factory):
    """FedAvg on the tiny Llama over the two word-cue tasks, long enough to learn them."""
    config = llm_config(tiny_tasks_dir, tmp_path_factory.mktemp("llm") / "run", num_clients=2, rounds=3,
                        local_steps=25, learning_rate=1e-2, lora_r=16, export=True)
    return config, run(config)


def test_fedavg_on_a_causal_lm_learns_the_tasks(trained_llm):
    _, results = trained_llm
    accuracy = {name: r["accuracy"] for name, r in results["tasks"].items()}
    assert accuracy["colors"] >= 1 / 3 + 0.3 and accuracy["moods"] >= 0.5 + 0.25, accuracy


def test_exported_adapters_load_with_stock_peft_and_answer_a_pipeline(trained_llm):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from hf_fedtask.engine.environment import Environment

    config, results = trained_llm
    folder = config.run_dir / "adapters" / "colors" if hasattr(config, "run_dir") else None
    folder = folder or __import__("pathlib").Path(config.output_dir) / "adapters" / "colors"
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "CAUSAL_LM" and not (folder / "classifier").exists()
    card = (folder / "README.md").read_text()
    assert "AutoPeftModelForCausalLM" in card and "## Prompt template" in card
    assert "pipeline_tag: text-generation" in card
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY_LLAMA).load_path)
    model = PeftModel.from_pretrained(base, folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    env = Environment(config)
    test = env.test_data("colors")
    loader = torch.utils.data.DataLoader(test, batch_size=64, collate_fn=env.host.inputs.eval_collator)
    preds = torch.cat([choice_loglikelihoods(model, b).argmax(-1) for b in loader])
    assert float((preds == torch.tensor(test["labels"])).float().mean()) == results["tasks"]["colors"]["accuracy"]
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    raw = env.task_by_name["colors"].dataset["test"][0]
    message = render_prompt(tokenizer, "", [], raw["text"])  # the tiny tasks carry no instruction
    assert message == tokenizer.apply_chat_template([{"role": "user", "content": raw["text"]}],
                                                    add_generation_prompt=True, tokenize=False)
    reply = generate([{"role": "user", "content": raw["text"]}], max_new_tokens=4, do_sample=False)
    # the tiny model learns the word in its few steps, not always the end of turn after it
    assert reply[0]["generated_text"][-1]["content"].startswith(["red", "blue", "green"][raw["label"]])


# fedavg (product), matu, fedyolo, scaffold and ntkfedavg also keep the strategy contract on the tiny Llama
# (tests/test_strategy_contract.py); these are the rest of the module-sharing strategies and variants
@pytest.mark.parametrize("strategy,options,overrides", [
    ("fedprox", {"proximal_mu": 0.01}, {}),
    ("matu", {"kappa": 1}, {"zeta": 0.5, "num_clients": 4}),
    ("fedper", {}, {}),
    ("matfl", {}, {}),
    ("ntkfedavg", {"linearization": "lora_layers"}, {}),
    ("fedavg", {"forget_tasks": ["moods"]}, {"rounds": 2}),
])
def test_every_module_sharing_strategy_runs_on_a_causal_lm(strategy, options, overrides, tiny_tasks_dir, tmp_path):
    config = llm_config(tiny_tasks_dir, tmp_path / "run", strategy, options, export=True, **overrides)
    results = run(config)
    assert set(results["tasks"]) == {"colors", "moods"}
    assert all(0 <= r["accuracy"] <= 1 for r in results["tasks"].values())
    for task in ("colors", "moods"):
        assert (tmp_path / "run" / "adapters" / task / "adapter_model.safetensors").is_file()
    if strategy == "matu":  # the compact export: one unified vector, masks and rescalers, no heads
        model = load_task_adapter(tmp_path / "run" / "compact", "moods", base_model=resolve_base_model(TINY_LLAMA)
                                  .load_path)
        assert type(model.get_base_model()).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("strategy", ["tct", "f2l2"])
def test_strategies_that_need_a_classifier_refuse_a_causal_lm_in_one_line(strategy, tiny_tasks_dir, tmp_path):
    tasks = tiny_tasks_dir[:1] if strategy == "f2l2" else tiny_tasks_dir
    options = {"stage1_rounds": 1} if strategy == "tct" else {}
    config = llm_config(tasks, tmp_path / "run", strategy, options, rounds=3)
    with pytest.raises(ConfigError, match=f"strategy '{strategy}' does not run on the causal LM") as err:
        run(config)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_a_shared_output_space_is_refused_for_a_causal_lm(tiny_tasks_dir, tmp_path):
    with pytest.raises(ConfigError, match="answers every task in words"):
        run(llm_config(tiny_tasks_dir, tmp_path / "run", output_space="max"))


def test_merge_cli_merges_causal_lm_adapters(trained_llm, tmp_path, capsys):
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, _ = trained_llm
    adapters = Path(config.output_dir) / "adapters"
    out = tmp_path / "merged"
    code = main(["merge", "--method", "ties", "--density", "0.5", str(adapters / "colors"), str(adapters / "moods"),
                 "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY_LLAMA).load_path)
    merged = PeftModel.from_pretrained(base, out)
    assert merged.peft_config["default"].task_type == "CAUSAL_LM"


def test_a_max_length_without_room_for_the_input_is_refused_before_anything_is_written(tiny_tasks_dir, tmp_path):
    config = dataclasses.replace(llm_config(tiny_tasks_dir, tmp_path / "run"), max_length=20)
    with pytest.raises(ConfigError, match=r"max_length 20 leaves no room .*raise max_length \(e\.g\. --max-length"):
        run(config)
    assert not (tmp_path / "run").exists()


def test_greedy_answers_are_scored_by_exact_match_at_the_end(trained_llm, tmp_path):
    config, results = trained_llm
    resumed = run(dataclasses.replace(config, generation_eval=True), resume=True)  # finished: only re-reports
    for name, r in resumed["tasks"].items():
        assert 0 <= r["exact_match"] <= 1 and r["accuracy"] == results["tasks"][name]["accuracy"]
    assert resumed["mean_exact_match"] == pytest.approx(sum(r["exact_match"] for r in resumed["tasks"].values()) / 2)


def test_generation_eval_is_refused_for_a_classifier(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    with pytest.raises(ConfigError, match="generation_eval: base model .* is a classifier"):
        run(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", generation_eval=True))


def test_a_round_on_the_real_smollm2_exports_what_auto_peft_and_a_pipeline_load_offline(llm_cache, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer, pipeline

    from hf_fedtask.data.builtin import load_builtin_task
    from hf_fedtask.model.instructions import user_message

    config = RunConfig(strategy="fedavg", suite=None, tasks=["vader_polarity"], base_model=llm_cache[1].model_id,
                       num_clients=1, rounds=1, local_steps=4, batch_size=4, learning_rate=1e-3, max_length=96,
                       max_train_samples=32, max_test_samples=16, output_dir=str(tmp_path / "run"))
    results = run(config)
    folder = tmp_path / "run" / "adapters" / "vader_polarity"
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == llm_cache[1].model_id
    model = AutoPeftModelForCausalLM.from_pretrained(folder).eval()  # the base by its Hub id, from the cache
    tokenizer = AutoTokenizer.from_pretrained(folder)
    task = load_builtin_task("vader_polarity")
    words = label_words(task.label_names)
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    texts = task.dataset["test"]["text"][:4]
    replies = [generate([{"role": "user", "content": user_message(task.instruction, words, text)}],
                        max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]["content"] for text in texts]
    print(replies, results["tasks"]["vader_polarity"])
    assert all(reply.strip() in words for reply in replies), replies


def test_an_exported_builtin_task_keeps_its_instruction(tmp_path, capsys):
    assert main(["suite", "export", "builtin-8", str(tmp_path / "suite")]) == 0
    task = load_task(str(tmp_path / "suite" / "vader_polarity"))
    assert task.instruction == "Do people rate this word as negative or positive?"


def test_push_uploads_a_causal_lm_adapter_folder_unchanged(trained_llm, hub_stub):
    from pathlib import Path

    from hf_fedtask.export.hub import push_to_hub

    endpoint, store = hub_stub
    folder = Path(trained_llm[0].output_dir) / "adapters" / "moods"
    push_to_hub(folder, "me/llm-moods", token="hf_test", endpoint=endpoint)
    assert store.repos["me/llm-moods"] == {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert {"chat_template.jinja", "tokenizer.json", "README.md", "adapter_model.safetensors"} <= set(
        store.repos["me/llm-moods"])


def test_standalone_evaluation_of_a_causal_lm_adapter_equals_results_json(trained_llm, tiny_tasks_dir):
    from pathlib import Path

    from hf_fedtask.export.standalone import evaluate_adapter

    config, results = trained_llm
    got = evaluate_adapter(Path(config.output_dir) / "adapters" / "colors", tiny_tasks_dir[0], max_length=128)
    assert got["accuracy"] == results["tasks"]["colors"]["accuracy"]
