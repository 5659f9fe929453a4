"""FlowerTune LLM Leaderboard protocol: one challenge's template setting as an hf_fedtask run, its traffic
counted as FlowerTune counts it and held to the 200,000 MB budget.

    python recipes/flowertune.py --challenge finance                   # the finance challenge: a CUDA GPU, the Hub
    python recipes/flowertune.py --challenge finance --base-model HuggingFaceTB/SmolLM2-135M-Instruct
    python recipes/flowertune.py --challenge finance --data my_rows.jsonl --base-model hf-fedtask/tiny-llama \\
        --no-load-in-4bit --rounds 2 --local-steps 1 --max-length 64 --output-dir runs/flowertune_smoke   # offline

The protocol (`recipes/presets/flowertune_<challenge>.yaml`, each value beside its source line) is Flower's
template app for the challenge (`flwr new @flwrlabs/flowertune-llm-<challenge>`, read from
https://github.com/flwrlabs/flower/tree/main/examples/flowertune-llm-general-nlp and its finance, medical and code
siblings, and https://github.com/flwrlabs/flower/tree/main/benchmarks/flowertune-llm):

| challenge | dataset (fixed) | clients (fixed) | sampled a round | evaluated on |
|---|---|---|---|---|
| general | flwrlabs/alpaca-gpt4 | 20 | 2 (fraction 0.1) | MMLU STEM, social sciences, humanities |
| finance | flwrlabs/fingpt-sentiment-train | 50 | 5 (fraction 0.1) | FPB, FiQA, TFNS |
| medical | flwrlabs/medical-meadow-medical-flashcards | 20 | 2 (fraction 0.1) | PubMedQA, MedMCQA, MedQA, CareQA |
| code | flwrlabs/code-alpaca-20k | 10 | 2 (fraction 0.2) | MBPP, HumanEval, MultiPL-E JS and C++ |

Every challenge: FedAvg over 200 rounds of 10 local steps (batch 16, sequences of 512 tokens), LoRA r=32, α=64,
dropout 0.075 on PEFT's default modules of a 4-bit Mistral-7B-v0.3, and a communication budget of 200,000 MB
(1 MB = 2**20 bytes) over both directions of every round. The datasets were earlier vicgalle/alpaca-gpt4,
FinGPT/fingpt-sentiment-train and medalpaca/medical_meadow_medical_flashcards (flwrlabs/flower PR #5205).

The data are prepared as the template's `dataset.py` does (general: the instruction alone; finance and code:
instruction + " " + input; medical: the input) into a local folder beside the run (`<output_dir>_data/`), with
`--holdout` seeded rows kept out of training as the run's test split (FlowerTune trains on every row; its
leaderboard evaluates elsewhere). `--data FILE` replaces the Hub dataset by a local file or save_to_disk folder
with the same instruction / input / output columns: a smoke run, not a leaderboard run.

What is not FlowerTune's, and so what is comparable (the recipe prints it after the run):

- the count of MB, per round and in all, is the leaderboard's communication figure for the same protocol;
- the finance challenge's answers are a closed set of label words (its sentiment labels), trained as answers
  and scored by multiple-choice log-likelihood on the held-out rows; the general, medical and code challenges
  answer in free text, trained on the whole response (as the template's completion-only SFT) and scored on the
  held-out rows' reference responses by token accuracy and answer loss, beside the base model's;
- the prompt goes through the tokenizer's chat template, not the template's Alpaca prompt;
- the round's learning rate is the template's `cosine_annealing` from `learning_rate` (5e-5) to
  `learning_rate_min` (1e-6) over the rounds (`lr_round_schedule: cosine`), as in FlowerTune (so a 1-round smoke
  run trains at the minimum: give `--lr-round-schedule constant` there);
- accuracy on the held-out rows is not a leaderboard score: that is FlowerTune's `eval.py` on the exported
  adapter (`<output_dir>/adapters/<task>/`, its `--peft-path`), with the command the recipe prints.

Writes the run under `--output-dir` and `<output_dir>/flowertune.md` (the table, also with `--results-page`).
"""

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from hf_fedtask.config import RunConfig, load_yaml
from hf_fedtask.core.files import write_atomic
from hf_fedtask.engine.budget import MB
from hf_fedtask.errors import ConfigError, DataError, FedTaskError
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report

PRESETS = Path(__file__).resolve().parent / "presets"
COLUMNS = ("instruction", "input", "output")  # every FlowerTune dataset's
MAX_ANSWERS = 64  # more distinct answers than this: free-text responses, not label words
BUDGET_MB = 200_000


@dataclasses.dataclass(frozen=True)
class Challenge:
    """What FlowerTune fixes for a challenge beyond RunConfig keys: how its `dataset.py` builds the prompt, what
    the leaderboard evaluates, its template's score, and the evaluation command."""

    template: str  # examples/flowertune-llm-<template>
    prompt: str  # "instruction" | "instruction input" | "input": the columns joined by a space
    answers: str  # "labels" (a closed set of label words) | "free_text" (responses)
    evaluated: str
    baseline: str  # the template's result, benchmarks/flowertune-llm/evaluation/README.md
    evaluation: str  # the command of benchmarks/flowertune-llm/evaluation/<template>/README.md


CHALLENGES = {
    "general": Challenge("general-nlp", "instruction", "free_text", "MMLU accuracy: STEM, social sciences, humanities",
                         "12.82 (Mistral-7B template); SmolLM2-135M-Instruct, LoRA r=8, 100 rounds: 21.10 with "
                         "747.07 MB (TNI-playground)",
                         "python eval.py --base-model-name-path={base} --peft-path={adapter} --run-name=fl "
                         "--batch-size=16 --quantization=4 --category=stem,social_sciences,humanities"),
    "finance": Challenge("finance", "instruction input", "labels", "accuracy: FPB, FiQA, TFNS",
                         "45.27 (Mistral-7B template)",
                         "python eval.py --base-model-name-path={base} --peft-path={adapter} --run-name=fl "
                         "--batch-size=32 --quantization=4 --datasets=fpb,fiqa,tfns"),
    "medical": Challenge("medical", "input", "free_text", "accuracy: PubMedQA, MedMCQA, MedQA, CareQA",
                         "32.82 (Mistral-7B template)",
                         "python eval.py --base-model-name-path={base} --peft-path={adapter} --run-name=fl "
                         "--batch-size=16 --quantization=4 --datasets=pubmedqa,medmcqa,medqa,careqa"),
    "code": Challenge("code", "instruction input", "free_text", "pass@1: MBPP, HumanEval, MultiPL-E JS and C++",
                      "27.36 (Mistral-7B template)",
                      "python main.py --model={base} --peft_model={adapter} --max_length_generation=1024 "
                      "--batch_size=4 --use_auth_token --allow_code_execution --save_generations --save_references "
                      "--tasks=humaneval --metric_output_path=./evaluation_results_humaneval.json   # and mbpp, "
                      "multiple-js, multiple-cpp"),
}


def preset_path(challenge: str) -> Path:
    return PRESETS / f"flowertune_{challenge}.yaml"


def protocol(challenge: str) -> RunConfig:
    """The challenge's preset as a RunConfig (the leaderboard's setting, before any flag)."""
    path = preset_path(challenge)
    return RunConfig.from_dict(load_yaml(path), source=str(path))


def deviations(config: RunConfig, challenge: str, source: str) -> list[str]:
    """What makes this run differ from the leaderboard's protocol: the rows it trains on (`source`) and the keys
    that differ from the preset (where the run is written, how often it evaluates and the like aside)."""
    preset = protocol(challenge)
    # where and how the run is written and evaluated, and the seeds (FlowerTune fixes none): not the protocol
    ignored = (set(RunConfig.RESUMABLE_CHANGES) - {"rounds"}) | {"tasks", "suite", "comm_budget_mb", "seed",
                                                                 "training_seed", "max_test_samples"}
    if not config.load_in_4bit:  # the 4-bit data type is moot without 4 bits (load_in_4bit is the deviation)
        ignored |= {"bnb_4bit_quant_type", "bnb_4bit_use_double_quant"}
    mine, theirs = config.flat(), preset.flat()
    out = [f"{k}: {mine[k]!r} (FlowerTune: {theirs[k]!r})" for k in sorted(mine)
           if k not in ignored and mine[k] != theirs.get(k)]
    if source != preset.tasks[0]:
        out.insert(0, f"data: {source} (FlowerTune: {preset.tasks[0]})")
    if config.comm_budget_mb != BUDGET_MB:
        out.append(f"comm_budget_mb: {config.comm_budget_mb!r} (FlowerTune: {BUDGET_MB})")
    return out


def prompt_rows(rows, challenge: str, source: str) -> dict[str, list[str]]:
    """FlowerTune's `reformat` (the template's dataset.py): the prompt from the challenge's columns joined by a
    space, the answer from `output`."""
    missing = [c for c in COLUMNS if c not in rows.column_names]
    if missing:
        raise DataError(f"{source}: no {missing[0]!r} column (FlowerTune's datasets have {', '.join(COLUMNS)}; "
                        f"this one has {', '.join(rows.column_names)})")
    parts = CHALLENGES[challenge].prompt.split()
    columns = {c: rows[c] for c in parts}
    prompts = [" ".join(str(columns[c][i] or "") for c in parts).strip() for i in range(len(rows))]
    return {"prompt": prompts, "answer": [str(a).strip() for a in rows["output"]]}


def load_rows(source: str):
    """The challenge's training rows: a local csv/json/jsonl/parquet file or save_to_disk folder, else a Hub
    dataset id (its train split)."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    path = Path(source).expanduser()
    try:
        if path.is_dir():
            data = load_from_disk(str(path))
            return data["train"] if isinstance(data, DatasetDict) else data
        suffix = path.suffix.lower()
        if suffix in (".csv", ".json", ".jsonl", ".parquet"):
            if not path.is_file():
                raise DataError(f"--data {source}: no such file")
            return load_dataset({".jsonl": "json"}.get(suffix, suffix.lstrip(".")), data_files=str(path),
                                split="train")
        return load_dataset(source, split="train")
    except DataError:
        raise
    except Exception as e:  # offline, unknown id, gated, unreadable: one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{source}: cannot load the challenge's rows ({reason})") from e


def prepare_data(challenge: str, source: str, folder: Path, holdout: int, seed: int) -> Path:
    """The challenge's rows as an hf_fedtask task folder (save_to_disk: `prompt` and `answer`, a train split and
    `holdout` seeded test rows), reused when already prepared from the same source. The answer is a ClassLabel
    for a challenge of label words (refused in one line, before anything is written, where the rows answer in
    free text), else the response text, the folder's card saying `answers: free_text` (`load_task`)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
    from huggingface_hub import DatasetCard

    free_text = CHALLENGES[challenge].answers == "free_text"
    stamp = {"challenge": challenge, "source": source, "holdout": holdout, "seed": seed,
             "answers": CHALLENGES[challenge].answers}
    if (folder / "prepared.json").is_file() and json.loads((folder / "prepared.json").read_text()) == stamp:
        return folder
    rows = prompt_rows(load_rows(source), challenge, source)
    if free_text:
        data = Dataset.from_dict(rows, features=Features({"prompt": Value("string"), "answer": Value("string")}))
    else:
        answers = sorted(set(rows["answer"]))
        if len(answers) > MAX_ANSWERS:
            raise ConfigError(f"challenge {challenge}: {source} answers in free text ({len(answers):,} distinct "
                              f"answers in {len(rows['answer']):,} rows); the {challenge} challenge's answers are a "
                              f"closed set of label words (at most {MAX_ANSWERS}), scored as multiple choice")
        features = Features({"prompt": Value("string"), "answer": ClassLabel(names=answers)})
        data = Dataset.from_dict({"prompt": rows["prompt"], "answer": [answers.index(a) for a in rows["answer"]]},
                                 features=features)
    n_test = min(holdout, len(data) // 5)
    if n_test < 1:
        raise DataError(f"{source}: {len(data)} rows leave none to hold out for the run's test split")
    split = data.train_test_split(test_size=n_test, seed=seed)
    staging = folder.with_name(folder.name + ".staging")
    DatasetDict({"train": split["train"], "test": split["test"]}).save_to_disk(str(staging))
    if free_text:  # what load_task reads: the answers stay text
        DatasetCard(f"---\nanswers: free_text\n---\n\nFlowerTune {challenge} rows from {source}.\n").save(
            staging / "README.md")
    write_atomic(staging / "prepared.json", json.dumps(stamp) + "\n")
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def check_quantization(config: RunConfig) -> None:
    """A 4-bit base needs bitsandbytes and a CUDA GPU: refused here, in the run's own words, before the data
    are prepared (hf_fedtask.model.quantization)."""
    if not (config.load_in_4bit or config.load_in_8bit):
        return
    from hf_fedtask.model.device import resolve_device
    from hf_fedtask.model.quantization import quantization_config

    quantization_config(config.load_in_4bit, config.load_in_8bit, peft_method=config.peft_method,
                        device=resolve_device(config.device), mixed_precision=config.mixed_precision)


def preflight_before_data(config: RunConfig, *, resume: bool, overwrite: bool) -> None:
    """`hf_fedtask.engine.preflight.preflight` but for the task folder, which the data preparation writes next:
    the base model, the clients, DP, the trackers and the run folder, refused before any row is fetched."""
    from hf_fedtask.engine import preflight

    preflight.check_base_model(config.base_model, "--base-model")
    preflight.check_clients(config)
    preflight.check_privacy(config)
    preflight.check_trackers(config.report_to)
    preflight.check_output_dir(config, resume=resume, overwrite=overwrite)
    preflight.check_creatable(config.output_dir)


def base_model_scores(config: RunConfig) -> dict:
    """The held-out scores of the base model with the run's fresh adapter (LoRA's B is zero: the base model's own
    answers): what a free-text run's token accuracy is measured against."""
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.server import Server

    env = Environment(config)
    server = Server(env)
    scores = server.evaluate(env.initial)
    if config.generation_eval:  # the base model's greedy responses too (ROUGE-L)
        for task, extra in server.evaluate_generation(env.initial).items():
            scores[task].update(extra)
    return scores


def score_cells(config: RunConfig, results: dict, challenge: str, base: dict | None) -> tuple[str, str]:
    """The table's score header and cell: multiple-choice accuracy beside the majority label, or a free-text
    run's token accuracy and answer loss beside the base model's."""
    task = next(iter(results["tasks"]))
    r = results["tasks"][task]
    if CHALLENGES[challenge].answers == "labels":
        return ("held-out accuracy % (not a leaderboard score)",
                f"{100 * r['accuracy']:.1f} (majority label {100 * r['chance']:.1f})")
    b = base[task]
    if "rougeL" in r:  # --generation-eval: the greedy responses' ROUGE-L too
        return ("held-out token accuracy %, answer loss, ROUGE-L % of greedy responses (not a leaderboard score)",
                f"{100 * r['token_accuracy']:.1f}, {r['answer_loss']:.3f}, {100 * r['rougeL']:.1f} (base model: "
                f"{100 * b['token_accuracy']:.1f}, {b['answer_loss']:.3f}, {100 * b['rougeL']:.1f})")
    return ("held-out token accuracy %, answer loss (not a leaderboard score)",
            f"{100 * r['token_accuracy']:.1f}, {r['answer_loss']:.3f} (base model: {100 * b['token_accuracy']:.1f}, "
            f"{b['answer_loss']:.3f})")


def report(config: RunConfig, results: dict, challenge: str, deviated: list[str], base: dict | None = None) -> str:
    """The run against the leaderboard: the MB count (comparable), the held-out score (not), the deviations,
    and FlowerTune's evaluation command for the exported adapter."""
    c = CHALLENGES[challenge]
    used = (results["bytes_uplink"] + results["bytes_downlink"]) / MB
    rounds = max(results["rounds"], 1)
    sampled = max(1, math.ceil(config.participation * config.client_count - 1e-9))  # as the server samples
    task = next(iter(results["tasks"]))
    header, cell = score_cells(config, results, challenge, base)
    adapter = Path(config.output_dir) / "adapters" / task
    how = ("multiple-choice log-likelihood" if c.answers == "labels" else
           "the reference responses' tokens, teacher-forced (token accuracy: the share that is the model's greedy "
           "next token; answer loss: their mean negative log-likelihood in nats)")
    lines = [
        f"FlowerTune LLM, {challenge} challenge (template `flowertune-llm-{c.template}`): {config.base_model}"
        f"{' in 4-bit' if config.load_in_4bit else ''} + LoRA r={config.lora_r}, α={config.lora_alpha}; "
        f"{config.client_count} clients, {sampled} a round; {results['rounds']} rounds × {config.local_steps} "
        f"steps (batch {config.batch_size}, {config.max_length} tokens, lr {config.learning_rate}).",
        "",
        f"| MB used (FlowerTune's count) | MB a round | budget MB | {header} |",
        "|---|---|---|---|",
        f"| {used:,.2f} | {used / rounds:,.2f} | {f'{config.comm_budget_mb:,.0f}' if config.comm_budget_mb else '-'} | "
        f"{cell} |",
        "",
        f"Comparable to the leaderboard: the MB count (parameters both ways, every round, 2**20 bytes a MB), for "
        f"this protocol. Not comparable: the score, on {results['tasks'][task]['num_examples']} held-out "
        f"training rows by {how}; the leaderboard's score is {c.evaluated}, by "
        f"FlowerTune's evaluation of the adapter (template: {c.baseline}):",
        "",
        "```bash",
        c.evaluation.format(base=config.base_model_id or config.base_model, adapter=adapter),
        "```",
        "",
        ("Deviations from the leaderboard protocol: " + "; ".join(deviated) + ".") if deviated else
        "No deviation from the template's RunConfig keys (see the recipe's docstring for what is not FlowerTune's).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--challenge", required=True, choices=sorted(CHALLENGES),
                        help="the leaderboard challenge whose protocol to run (recipes/presets/flowertune_<name>.yaml)")
    parser.add_argument("--data", metavar="PATH",
                        help="a local file or save_to_disk folder with instruction / input / output columns instead "
                        "of the challenge's Hub dataset (a smoke run, not a leaderboard run)")
    parser.add_argument("--holdout", type=int, default=1000, metavar="N",
                        help="rows kept out of training as the run's test split (at most a fifth; default 1000)")
    parser.add_argument("--data-dir", type=Path, metavar="DIR",
                        help="where the prepared task folder goes (default: <output_dir>_data)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.holdout < 1:
            raise ConfigError(f"--holdout must be at least 1, got {args.holdout}")
        preset = load_yaml(preset_path(args.challenge))
        if args.load_in_4bit is False:  # a full-precision base: no 4-bit data type to choose
            for key in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant"):
                preset.pop(key, None)
        config = recipe_config(args, preset, {}, ranks=True)
        if not config.tasks or len(config.tasks) != 1:
            raise ConfigError(f"--tasks: a FlowerTune challenge trains on its one dataset; give --data PATH to "
                              f"replace it, got {config.tasks}")
        source = args.data or config.tasks[0]
        deviated = deviations(config, args.challenge, source)
        check_quantization(config)  # before anything is downloaded or written
        name = Path(source).stem if args.data else source.rstrip("/").split("/")[-1]
        folder = (args.data_dir or Path(f"{config.output_dir}_data")) / name
        config = dataclasses.replace(config, tasks=[str(folder)], suite=None)
        preflight_before_data(config, resume=args.resume, overwrite=args.overwrite)
        prepare_data(args.challenge, source, folder, args.holdout, config.seed)
        from hf_fedtask.engine.run import run

        results = run(config, resume=args.resume, overwrite=args.overwrite)
        base = base_model_scores(config) if CHALLENGES[args.challenge].answers == "free_text" else None
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md = report(config, results, args.challenge, deviated, base)
    out = Path(config.output_dir)
    write_atomic(out / "flowertune.md", md + "\n")
    print(md)
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, md, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
