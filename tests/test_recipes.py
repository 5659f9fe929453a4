"""The recipes as a user runs them: the main job's outputs (table, plot, results, adapters, compact
export, push command), the paper preset's image path on a tiny ViT, and the comparison tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[1] / "recipes"


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_flags(tiny_bert_dir, tiny_tasks_dir, out):
    return ["--tasks", *tiny_tasks_dir, "--base-model", tiny_bert_dir, "--base-model-id", "hf-internal/tiny-bert",
            "--num-clients", "4", "--rounds", "2", "--local-steps", "2", "--batch-size", "8", "--max-length", "16",
            "--min-samples", "4", "--participation", "0.5", "--output-dir", str(out)]


def test_main_job_prints_the_table_and_leaves_everything_a_user_needs(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    out = tmp_path / "matu30"
    page = tmp_path / "docs" / "matu.md"
    page.parent.mkdir()
    page.write_text("# MaTU\n\nkept\n")
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out) + ["--results-page", str(page)]
    assert load_recipe("matu_30task").main(flags) == 0
    printed = capsys.readouterr().out
    written = page.read_text()  # --results-page: the printed table and wall time, with the command that made them
    assert written.startswith("# MaTU\n\nkept\n") and "<!-- results:matu30 start -->" in written
    assert "recipes/matu_30task.py --tasks" in written and "--results-page" in written and "wall time:" in written
    results = json.loads((out / "results.json").read_text())
    assert results["strategy"] == "matu" and results["config"]["zeta"] == 0.2 and results["rounds"] == 2
    assert results["config"]["eval_every"] == 4  # the main job evaluates every 4th round and after the last
    for task, r in results["tasks"].items():
        assert task in printed and f"{r['accuracy']:.4f}" in printed and f"{r['accuracy']:.4f}" in written
        assert (out / "adapters" / task / "adapter_model.safetensors").exists()
    assert (out / "accuracy_vs_round.png").stat().st_size > 1000
    assert (out / "compact" / "masks.safetensors").exists()
    assert f"hf-fedtask push {out / 'adapters'}" in printed
    assert f"{results['bytes_uplink']:,} bytes up" in printed


def test_main_job_bad_flag_is_one_line_and_writes_nothing(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    out = tmp_path / "bad"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out) + ["--combine", "average"]
    assert load_recipe("matu_30task").main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "combine" in err[0]
    assert not out.exists()


def test_paper_preset_runs_the_image_path_on_a_tiny_vit(tiny_vit_dir, tiny_image_tasks_dir, tmp_path):
    """The preset's model keys (LoRA r=16 on q/v projections, MaTU) with a tiny random ViT and
    synthetic images standing in for ViT-B/32 and the Hub datasets."""
    from peft import PeftModel
    from transformers import AutoModelForImageClassification

    out = tmp_path / "paper"
    flags = ["--preset", "paper", "--tasks", *tiny_image_tasks_dir, "--base-model", tiny_vit_dir,
             "--base-model-id", "hf-internal/tiny-vit", "--num-clients", "3", "--zeta", "0", "--rounds", "1",
             "--local-steps", "2", "--batch-size", "8", "--min-samples", "4", "--output-dir", str(out)]
    assert load_recipe("matu_30task").main(flags) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["lora_r"] == 16 and results["config"]["target_modules"] == ["q_proj", "v_proj"]
    task = next(iter(results["tasks"]))
    base = AutoModelForImageClassification.from_pretrained(tiny_vit_dir,
                                                           num_labels=results["tasks"][task]["num_labels"])
    PeftModel.from_pretrained(base, out / "adapters" / task)
    card = (out / "adapters" / task / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card and "AutoModelForImageClassification" in card


@pytest.mark.parametrize("preset", ["matu_vit_b32.yaml", "matu_vit_b32_8task.yaml"])
def test_presets_are_the_paper_settings(preset):
    from hf_fedtask.config import RunConfig

    config = RunConfig.from_yaml(RECIPES / "presets" / preset)
    assert config.strategy == "matu" and config.lora_r == 16 and config.num_clients == 30
    assert config.base_model == "google/vit-base-patch32-224-in21k"
    assert len(config.tasks) == (30 if preset == "matu_vit_b32.yaml" else 8)


def test_comparison_recipe_writes_both_tables_over_seeds(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    import numpy as np

    out = tmp_path / "cmp"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out) + ["--methods", "matu", "fedavg", "--rounds", "1",
                                                             "--seeds", "0", "1", "--partition", "iid",
                                                             "--settings", "single_task", "multi_task"]
    assert load_recipe("matu_8task").main(flags) == 0
    rows = json.loads((out / "comparison.json").read_text())
    assert set(rows) == {"single_task", "multi_task"}
    markdown = (out / "comparison.md").read_text()  # the multi-task title names the partition it ran with
    assert "Multi-task clients (ζ_t = 0.5), `iid` partition inside tasks" in markdown and "Dirichlet" not in markdown
    for setting, table in rows.items():
        assert [r["method"] for r in table] == ["matu", "fedavg"]  # no shipped reference for the tiny model
        runs = {m: [json.loads((out / f"seed{k}" / setting / m / "results.json").read_text()) for k in (0, 1)]
                for m in ("matu", "fedavg")}
        assert [r["config"]["seed"] for r in runs["matu"]] == [0, 1]
        assert runs["matu"][0]["config"]["output_space"] == "max"  # the recipe's shared head
        means = [r["mean_metric"] for r in runs["matu"]]
        assert (table[0]["mean"] == pytest.approx(np.mean(means))
                and table[0]["mean_std"] == pytest.approx(np.std(means)))
        assert table[0]["mean_compact"] == pytest.approx(np.mean([r["mean_metric_compact"] for r in runs["matu"]]))
        fedavg = table[1]
        ours = np.mean([(r["bytes_uplink"] + r["bytes_downlink"]) / r["rounds"] for r in runs["fedavg"]])
        assert fedavg["bytes_per_round"] == pytest.approx(ours)
        # the paper's protocol: a client holding n tasks moves its shared modules n times, not once
        extra = []
        for r in runs["fedavg"]:
            history = [json.loads(x)
                       for x in (Path(r["config"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
            extra.append(np.mean([sum(8 * r["shared_parameters"] * (len(r["allocation"][str(c)]) - 1)
                                      for c in h["clients"])
                                  for h in history]))
        assert fedavg["paper_bytes_per_round"] == pytest.approx(ours + np.mean(extra))
        assert (fedavg["paper_bytes_per_round"] > ours) == (setting == "multi_task")
        assert "paper_bytes_per_round" not in table[0]
    md = (out / "comparison.md").read_text()
    assert "Single-task clients" in md and "Multi-task clients" in md and "±" in md and "one adapter per task" in md
    assert "output space `max`" in md and (out / "comparison.png").exists()


def test_ntkfedavg_recipe_tables_plots_and_unlearning(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    out = tmp_path / "ntk"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out)
    flags[flags.index("--num-clients") + 1] = "2"
    flags[flags.index("--participation") + 1] = "1.0"
    assert load_recipe("ntkfedavg_8task").main(flags + ["--forget", "colors", "--unlearn-rounds", "1"]) == 0
    report = (out / "ntkfedavg_8task.md").read_text()
    assert "| 2 |" in report and "ntkfedavg (same θ, non-linear)" in report
    assert "| 3 |" in report and "one-shot τ negation" in report  # the unlearning round and the one-shot row
    for regime in ("one_epoch", "local_work"):
        for strategy in ("fedavg", "ntkfedavg"):
            assert json.loads((out / regime / strategy / "results.json").read_text())["rounds"] == 2
    assert json.loads((out / "unlearn" / "ntkfedavg" / "results.json").read_text())["unlearning"]["tasks"] == ["colors"]
    assert (out / "accuracy_vs_round.png").stat().st_size > 1000 and (out / "unlearning.png").stat().st_size > 1000
    assert report.strip() in capsys.readouterr().out


def test_fedyolo_recipe_tables_communication_and_personalization(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    out = tmp_path / "fy"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out)
    del flags[flags.index("--tasks"):flags.index("--tasks") + 3]  # tasks come from --tasks-order here
    del flags[flags.index("--num-clients"):flags.index("--num-clients") + 2]  # 4 clients per task
    flags[flags.index("--rounds") + 1] = "1"
    flags[flags.index("--local-steps") + 1] = "1"
    flags += ["--tasks-order", *tiny_tasks_dir]
    module = load_recipe("fedyolo_multitask")
    assert module.main(flags) == 0
    report = (out / "fedyolo_multitask.md").read_text()
    for method in ("fedyolo", "fedyolo_share_half", "modular_fedavg", "full_fedavg", "fedyolo_secure"):
        assert f"| {method} |" in report
    assert "Full-update / modular FedAvg communication" in report and "Privacy variant" in report
    assert "forgetting ratio" in report and (out / "task0_vs_tasks.png").stat().st_size > 1000
    full = json.loads((out / "2_tasks" / "full_fedavg" / "results.json").read_text())
    modular = json.loads((out / "2_tasks" / "modular_fedavg" / "results.json").read_text())
    assert full["params_uplink"] > 100 * modular["params_uplink"]


def test_f2l2_recipe_table_decomposition_and_plot(tmp_path, capsys):
    """The backdoor recipe end to end on digits at a few rounds: every row, the removals' zero (F²L²)
    and one (SGA) client messages, the distance split, the plot."""
    out = tmp_path / "f2l2"
    flags = ["--tasks", "digits", "--backdoor-trigger", "3", "--rounds", "3", "--local-epochs", "1",
             "--negation-rounds", "1", "--rhos", "0.01", "--forms", "retained", "--retrain-orders", "1",
             "--output-dir", str(out)]
    assert load_recipe("f2l2_backdoor").main(flags) == 0
    table = json.loads((out / "f2l2_backdoor.json").read_text())
    rows = table["rows"]
    assert list(rows)[:3] == ["trained", "retrained", "retrained, training order 2"]
    assert rows["retrained"]["distance_to_retrain"] == 0
    assert rows["retrained, training order 2"]["distance_to_retrain"] > 0
    assert table["retraining_orders"] == ["retrained", "retrained, training order 2"]
    chosen = rows[table["default_row"]]  # the window's edge counts as inside (float error aside)
    assert table["default_within_goal"] == [abs(chosen["ta"] - rows[n]["ta"]) <= 0.01 + 1e-11
                                            and abs(chosen["bsr"] - rows[n]["bsr"]) <= 0.02 + 1e-11
                                            for n in table["retraining_orders"]]
    assert "Retraining's own spread over 2 training orders" in (out / "f2l2_backdoor.md").read_text()
    first, other = rows["retrained"], rows["retrained, training order 2"]  # can the window judge: order 2 vs 1
    assert table["retraining_within_goal"] == [abs(other["ta"] - first["ta"]) <= 0.01 + 1e-11
                                               and abs(other["bsr"] - first["bsr"]) <= 0.02 + 1e-11]
    assert table["default_inside_spread"] == all(
        min(first[k], other[k]) - window - 1e-11 <= chosen[k] <= max(first[k], other[k]) + window + 1e-11
        for k, window in (("ta", 0.01), ("bsr", 0.02)))
    (default,) = [name for name in rows if name.startswith("f2l2 (default: auto form, ρ=")]
    assert rows[default]["messages"] == 0 and rows["f2l2 split (λ=10 absolute)"]["messages"] == 0
    assert rows[default]["form"] in ("split", "retained")
    assert rows["f2l2 split (ρ=0.01)"]["form"] == "split" and rows["f2l2 split (default damping)"]["form"] == "split"
    assert rows["SGA"]["messages"] == 1
    assert (rows["FedAvg + negation (1 rounds)"]["messages"] == 3
            and rows["FedAvg trained"]["distance_to_retrain"] is None)
    decomposition = table["decomposition"]  # the default removal's damping and form: λ = ρ·λ_max(H_s)
    assert decomposition["form"] == rows[default]["form"] and decomposition["hessian"] == "server"  # no factors
    (oracle,) = [name for name in rows if name.endswith("the retained clients' own Hessian (simulation only)")]
    assert rows[oracle]["form"] == rows[default]["form"] and rows[oracle]["distance_to_retrain"] == pytest.approx(
        decomposition["exact_step_to_retrain"], rel=1e-6)
    assert decomposition["lambda"] == pytest.approx(decomposition["rho"] * decomposition["lambda_max"], rel=1e-6)
    # --forms: the same ρ, another form
    swept, retained = rows["f2l2 split (ρ=0.01)"], rows["f2l2 retained (ρ=0.01)"]
    assert swept["lambda"] == retained["lambda"] == pytest.approx(0.01 * decomposition["lambda_max"], rel=1e-6)
    assert swept["distance_to_retrain"] != retained["distance_to_retrain"]
    assert "Hessian approximation" in (out / "f2l2_backdoor.md").read_text() and (out / "f2l2_backdoor.png").exists()


@pytest.mark.slow  # the recipe's one-seed table is the default suite's (above); --seeds is llm_manytask's too
def test_f2l2_recipe_over_seeds_tabulates_each_seed_and_their_mean(tmp_path, capsys):
    """--seeds: one protocol per seed in its own folder (its own partition and training), then each row's
    mean over the seeds and on how many it is within the goal, from the seeds' own tables; --seed with
    --seeds, a repeated seed and a negative --retrain-orders are refused before anything is written."""
    out = tmp_path / "f2l2"
    flags = ["--tasks", "digits", "--backdoor-trigger", "3", "--rounds", "3", "--local-epochs", "1",
             "--negation-rounds", "0", "--rhos", "--l2s", "--retrain-orders", "0", "--output-dir", str(out)]
    recipe = load_recipe("f2l2_backdoor")
    assert recipe.main(flags + ["--seeds", "0", "1", "--seed", "1"]) == 2 and not out.exists()
    assert recipe.main(flags + ["--seeds", "0", "0"]) == 2 and not out.exists()
    assert recipe.main(flags + ["--seeds", "0", "--retrain-orders", "-1"]) == 2 and not out.exists()
    assert recipe.main(flags + ["--seeds", "0", "1"]) == 0
    seeds = [json.loads((out / f"seed_{s}" / "f2l2_backdoor.json").read_text()) for s in (0, 1)]
    assert [s["seed"] for s in seeds] == [0, 1]
    assert seeds[0]["rows"]["trained"]["ta"] != seeds[1]["rows"]["trained"]["ta"]
    table = json.loads((out / "f2l2_backdoor.json").read_text())
    for name, row in table["rows"].items():
        per_seed = [s["rows"][name] for s in seeds]
        assert row["ta"][0] == pytest.approx(100 * (per_seed[0]["ta"] + per_seed[1]["ta"]) / 2)
        assert row["delta_bsr"][0] == pytest.approx(50 * sum(r["bsr"] - s["rows"]["retrained"]["bsr"]
                                                             for r, s in zip(per_seed, seeds)))
        assert row["within_goal"] == sum(abs(r["ta"] - s["rows"]["retrained"]["ta"]) <= 0.01 + 1e-11
                                         and abs(r["bsr"] - s["rows"]["retrained"]["bsr"]) <= 0.02 + 1e-11
                                         for r, s in zip(per_seed, seeds))
    assert table["rows"]["retrained"]["within_goal"] == 2 and (out / "f2l2_backdoor.png").exists()
    assert "over 2 seeds (0, 1" in (out / "f2l2_backdoor.md").read_text()


def test_tct_text_recipe_reports_accuracy_and_costs(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    out = tmp_path / "tct"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out) + ["--participation", "1", "--rounds", "3", "--tct-stage1",
                                                              "1", "--tct-features", "64", "--tct-steps", "5",
                                                              "--settings", "tasks", "--max-train-samples", "64"]
    assert load_recipe("tct_text").main(flags + ["--results-page", str(tmp_path / "tct.md")]) == 0
    page = (tmp_path / "tct.md").read_text()  # the recipe's own table, under its command
    assert page.startswith("# tct\n") and (out / "tct_text.md").read_text().strip() in page
    assert "recipes/tct_text.py" in page and "- commit: `" in page and "- hardware: " in page
    result = json.loads((out / "tct_text.json").read_text())
    assert set(result["final"]["tasks"]) == {"fedavg", "tct_p64"}
    cost = result["costs"]["tasks/tct_p64"]
    assert cost["features_s"] > 0 and cost["stage2_s"] > 0
    assert len(result["per_round"]["tasks"]["tct_p64"]) == 3 and (out / "tct_text.png").exists()


def test_recipe_threads_replace_accelerates_default_but_respect_the_user(tmp_path):
    """`accelerate launch` gives the script OMP_NUM_THREADS=1 unless told otherwise: recipes then use every
    core they may; a user's OMP_NUM_THREADS or `--threads` wins."""
    import os
    import shutil
    import subprocess
    import sys

    from hf_fedtask.errors import ConfigError
    from hf_fedtask.workflows.recipe import set_threads

    accelerate = shutil.which("accelerate") or str(Path(sys.executable).with_name("accelerate"))
    script = tmp_path / "threads.py"
    script.write_text("import torch\nfrom hf_fedtask.workflows.recipe import set_threads\n"
                      "print('SAID', set_threads(None)); print('GOT', torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))

    def launched(extra_env=None, flags=()):
        done = subprocess.run([accelerate, "launch", *flags, str(script)], env={**env, **(extra_env or {})},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-1500:]
        return int(next(line for line in done.stdout.splitlines() if line.startswith("GOT")).split()[1])

    assert launched() == cores
    assert launched({"OMP_NUM_THREADS": "1"}) == 1
    assert launched(flags=("--num_cpu_threads_per_process", "1")) == 1
    assert set_threads(1) == "1 (--threads)"
    with pytest.raises(ConfigError, match="--threads"):
        set_threads(0)


def test_llm_recipe_table_normalizes_by_individual_and_reports_lora_errors(tiny_tasks_dir, tmp_path, capsys):
    out = tmp_path / "llm"
    flags = ["--base-model", "hf-fedtask/tiny-llama", "--suite", "", "--tasks", *tiny_tasks_dir,
             "--num-clients", "2", "--participation", "1.0", "--rounds", "2", "--eval-every", "2",
             "--local-steps", "2", "--max-length", "128", "--min-samples", "4",
             "--max-train-samples", "48", "--max-test-samples", "8", "--output-dir", str(out)]
    assert load_recipe("llm_manytask").main(flags) == 0
    rows = {r["method"]: r for r in json.loads((out / "comparison.json").read_text())}
    assert list(rows) == ["fedavg", "fedavg_product", "matu", "fedyolo", "individual", "majority label"]
    majority = rows.pop("majority label")  # always the most frequent test label: results.json's chance
    results = {m: json.loads((out / m / "results.json").read_text()) for m in rows}
    assert majority["tasks"] == {t: r["chance"] for t, r in results["fedavg"]["tasks"].items()}
    individual = {t: r["accuracy"] for t, r in results["individual"]["tasks"].items()}
    for method, row in rows.items():
        acc = {t: r["accuracy"] for t, r in results[method]["tasks"].items()}
        assert row["normalized"] == pytest.approx(
            sum(acc[t] / individual[t] for t in acc if individual[t] > 0) / sum(v > 0 for v in individual.values()))
        assert row["exact_match"] == results[method]["mean_exact_match"]
    assert results["individual"]["config"]["zeta"] == 0.0 and results["individual"]["strategy"] == "fedyolo"
    assert len(rows["fedavg"]["lora_factor_error_per_round"]) == 2 and rows["fedavg"]["lora_factor_error"] > 0
    assert len(rows["fedavg_product"]["lora_truncation_residual_per_round"]) == 2
    assert "compact_ratio" in rows["matu"] and (out / "comparison.png").exists()
    md = (out / "comparison.md").read_text()
    assert "fedavg: LoRA factor error per round" in md and "exact match" in md


def test_llm_recipe_over_seeds_states_which_differences_are_within_noise(tiny_tasks_dir, tmp_path, capsys):
    """--seeds and --test-examples: one run per method and seed, mean ± std over seeds, each test example scored
    again from the final state (matching results.json), and the paired bootstrap's verdicts in the table."""
    out = tmp_path / "llm_seeds"
    flags = ["--base-model", "hf-fedtask/tiny-llama", "--suite", "", "--tasks", *tiny_tasks_dir,
             "--num-clients", "2", "--participation", "1.0", "--rounds", "1", "--local-steps", "1",
             "--max-length", "128", "--min-samples", "4", "--max-train-samples", "24", "--test-examples", "6",
             "--no-generation-eval", "--methods", "fedavg", "matu", "individual", "--seeds", "0", "1",
             "--output-dir", str(out)]
    assert load_recipe("llm_manytask").main(flags) == 0
    rows = {r["method"]: r for r in json.loads((out / "comparison.json").read_text())}
    assert list(rows) == ["fedavg", "matu", "individual", "majority label"]
    for method in ("fedavg", "matu", "individual"):
        runs = [json.loads((out / f"seed{k}" / method / "results.json").read_text()) for k in (0, 1)]
        assert [r["config"]["seed"] for r in runs] == [0, 1] and runs[0]["config"]["max_test_samples"] == 6
        means = [r["mean_metric"] for r in runs]
        assert rows[method]["mean"] == pytest.approx(sum(means) / 2)
        assert rows[method]["mean_std"] == pytest.approx(abs(means[0] - means[1]) / 2)
        for k, r in zip((0, 1), runs):
            outcomes = json.loads((out / f"seed{k}" / method / "test_outcomes.json").read_text())
            for task, o in outcomes.items():
                assert len(o["correct"]) == 6 and sum(o["correct"]) / 6 == pytest.approx(r["tasks"][task]["accuracy"])
    noise = {(c["a"], c["b"]): c for c in json.loads((out / "noise.json").read_text())}
    assert set(noise) == {("fedavg", "majority label"), ("matu", "majority label"), ("individual", "majority label"),
                          ("matu", "fedavg"), ("individual", "fedavg")}
    for (a, b), c in noise.items():
        assert c["difference"] == pytest.approx(rows[a]["mean"] - rows[b]["mean"])
        assert c["within_noise"] == (c["low"] <= 0 <= c["high"])
    assert noise[("matu", "fedavg")]["normalized_difference"] == pytest.approx(
        rows["matu"]["normalized"] - rows["fedavg"]["normalized"])
    md = (out / "comparison.md").read_text()
    assert "| majority label |" in md and "- matu − fedavg: " in md and "seeds 0, 1 (mean ± std over seeds" in md


def test_llm_recipe_bootstrap_is_paired_and_sized_by_the_examples():
    """The noise statement's interval: zero width for two methods right on the same examples (paired draws),
    a certain difference where one is always right, and about ±1.96·sqrt(2·p(1−p)/n) for independent coins."""
    import numpy as np

    recipe = load_recipe("llm_manytask")
    rng = np.random.default_rng(1)
    coins = [{"t": rng.integers(0, 2, 400).astype(float)}]
    same = recipe.noise_comparisons({"a": coins, "b": coins, "majority label": coins}, ["a", "b"])
    assert all(c["low"] == c["high"] == c["difference"] == 0 and c["within_noise"] for c in same)
    sure = recipe.noise_comparisons({"a": [{"t": np.ones(50)}], "majority label": [{"t": np.zeros(50)}]}, ["a"])
    assert sure[0]["low"] == sure[0]["high"] == 1 and not sure[0]["within_noise"]
    other = [{"t": rng.integers(0, 2, 400).astype(float)}]
    (c,) = [c for c in recipe.noise_comparisons({"a": coins, "majority label": other}, ["a"])]
    assert (c["high"] - c["low"]) / 2 == pytest.approx(1.96 * np.sqrt(2 * 0.25 / 400), rel=0.2)


def test_label_skew_recipe_tabulates_curves_and_epochs_over_seeds(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    """recipes/matu_label_skew.py on the tiny model: the rounds study's curve (evaluated every 2 rounds) and
    the local-epochs study, each cell the mean over seeds of the runs' own per-round metrics."""
    import statistics

    out = tmp_path / "skew"
    flags = tiny_flags(tiny_bert_dir, tiny_tasks_dir, out)
    flags = flags[:flags.index("--rounds")] + flags[flags.index("--rounds") + 2:flags.index("--output-dir")]
    argv = [*flags, "--seeds", "0", "1", "--methods", "matu_per_task_downlink", "fedavg", "--epochs-methods",
            "fedavg", "--long-rounds", "4", "--eval-every", "2", "--epochs-rounds", "1", "--local-epochs", "2",
            "--output-dir", str(out), "--predictions"]
    assert load_recipe("matu_label_skew").main(argv) == 0
    text = (tmp_path / "skew.md").read_text()
    assert "| round 2 | round 4 |" in text and "1 rounds × 2 epochs (seeds)" in text
    data = json.loads((tmp_path / "skew.json").read_text())
    assert set(data["rounds"]) == {"matu_per_task_downlink", "fedavg"} and set(data["epochs"]) == {"fedavg"}
    run = json.loads((out.parent / "skew_rounds" / "seed1" / "multi_task" / "fedavg" / "results.json").read_text())
    assert run["config"]["rounds"] == 4 and run["config"]["eval_every"] == 2 and run["config"]["seed"] == 1
    epochs_run = json.loads((out.parent / "skew_epochs" / "seed0" / "multi_task" / "fedavg" / "results.json")
                            .read_text())
    assert epochs_run["config"]["local_epochs"] == 2.0
    fedavg = [data["rounds"]["fedavg"][str(k)]["rounds"]["4"] for k in (0, 1)]
    row = next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    assert f"{100 * statistics.mean(fedavg):.1f} ± {100 * statistics.stdev(fedavg):.1f}" in row
    assert (tmp_path / "skew.png").exists() and "table:" in capsys.readouterr().out
    # per run and task: the accuracy the run itself recorded, the classes predicted, the majority share
    predictions = (tmp_path / "skew_predictions.md").read_text().splitlines()
    task, scores = next(iter(run["tasks"].items()))
    row = next(line for line in predictions if line.startswith(f"| rounds | 1 | fedavg | {task} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) == pytest.approx(100 * scores["accuracy"], abs=0.05)
    predicted, classes = map(int, cells[5].split(" / "))
    assert 1 <= predicted <= classes == scores["num_labels"] and 0 < float(cells[6]) <= 100
    assert sum(line.startswith("| epochs | ") for line in predictions) == 2 * len(run["tasks"])


def test_the_sgd_probes_refuse_an_optimizer_they_would_override(tmp_path, capsys):
    """scaffold and fedavg_sgd run SGD at lr 0.3; asked for another rate, the recipe says so (exit 2) and
    runs nothing, instead of overriding it for them."""
    recipe = load_recipe("matu_8task")
    out = tmp_path / "probe"
    flags = ["--methods", "fedavg", "scaffold", "--seeds", "0", "--learning-rate", "0.0005", "--output-dir", str(out)]
    assert recipe.main(flags) == 2
    err = capsys.readouterr().err
    assert "--methods scaffold train with SGD at lr 0.3" in err and err.count("\n") == 1, err
    assert not out.exists()
