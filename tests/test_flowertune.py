"""The FlowerTune LLM protocol: the presets hold the template apps' values, the communication budget counts
what FlowerTune counts (within 0.5% of `ArrayRecord.count_bytes()` on a SmolLM2 adapter) and refuses a run or
a round that would pass it in one line, and recipes/flowertune.py runs the finance challenge's protocol (label
words) and the general challenge's (free text) on local rows, refusing a 4-bit base without a GPU and free-text
answers to the finance challenge before anything is written."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_config, read_records

from hf_fedtask.cli import main as cli_main
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors
from hf_fedtask.engine.budget import MB, wire_size
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError

RECIPE = Path(__file__).parents[1] / "recipes" / "flowertune.py"
# each template's [tool.flwr.app.config.static] dataset.name, options.num-supernodes, strategy.fraction-train
TEMPLATES = {"general": ("flwrlabs/alpaca-gpt4", 20, 0.1), "finance": ("flwrlabs/fingpt-sentiment-train", 50, 0.1),
             "medical": ("flwrlabs/medical-meadow-medical-flashcards", 20, 0.1),
             "code": ("flwrlabs/code-alpaca-20k", 10, 0.2)}


def load_recipe():
    spec = importlib.util.spec_from_file_location("flowertune", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("challenge", sorted(TEMPLATES))
def test_each_preset_is_the_template_apps_protocol(challenge):
    config = load_recipe().protocol(challenge)
    dataset, clients, fraction = TEMPLATES[challenge]
    assert config.tasks == [dataset] and config.num_clients == clients and config.participation == fraction
    assert (config.strategy, config.rounds, config.local_steps, config.batch_size, config.max_length) == (
        "fedavg", 200, 10, 16, 512)
    assert (config.lora_r, config.lora_alpha, config.lora_dropout, config.load_in_4bit) == (32, 64, 0.075, True)
    assert (config.base_model, config.learning_rate, config.comm_budget_mb) == ("mistralai/Mistral-7B-v0.3", 5e-5,
                                                                                200_000)
    assert (config.zeta, config.partition) == (0.0, "iid")  # every client holds the dataset, in equal IID parts
    # client_app.py: each round's rate is cosine_annealing(round, rounds, learning-rate-max, learning-rate-min)
    assert (config.lr_round_schedule, config.learning_rate_min, config.lr_scheduler) == ("cosine", 1e-6, "constant")
    # the clients a round: the server's ⌈ξ·N⌉ equals Flower FedAvg's max(int(N·fraction), min_train_nodes=2)
    assert max(1, math.ceil(config.participation * clients - 1e-9)) == max(int(clients * fraction), 2)


def smollm2_lora() -> TaskVector:
    """LoRA r=32 on q_proj and v_proj of SmolLM2-135M's 30 layers (hidden 576, 3 of 9 heads for keys/values)."""
    tensors = {}
    for layer in range(30):
        at = f"base_model.model.model.layers.{layer}.self_attn."
        for module, rows in (("q_proj", 576), ("v_proj", 192)):
            tensors[f"{at}{module}.lora_A.weight"] = torch.randn(32, 576)
            tensors[f"{at}{module}.lora_B.weight"] = torch.randn(rows, 32)
    return TaskVector(tensors)


def test_the_wire_bytes_are_flowertunes_count_and_the_estimate_bounds_them():
    from flwr.app import ArrayRecord

    adapter = smollm2_lora()
    flowertune = ArrayRecord(dict(adapter.items())).count_bytes()  # FlowerTune's CommunicationTracker, per message
    reply = ClientUpdate(3, 7, {"shared": adapter}, {"fingpt": 1536}, {"train_loss": 1.2345678, "train_steps": 10.0})
    wire = len(reply.to_bytes(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", base_model_revision="0" * 40,
                              peft_config_hash="f" * 64))
    assert abs(wire - flowertune) / flowertune < 0.005 and wire > adapter.numel() * 4
    assert wire <= wire_size({"shared": adapter}, tasks=1) <= wire * 1.01
    assert len(pack_vectors({"shared": adapter}).to_bytes()) <= wire_size({"shared": adapter})
    assert wire_size({"shared": adapter}, integer=True) > 1.99 * adapter.numel() * 4  # masked: int64


def test_the_budget_counts_each_round_and_refuses_runs_and_rounds_that_would_pass_it(tiny_bert_dir, tiny_tasks_dir,
                                                                                    tmp_path, capsys):
    out = tmp_path / "run"
    results = run(make_config(tiny_bert_dir, tiny_tasks_dir, out, rounds=2, participation=0.5, comm_budget_mb=100))
    records = read_records(out)
    per_round = [r["bytes_uplink"] + r["bytes_downlink"] for r in records]
    assert [r["comm_budget"]["used_mb"] for r in records] == pytest.approx([per_round[0] / MB, sum(per_round) / MB])
    assert all(r["comm_budget"]["estimate_mb"] >= r["comm_budget"]["round_mb"] for r in records)
    assert results["bytes_uplink"] + results["bytes_downlink"] == sum(per_round)
    round_mb = max(per_round) / MB

    # before training: 3 rounds that need more than the budget; nothing is written
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match=r"^comm_budget_mb [\d.e-]+: 3 round\(s\) of about .* more than the budget"):
        run(make_config(tiny_bert_dir, tiny_tasks_dir, fresh, rounds=3, participation=0.5,
                        comm_budget_mb=2.5 * round_mb))
    assert not fresh.exists()
    # a resumed run counts the rounds it ran: 2 more rounds do not fit in 1.5 rounds' worth beyond them
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"2 round\(s\) .* on top of the .* MB used"):
        run(make_config(tiny_bert_dir, tiny_tasks_dir, out, rounds=4, participation=0.5,
                        comm_budget_mb=sum(per_round) / MB + 1.5 * round_mb), resume=True)
    assert (out / "metrics.jsonl").read_text() == before
    # round by round (here without the plan, stepping a federation by hand): round 2 would pass it
    federation = Federation(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "steps", participation=0.5,
                                        comm_budget_mb=1.5 * round_mb))
    state, record = federation.run_round(federation.initial_state(), 1)
    with pytest.raises(ConfigError, match=r"round 2 would move .* past the budget; the run stops after round 1 "
                                          r"\(resume it with --rounds 1"):
        federation.run_round(state, 2)
    # from the CLI: one line, exit 2
    flags = ["run", "--suite", "", "--tasks", *tiny_tasks_dir, "--base-model", tiny_bert_dir, "--num-clients", "4",
             "--rounds", "2", "--local-steps", "1", "--max-length", "16", "--min-samples", "4",
             "--comm-budget-mb", f"{round_mb:.6f}", "--output-dir", str(tmp_path / "cli")]
    capsys.readouterr()
    assert cli_main(flags) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the loading bars
    assert len(err) == 1 and err[0].startswith("hf-fedtask: error: comm_budget_mb") and not (tmp_path / "cli").exists()


def write_rows(path: Path, n: int, free_text: bool = False) -> Path:
    """Rows in FlowerTune's columns: finance-style sentiment questions with a label word as the answer, or (free
    text) answers that are sentences."""
    cues = {"negative": "losses widened", "neutral": "the board met", "positive": "profits soared"}
    instruction = "What is the sentiment of this news? Please choose an answer from {negative/neutral/positive}."
    with path.open("w") as f:
        for i in range(n):
            label = list(cues)[i % 3]
            answer = f"Quarter {i} was a {label} one." if free_text else label
            f.write(json.dumps({"instruction": instruction, "input": f"Acme: {cues[label]} in quarter {i}",
                                "output": answer}) + "\n")
    return path


def test_the_recipe_runs_the_finance_protocol_on_local_rows_and_counts_its_mb(tmp_path, capsys):
    recipe = load_recipe()
    rows = write_rows(tmp_path / "rows.jsonl", 600)
    out = tmp_path / "smoke"
    flags = ["--challenge", "finance", "--data", str(rows), "--base-model", "hf-fedtask/tiny-llama",
             "--no-load-in-4bit", "--rounds", "1", "--local-steps", "1", "--batch-size", "4", "--max-length", "64",
             "--output-dir", str(out)]
    assert recipe.main(flags) == 0
    assert recipe.main([*flags, "--resume"]) == 0  # the same run, found finished: its data reused, nothing rerun
    results = json.loads((out / "results.json").read_text())
    assert results["num_clients"] == 50 and len(read_records(out)[0]["clients"]) == 5  # 50 clients, 5 a round
    assert results["config"]["lora_r"] == 32 and results["config"]["comm_budget_mb"] == 200_000
    used = (results["bytes_uplink"] + results["bytes_downlink"]) / MB
    text = (out / "flowertune.md").read_text()
    assert f"| {used:,.2f} | {used:,.2f} | 200,000 |" in text and "--datasets=fpb,fiqa,tfns" in text
    assert "data: " + str(rows) in text and "load_in_4bit: False (FlowerTune: True)" in text
    assert "rounds: 1 (FlowerTune: 200)" in text
    # FlowerTune's finance prompt: instruction + " " + input; 120 rows (a fifth) held out as the test split
    from datasets import load_from_disk

    data = load_from_disk(str(Path(f"{out}_data") / "rows"))
    assert (len(data["train"]), len(data["test"])) == (480, 120)
    assert data["train"].features["answer"].names == ["negative", "neutral", "positive"]
    first = json.loads(rows.read_text().splitlines()[0])
    assert first["instruction"] + " " + first["input"] in list(data["train"]["prompt"]) + list(data["test"]["prompt"])


def test_the_recipe_refuses_a_4bit_base_without_a_gpu_and_free_text_answers_before_writing(tmp_path, capsys):
    recipe = load_recipe()
    rows = write_rows(tmp_path / "rows.jsonl", 60)
    if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
        out = tmp_path / "q4"
        assert recipe.main(["--challenge", "finance", "--data", str(rows), "--base-model", "hf-fedtask/tiny-llama",
                            "--output-dir", str(out)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and err[0].startswith("error: load_in_4bit: ")
        assert not out.exists() and not Path(f"{out}_data").exists()
    free = write_rows(tmp_path / "free.jsonl", 100, free_text=True)
    out = tmp_path / "finance"  # the finance challenge's answers are label words: free text is refused
    assert recipe.main(["--challenge", "finance", "--data", str(free), "--base-model", "hf-fedtask/tiny-llama",
                        "--no-load-in-4bit", "--output-dir", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the datasets bars
    assert len(err) == 1 and "answers in free text (100 distinct answers in 100 rows)" in err[0]
    assert not out.exists() and not Path(f"{out}_data").exists()


def test_the_recipe_runs_a_free_text_challenge_and_scores_it_against_the_base_model(tmp_path, capsys):
    recipe = load_recipe()
    rows = write_rows(tmp_path / "free.jsonl", 300, free_text=True)
    out = tmp_path / "general"
    assert recipe.main(["--challenge", "general", "--data", str(rows), "--base-model", "hf-fedtask/tiny-llama",
                        "--no-load-in-4bit", "--rounds", "2", "--local-steps", "10", "--batch-size", "4",
                        "--max-length", "256", "--learning-rate", "1e-2", "--output-dir", str(out)]) == 0
    from datasets import load_from_disk

    data = load_from_disk(str(Path(f"{out}_data") / "free"))  # general: the instruction alone; the response kept
    first = json.loads(rows.read_text().splitlines()[0])
    assert first["instruction"] in set(data["train"]["prompt"]) and first["output"] in set(
        data["train"]["answer"]) | set(data["test"]["answer"])
    results = json.loads((out / "results.json").read_text())
    r = results["tasks"]["free"]
    text = (out / "flowertune.md").read_text()
    cell = text.split("\n")[4]
    assert f"| {100 * r['token_accuracy']:.1f}, {r['answer_loss']:.3f} (base model: " in cell
    base = float(cell.split("(base model: ")[1].split(",")[0])
    assert 100 * r["token_accuracy"] >= base + 10, cell  # the responses are learned, well past the base model
    assert "MMLU accuracy" in text and "--category=stem,social_sciences,humanities" in text
    # with --generation-eval, the greedy responses' ROUGE-L beside the base model's
    out = tmp_path / "general_gen"
    assert recipe.main(["--challenge", "general", "--data", str(rows), "--base-model", "hf-fedtask/tiny-llama",
                        "--no-load-in-4bit", "--rounds", "1", "--local-steps", "2", "--batch-size", "4",
                        "--max-length", "256", "--generation-eval", "--holdout", "20",
                        "--output-dir", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())["tasks"]["free"]
    cell = (out / "flowertune.md").read_text().split("\n")[4]
    assert f"{100 * r['token_accuracy']:.1f}, {r['answer_loss']:.3f}, {100 * r['rougeL']:.1f} (base model: " in cell
