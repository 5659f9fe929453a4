"""Score an exported causal-LM adapter with lm-evaluation-harness (`hf-fedtask evaluate ADAPTER --lm-eval TASKS`).

The field's standard benchmarks (MMLU, GSM8K, ARC, HellaSwag, ... and any task of one's own written as an
lm-eval YAML) are scored by lm-eval itself, the way its users score an adapter: `HFLM(pretrained=<base>,
peft=<adapter folder>)` and `lm_eval.simple_evaluate`. What hf_fedtask adds is what lm-eval cannot know:
where the adapter's base model is on this machine (the embedded SmolLM2 converted into the Hugging Face
cache, hf_fedtask's tiny Llama, the run's local folder; `hf_fedtask.model.backbone.resolve_base_model`,
checked against the weights the adapter records as `hf-fedtask evaluate` checks them), and where the scores
go: lm-eval's output as `lm_eval.json` in the adapter folder and a table in its model card (README.md, with
model-index entries for the Hub), both replaced by the next call.

lm-eval is an optional dependency: `pip install "hf-fedtask[lm-eval]"`."""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.export.adapter import LM_EVAL_FILE, read_adapter_folder
from hf_fedtask.export.standalone import _check_base, _head_rows, _record

INSTALL = 'pip install "hf-fedtask[lm-eval]"'
CARD_HEADING = "## lm-evaluation-harness"
SOURCE = "lm-evaluation-harness"  # the model-index entries' source_name: which entries a new call replaces
SOURCE_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
_DTYPE = "float32"  # as hf_fedtask trains and scores a causal LM (`hf_fedtask.model.backbone.load_classifier`)


def _lm_eval():
    """The `lm_eval` package, or one ConfigError naming the extra that installs it."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (its [hf] dependencies: accelerate, peft)
    except ImportError as exc:
        raise ConfigError(f"--lm-eval needs lm-evaluation-harness ({exc}): {INSTALL}") from None
    return lm_eval


@cache
def _task_manager(include: tuple[str, ...]):
    """lm-eval's task index: its own tasks and those under `include` (which win over its own of the same name),
    as its CLI builds it with --include_path; built once per process (it reads ~15,000 task files, seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None)


def _tasks(names: Sequence[str], include: Sequence[str | Path]):
    """(TaskManager, the task and group names, globs expanded as lm-eval's CLI expands them); an unknown name
    or a missing include folder is one ConfigError."""
    for folder in include:
        if not Path(folder).is_dir():
            raise ConfigError(f"--lm-eval-include {folder}: no such folder")
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ConfigError("--lm-eval: give one or more lm-eval task names, comma-separated (e.g. arc_easy,mmlu)")
    manager = _task_manager(tuple(str(Path(p).absolute()) for p in include))
    found = []
    for name in names:
        matched = manager.match_tasks([name])
        if not matched:
            close = difflib.get_close_matches(name, manager.all_tasks, n=1, cutoff=0.6)
            where = (" or under --lm-eval-include (lm-eval skips a YAML file it cannot read)" if include
                     else " (a task of your own: --lm-eval-include FOLDER)")
            raise ConfigError(f"--lm-eval {name!r}: no such task, group or tag in lm-eval {_version()}{where}"
                              + (f"; did you mean {close[0]}?" if close else ""))
        found += [m for m in matched if m not in found]
    return manager, found


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _causal_lm_adapter(adapter_dir: Path) -> dict:
    """The adapter's config, refused in one line unless it is a causal LM's (no classification head)."""
    config, tensors = read_adapter_folder(adapter_dir)
    task_type = config.get("task_type")
    if task_type not in (None, "CAUSAL_LM") or _head_rows(tensors) is not None:
        raise ConfigError(f"{adapter_dir}: a classifier's adapter (task_type {task_type}, a classification head): "
                          "lm-evaluation-harness scores causal LMs; score it with `hf-fedtask evaluate "
                          f"{adapter_dir} --task TASK`")
    return config


def _base(adapter_dir: Path, config: dict, base_model: str | None):
    """The base model's BaseModelRef, as `hf-fedtask evaluate` finds it (the recorded Hub id, the run's local
    folder, or `base_model`), refused in one line unless it is the base the adapter was trained on."""
    from hf_fedtask.model.backbone import resolve_base_model

    recorded = config["base_model_name_or_path"]
    rec = _record(adapter_dir, recorded)
    ref = resolve_base_model(base_model or rec.base_model or recorded)
    _check_base(adapter_dir, ref, rec, "causal_lm", recorded)
    return ref


def run_lm_eval(adapter_dir: str | Path, tasks: Sequence[str], *, include: Sequence[str | Path] = (),
                limit: int | float | None = None, num_fewshot: int | None = None, batch_size: int | str = 8,
                apply_chat_template: bool = False, base_model: str | None = None, device: str = "auto",
                log_samples: bool = False, write: bool = True) -> dict:
    """lm-eval's results for the adapter on `tasks` (task, group or tag names, or globs, as lm-eval's
    `--tasks` takes them), through `HFLM(pretrained=<base>, peft=<adapter_dir>)` in float32 and
    `lm_eval.simple_evaluate`. `include`: folders of task YAMLs of one's own (lm-eval's
    `--include_path`); `limit`, `num_fewshot`, `batch_size`, `apply_chat_template`: lm-eval's own options;
    `base_model`: a local folder or Hub id of the base, instead of the one the adapter records; `device`:
    auto (a GPU when there is one), cpu, cuda or cuda:N.

    With `write`, lm-eval's output (without the per-example samples) goes to `adapter_dir/lm_eval.json` and a
    table of the scores into the folder's model card (README.md), when it has one; both replace those of an
    earlier call. Returned: that output (with lm-eval's `samples` when `log_samples`) and an `hf_fedtask`
    entry saying what was scored. Refused in one ConfigError line, before the model loads: lm-eval not
    installed, an unknown task name, an adapter that is not a causal LM's, another base model."""
    adapter_dir = Path(adapter_dir)
    adapter_config = _causal_lm_adapter(adapter_dir)
    lm_eval = _lm_eval()
    manager, names = _tasks(tasks, include)
    ref = _base(adapter_dir, adapter_config, base_model)  # may build or convert it (the embedded SmolLM2: once, ~30 s)
    from lm_eval.models.huggingface import HFLM

    from hf_fedtask.model.backbone import quiet_peft_wrap
    from hf_fedtask.model.device import resolve_device

    # an export carries the tokenizer (and chat template) it was trained with; an adapter made elsewhere may not
    tokenizer = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else ref.load_path
    with quiet_peft_wrap():
        model = HFLM(pretrained=ref.load_path, peft=str(adapter_dir), tokenizer=str(tokenizer),
                     device=str(resolve_device(device)), dtype=_DTYPE, batch_size=batch_size)
    try:
        results = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, apply_chat_template=apply_chat_template,
                                          log_samples=log_samples)
    except (OSError, ConnectionError) as exc:  # a dataset not in the datasets cache, offline; a missing data file
        raise FedTaskError(f"lm-eval could not load the data of {', '.join(names)}: "
                           f"{' '.join(str(exc).split())[:300]}") from None
    settings = results.get("config") or {}
    if settings.get("model") == ref.load_path:  # a local folder (the cache's): name the base as the adapter does
        settings["model"] = ref.model_id
    results["hf_fedtask"] = {"adapter": adapter_dir.absolute().name, "base_model": ref.model_id,
                             "base_model_revision": ref.revision, "tasks": names, "dtype": _DTYPE,
                             "apply_chat_template": bool(apply_chat_template), "limit": limit}
    if write:
        _write(adapter_dir, results)
    return results


def top_level(results: dict) -> list[str]:
    """The tasks and groups of `results` that are no group's member: what was asked for (a group's score
    aggregates its members', e.g. mmlu's 57 subjects; a tag's tasks stand on their own)."""
    members = {m for subtasks in (results.get("group_subtasks") or {}).values() for m in subtasks}
    scored = {**(results.get("results") or {}), **(results.get("groups") or {})}
    return [name for name in scored if name not in members]


def score_rows(results: dict) -> list[list]:
    """[task, metric, value, stderr, n-shot, examples] per score of each top-level task or group; the metric is
    lm-eval's name, with its filter when that is not `none` (e.g. `exact_match (strict-match)`)."""
    scored = {**(results.get("results") or {}), **(results.get("groups") or {})}
    rows = []
    for name in top_level(results):
        entry = scored[name]
        samples = (results.get("n-samples") or {}).get(name, {}).get("effective", entry.get("sample_len"))
        for key, value in entry.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = entry.get(f"{metric}_stderr,{filt}")
            rows.append([name, metric if filt == "none" else f"{metric} ({filt})", value,
                         stderr if isinstance(stderr, (int, float)) else "–",
                         (results.get("n-shot") or {}).get(name, "–"), samples if samples is not None else "–"])
    return rows


def _write(adapter_dir: Path, results: dict) -> None:
    """lm_eval.json and the card's table (see `run_lm_eval`)."""
    from huggingface_hub import EvalResult
    from lm_eval.utils import handle_non_serializable

    from hf_fedtask.core.files import write_atomic
    from hf_fedtask.export.hub import put_card_section

    body = {k: v for k, v in results.items() if k != "samples"}
    write_atomic(adapter_dir / LM_EVAL_FILE, json.dumps(body, indent=2, default=handle_non_serializable,
                                                         ensure_ascii=False) + "\n")
    card = adapter_dir / "README.md"
    if not card.is_file():
        print(f"lm-eval: {adapter_dir} has no README.md model card; the scores are in {LM_EVAL_FILE} only",
              file=sys.stderr)
        return
    rows = score_rows(results)
    ours = results["hf_fedtask"]
    configs = results.get("configs") or {}
    limit = f", at most {ours['limit']} examples a task (--limit)" if ours["limit"] is not None else ""
    intro = (f"Scored with [lm-evaluation-harness]({SOURCE_URL}) {results.get('lm_eval_version') or _version()}: "
             f"`HFLM(pretrained=\"{ours['base_model']}\", peft=<this adapter>, dtype=\"{ours['dtype']}\")`, "
             f"{'with' if ours['apply_chat_template'] else 'without'} the tokenizer's chat template{limit}. "
             f"`{LM_EVAL_FILE}` holds lm-eval's whole output.")
    evals = [EvalResult(task_type="text-generation", dataset_type=configs.get(task, {}).get("dataset_path") or task,
                        dataset_name=task, dataset_config=configs.get(task, {}).get("dataset_name"),
                        dataset_split=configs.get(task, {}).get("test_split"), metric_type=metric.split(" (")[0],
                        metric_name=metric, metric_value=float(value), source_name=SOURCE, source_url=SOURCE_URL)
             for task, metric, value, *_ in rows]
    put_card_section(card, CARD_HEADING, intro, ["Task", "Metric", "Value", "Stderr", "n-shot", "Examples"], rows,
                     eval_results=evals, source=SOURCE)
