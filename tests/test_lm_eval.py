"""`hf-fedtask evaluate ADAPTER --lm-eval TASKS`: lm-evaluation-harness scores an exported causal-LM adapter
(HFLM with peft=) offline on a task of our own (tests/data/lm_eval: a multiple-choice YAML over a local JSONL),
with the numbers a hand computation through stock transformers + PEFT gives, and the run's own; lm-eval's output
goes to lm_eval.json and a table into the adapter's card, both replaced by the next call. Refusals are one line,
exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_config

from hf_fedtask.cli import main

TINY_LLAMA = "hf-fedtask/tiny-llama"
TASKS = Path(__file__).parent / "data" / "lm_eval"
TASK = "hf_fedtask_colors"
WORDS = ["red", "blue", "green"]  # colors.yaml's doc_to_choice


@pytest.fixture(scope="module")
def run_dir(tiny_tasks_dir, tmp_path_factory) -> Path:
    """One round of FedAvg on the tiny Llama over the tiny colors task: an adapter that has learnt some of it."""
    from hf_fedtask.engine.run import run

    config = make_config(None, tiny_tasks_dir[:1], tmp_path_factory.mktemp("lm-eval") / "run", base_model=TINY_LLAMA,
                         base_model_id=None, num_clients=1, rounds=1, local_steps=25, lora_r=16, max_length=128,
                         export=True)
    run(config)
    return Path(config.output_dir)


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _by_hand(adapter: Path, docs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each choice's log-likelihood after the chat-templated prompt, (adapter, base alone): stock transformers +
    PEFT, the continuation's tokens those of prompt + word after the prompt's. As lm-eval does, the prompt's
    trailing whitespace (the newline after `assistant`) belongs to the continuation: the same for every choice,
    so the choice is the one hf_fedtask's own scoring (the word after the whole prompt) makes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fedtask.model.backbone import resolve_base_model

    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY_LLAMA).load_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    tok = AutoTokenizer.from_pretrained(adapter)
    out = torch.zeros(2, len(docs), len(WORDS))
    with torch.no_grad():
        for i, doc in enumerate(docs):
            prompt = tok.apply_chat_template([{"role": "user", "content": doc["text"]}], add_generation_prompt=True,
                                             tokenize=False)
            context = tok(prompt.rstrip(), add_special_tokens=False)["input_ids"]
            for j, word in enumerate(WORDS):
                ids = tok(prompt + word, add_special_tokens=False)["input_ids"]
                assert ids[:len(context)] == context
                for k, adapted in enumerate((True, False)):
                    if adapted:
                        logits = model(input_ids=torch.tensor([ids])).logits[0]
                    else:
                        with model.disable_adapter():
                            logits = model(input_ids=torch.tensor([ids])).logits[0]
                    logp = logits[len(context) - 1:-1].log_softmax(-1)
                    out[k, i, j] = logp.gather(-1, torch.tensor(ids[len(context):])[:, None]).sum()
    return out[0], out[1]


def test_lm_eval_scores_the_exported_adapter_as_stock_peft_does(run_dir, tiny_tasks_dir):
    from datasets import load_from_disk

    from hf_fedtask.workflows.lm_harness import run_lm_eval

    adapter = run_dir / "adapters" / "colors"
    docs = [json.loads(line) for line in (TASKS / "colors.jsonl").read_text().splitlines()]
    assert docs == load_from_disk(tiny_tasks_dir[0])["test"].to_list()  # the task the adapter was trained on
    card_before = (adapter / "README.md").read_text()

    results = run_lm_eval(adapter, [TASK], include=[TASKS], apply_chat_template=True, batch_size=4, log_samples=True)

    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    got = torch.tensor([[ll for ll, _ in s["filtered_resps"]] for s in samples])
    adapted, base = _by_hand(adapter, docs)
    torch.testing.assert_close(got, adapted, atol=1e-4, rtol=1e-5)
    assert (adapted - base).abs().max() > 1.0  # the adapter is applied: the base alone scores otherwise
    acc = results["results"][TASK]["acc,none"]
    truth = torch.tensor([d["label"] for d in docs])
    hits = (adapted.argmax(-1) == truth).tolist()
    assert [bool(s["acc"]) for s in samples] == hits and acc == sum(hits) / len(hits)
    assert acc == json.loads((run_dir / "results.json").read_text())["tasks"]["colors"]["accuracy"]  # the run's
    assert acc >= 1 / 3 + 0.2, acc  # above chance: it has learnt the task

    written = json.loads((adapter / "lm_eval.json").read_text())
    assert written["results"][TASK]["acc,none"] == acc and "samples" not in written
    assert written["hf_fedtask"]["base_model"] == written["config"]["model"] == TINY_LLAMA  # not the cache's folder
    assert written["hf_fedtask"]["apply_chat_template"] and written["hf_fedtask"]["adapter"] == "colors"
    card = (adapter / "README.md").read_text()
    assert f"| {TASK} | acc | {acc:.4g} | " in card and "with the tokenizer's chat template" in card
    head, _, rest = card.partition("## lm-evaluation-harness")
    assert card_before.startswith(head.split("model-index:")[0])  # the YAML header up to the model index is kept
    assert "## Evaluation" in head and "## Hyperparameters" in rest  # placed after the run's own Evaluation
    from huggingface_hub import ModelCard

    evals = ModelCard.load(adapter / "README.md").data.eval_results
    assert [(e.dataset_name, e.metric_type, e.metric_value, e.source_name) for e in evals] == [
        ("colors", "accuracy", acc, None), (TASK, "acc", acc, "lm-evaluation-harness")]


def test_the_cli_writes_json_and_card_and_the_next_call_replaces_them(run_dir, tmp_path, capsys):
    adapter = tmp_path / "colors"
    shutil.copytree(run_dir / "adapters" / "colors", adapter)  # out of its run: the recorded base id is used
    args = ["evaluate", str(adapter), "--lm-eval", TASK, "--lm-eval-include", str(TASKS), "--apply-chat-template",
            "--batch-size", "4"]
    for limit in ("6", "9"):
        assert main([*args, "--limit", limit]) == 0
        out = capsys.readouterr().out
        assert f"|{TASK}|" in out.replace(" ", "") and f"lm-eval results: {adapter / 'lm_eval.json'}" in out
        written = json.loads((adapter / "lm_eval.json").read_text())
        assert written["n-samples"][TASK]["effective"] == int(limit) and written["hf_fedtask"]["limit"] == int(limit)
        card = (adapter / "README.md").read_text()
        assert card.count("## lm-evaluation-harness") == 1 and card.count("source:") == 1
        assert f"at most {limit} examples a task" in card
        acc = written["results"][TASK]["acc,none"]
        assert f"| {TASK} | acc | {acc:.4g} | " in card and f" | 0 | {limit} |" in card
    from hf_fedtask.export.adapter import copy_loading_files

    (tmp_path / "merged").mkdir()  # what `hf-fedtask merge` copies beside a merged adapter: not these scores
    assert "lm_eval.json" not in copy_loading_files(adapter, tmp_path / "merged")


def test_a_card_section_goes_before_how_to_load_and_is_replaced_in_place(tmp_path):
    from hf_fedtask.export.hub import put_card_section

    card = tmp_path / "README.md"
    card.write_text("---\nlicense: mit\n---\n\n# T\n\n## How to load\n\n```text\n## not a heading\n```\n\n## Notes\n")
    put_card_section(card, "## Scores", "first", ["Task", "Value"], [["a", 0.123456]])
    put_card_section(card, "## Scores", "second", ["Task", "Value"], [["b", 2]])
    assert card.read_text() == ("---\nlicense: mit\n---\n\n# T\n\n## Scores\n\nsecond\n\n| Task | Value |\n|---|---|\n"
                                "| b | 2 |\n\n## How to load\n\n```text\n## not a heading\n```\n\n## Notes\n")


def _classifier_adapter(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "SEQ_CLS",
                                                            "base_model_name_or_path": "org/bert"}))
    save_file({"base_model.model.classifier.modules_to_save.default.weight": torch.zeros(2, 4)},
              str(folder / "adapter_model.safetensors"))
    return folder


INCLUDE = ["--lm-eval-include", str(TASKS)]


@pytest.mark.parametrize("case,argv,said", [
    ("unknown task", ["--lm-eval", "hf_fedtask_color", *INCLUDE], "no such task, group or tag in lm-eval"),
    ("--task with --lm-eval", ["--lm-eval", TASK, *INCLUDE, "--task", "colors"],
     "--task does not apply with --lm-eval"),
    ("lm-eval option alone", ["--num-fewshot", "1"], "--num-fewshot does not apply without --lm-eval"),
    ("lm-eval not installed", ["--lm-eval", TASK, *INCLUDE], 'pip install "hf-fedtask[lm-eval]"'),
    ("classifier", ["--lm-eval", TASK, *INCLUDE], "a classifier's adapter (task_type SEQ_CLS"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(case, argv, said, run_dir, tmp_path, capsys, monkeypatch):
    adapter = run_dir / "adapters" / "colors"
    if case == "lm-eval not installed":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    if case == "classifier":
        adapter = _classifier_adapter(tmp_path / "classifier")
    before = _snapshot(adapter)
    capsys.readouterr()
    assert main(["evaluate", str(adapter), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    if case == "unknown task":
        assert err[0].endswith(f"did you mean {TASK}?")
    assert _snapshot(adapter) == before
