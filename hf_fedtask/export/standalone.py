"""Load and evaluate an exported adapter with stock PEFT only — the path a user without our
training code takes, and the independent check of the numbers in results.json.

`evaluate_adapter` takes what it is not told from the adapter folder (`hf_fedtask.json`, see
`hf_fedtask.export.adapter.METADATA_FILE`; `classifier/config.json`) or, for an older export, from the
run folder around it: the task, the run's max_length, data seed and test subset, and the base model the
run loaded. It refuses, in one line naming both sides, a task whose labels are not the adapter's, inputs
of another kind (text, image) than the adapter takes, and a base model other than the one it was
trained on."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.export.adapter import (
    adapter_label_names,
    load_adapter_base,
    read_adapter_folder,
    read_metadata,
)

DEFAULT_MAX_LENGTH = 32  # RunConfig's default, for adapters that record none
# a run folder's config and results (`hf_fedtask.engine.run_folder`, a layer above this one)
RUN_CONFIG_FILE, RESULTS_FILE = "run_config.yaml", "results.json"
_KINDS = {"text": "a text classifier", "image": "an image classifier", "causal_lm": "a causal LM"}


def load_adapter_model(adapter_dir: str | Path):
    """`(PeftModel, processor)` for an adapter folder: the base named in adapter_config.json (the
    embedded copy for the default MiniLM), a head sized from the saved classifier weights and named
    by the folder's `classifier/config.json` (so pipelines answer label names); the processor is the
    base model's tokenizer (text) or image processor (vision)."""
    model, inputs = _load_adapter(adapter_dir)
    return model, inputs.processor


def _head_rows(tensors: dict) -> int | None:
    """Outputs of the adapter's classification head (None: no head, e.g. a causal LM's adapter)."""
    head = [k for k in tensors if k.endswith(("classifier.weight", "score.weight"))]
    return int(tensors[head[-1]].shape[0]) if head else None


def _load_adapter(adapter_dir: str | Path, max_length: int = DEFAULT_MAX_LENGTH, base_model: str | None = None):
    """`(PeftModel, input preparer)`; see `load_adapter_model`. `base_model`: load this (a local folder
    or Hub id) instead of the recorded `base_model_name_or_path`."""
    from hf_fedtask.model.backbone import load_inputs

    adapter_dir = Path(adapter_dir)
    config, tensors = read_adapter_folder(adapter_dir)
    base_id = base_model or config["base_model_name_or_path"]
    rows = _head_rows(tensors)
    if config.get("task_type") == "CAUSAL_LM":  # a causal LM answers in words: no head to size
        ref, base = load_adapter_base(base_id, 0, adapter_dir)
        return _peft_model(base, adapter_dir, base_id), load_inputs(ref, max_length)
    if rows is None:
        raise ConfigError(f"{adapter_dir / 'adapter_model.safetensors'}: no classification head "
                          "(classifier.weight) in the adapter")
    ref, base = load_adapter_base(base_id, rows, adapter_dir)
    labels = adapter_label_names(adapter_dir)
    if labels is not None and len(labels) == rows:
        base.config.id2label = dict(enumerate(labels))
        base.config.label2id = {name: i for i, name in enumerate(labels)}
    return _peft_model(base, adapter_dir, base_id), load_inputs(ref, max_length)


def _peft_model(base, adapter_dir: Path, base_id: str):
    from peft import PeftModel

    from hf_fedtask.model.backbone import quiet_peft_wrap

    try:
        with quiet_peft_wrap():
            return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise FedTaskError(f"{adapter_dir}: does not load onto {base_id} ({str(e).splitlines()[0]})") from None


@dataclass
class _Record:
    """What an adapter folder, or the run folder it sits in, says it was trained and scored on."""

    task: str | None = None  # the task's name
    task_source: str | None = None  # what load_task loads it by
    kind: str | None = None  # text | image | causal_lm
    base_model: str | None = None  # a local folder the run loaded the base from, when it had one
    base_revision: str | None = None
    max_length: int | None = None
    seed: int = 0
    builtin_train_size: int | None = None
    max_test_samples: int | None = None
    num_examples: int | None = None
    metric: dict = field(default_factory=dict)
    where: str = ""  # where it was read, for messages: "the adapter's hf_fedtask.json", "the run's"


def _record(adapter_dir: Path, base_id: str) -> _Record:
    """The adapter's METADATA_FILE, completed by its run folder (`<run>/adapters/<task>/`) where there is
    one: the run's local base-model folder, and everything for an export older than the metadata file."""
    meta = read_metadata(adapter_dir)
    data, ev = meta.get("data") or {}, meta.get("evaluation") or {}
    rec = _Record(task=meta.get("task"), task_source=meta.get("task_source"), kind=meta.get("modality"),
                  base_revision=meta.get("base_model_revision"), max_length=meta.get("max_length"),
                  seed=data.get("seed") or 0, builtin_train_size=data.get("builtin_train_size"),
                  max_test_samples=ev.get("max_test_samples"), num_examples=ev.get("num_examples"),
                  metric={k: v for k, v in ev.items() if k not in ("split", "max_test_samples", "num_examples")},
                  where="the adapter's hf_fedtask.json" if meta else "")
    run = _run_around(adapter_dir)
    if run is None:
        return rec
    config, results = run
    if config.base_model_id in (None, base_id) or config.base_model == base_id:
        rec.base_model = config.base_model  # e.g. a local folder, whose Hub id alone does not load here
    if meta:
        return rec
    names = list(results.get("tasks") or ())
    refs = list(config.tasks or ())
    name = adapter_dir.name
    if name in names:
        rec.task = name
        rec.task_source = str(refs[names.index(name)]) if len(refs) == len(names) else name
        r = results["tasks"][name]
        rec.num_examples = r.get("num_examples")
        rec.metric = {r["metric"]: r.get(r["metric"])} if "metric" in r else {}
    rec.base_revision = results.get("base_model_revision")
    rec.max_length, rec.seed, rec.builtin_train_size = config.max_length, config.seed, config.builtin_train_size
    rec.max_test_samples = config.max_test_samples
    rec.where = "the run's run_config.yaml"
    return rec


def _run_around(adapter_dir: Path):
    """(RunConfig, results) of the run folder an exported adapter sits in, or None (a copied or downloaded
    adapter, an unreadable run: it only supplies defaults)."""
    from hf_fedtask.config import RunConfig
    from hf_fedtask.report import ADAPTERS_DIR

    run_dir = adapter_dir.absolute().parent.parent
    if adapter_dir.absolute().parent.name != ADAPTERS_DIR or not (run_dir / RUN_CONFIG_FILE).is_file():
        return None
    try:
        config = RunConfig.from_yaml(run_dir / RUN_CONFIG_FILE, saved=True)
        results = json.loads((run_dir / RESULTS_FILE).read_text()) if (run_dir / RESULTS_FILE).is_file() else {}
    except (FedTaskError, OSError, ValueError, TypeError):
        return None
    return config, results if isinstance(results, dict) else {}


def _names(labels) -> str:
    shown = ", ".join(map(str, labels[:6]))
    return f"{shown}, …" if len(labels) > 6 else shown


def _check_labels(adapter_dir: Path, rows: int | None, labels: list[str] | None, rec: _Record, task) -> None:
    """Refuse a task whose label count or names are not the adapter's, naming both."""
    whose = f"the adapter (trained on {rec.task!r})" if rec.task else "the adapter"
    fix = (f"give --task {rec.task_source} or a task with these labels" if rec.task_source and rec.task != task.name
           else "give a task with these labels")
    if rows is not None and rows != task.num_labels:
        ours = f" [{_names(labels)}]" if labels and len(labels) == rows else ""
        raise ConfigError(f"{adapter_dir}: {whose} has {rows} labels{ours}, task {task.name!r} has "
                          f"{task.num_labels} [{_names(task.label_names)}]; {fix}")
    if labels is not None and list(labels) != list(task.label_names):
        raise ConfigError(f"{adapter_dir}: {whose} has labels [{_names(labels)}], task {task.name!r} has "
                          f"[{_names(task.label_names)}]; {fix}")


def _check_base(adapter_dir: Path, ref, rec: _Record, adapter_kind: str | None, recorded_id: str) -> str:
    """Refuse a base model other than the one the adapter was trained on (by the recorded SHA-256 of its
    weights) or of another kind (classifier vs causal LM, text vs image); return the base's kind."""
    from hf_fedtask.model.backbone import input_kind

    want, have = rec.base_revision or "", ref.revision or ""
    if want.startswith("sha256:") and have.startswith("sha256:") and want != have:
        raise ConfigError(f"{adapter_dir}: base model {ref.load_path} (weights {have[:19]}…) is not the one the "
                          f"adapter was trained on ({recorded_id}, weights {want[:19]}…)")
    try:
        kind = input_kind(ref).kind
    except (OSError, ValueError, KeyError):
        return adapter_kind or ""  # not loadable here: load_adapter_base names the base in its error
    if adapter_kind and kind != adapter_kind:
        raise ConfigError(f"{adapter_dir}: the adapter is {_KINDS[adapter_kind]}'s, but base model "
                          f"{ref.load_path} is {_KINDS[kind]}; give the base it was trained on")
    if adapter_kind is None and kind == "causal_lm":  # an adapter with a classification head
        raise ConfigError(f"{adapter_dir}: the adapter is a classifier's (it has a classification head), but base "
                          f"model {ref.load_path} is a causal LM; give the base it was trained on")
    return kind


def evaluate_adapter(adapter_dir: str | Path, task: str | None = None, *, split: str = "test",
                     max_length: int | None = None, max_test_samples: int | None = None,
                     base_model: str | None = None, batch_size: int = 128, progress: bool = True) -> dict:
    """Accuracy of the adapter on `task`'s split, computed with stock PEFT + transformers (a free-text
    task: token accuracy and answer loss on its reference answers).

    Defaults come from what the adapter records (see the module): `task` the task it was trained on,
    `max_length` the run's, `max_test_samples` the seeded subset the run scored that task's test split on
    (0: the whole split; a task other than the recorded one is scored whole unless given), `base_model`
    the recorded base (the run's local folder when the adapter sits in its run folder). Refused in one
    ConfigError line: a task with other labels or inputs, another base model. A line on stderr says what
    is scored, and a progress bar over the examples shows on passes that take more than a few seconds."""

    from hf_fedtask.client.evaluation import labels_of, predict_batches
    from hf_fedtask.data import BUILTIN_TASKS, load_task
    from hf_fedtask.metrics import compute, free_text_scores
    from hf_fedtask.model.backbone import resolve_base_model
    from hf_fedtask.model.device import model_device

    adapter_dir = Path(adapter_dir)
    config, tensors = read_adapter_folder(adapter_dir)
    recorded_id = config["base_model_name_or_path"]
    rec = _record(adapter_dir, recorded_id)
    rows, labels = _head_rows(tensors), adapter_label_names(adapter_dir)
    causal = config.get("task_type") == "CAUSAL_LM"
    adapter_kind = "causal_lm" if causal else (rec.kind if rec.kind in _KINDS else None)
    if task is None:
        if not rec.task_source:
            raise ConfigError(f"{adapter_dir}: records no task (no hf_fedtask.json, not in a run folder); "
                              "give --task")
        task = rec.task_source
        if Path(task).is_absolute() and not Path(task).exists():
            raise ConfigError(f"{adapter_dir}: records task {rec.task!r} as {task}, which is not on this machine; "
                              "give --task (a builtin name, local dataset path or Hub id)")
    same = rec.task_source is not None and str(task) == str(rec.task_source)
    ref_name = str(task).removeprefix("builtin:")
    builtin = ref_name in BUILTIN_TASKS
    t = load_task(str(task), seed=rec.seed,
                  builtin_train_size=rec.builtin_train_size if builtin and (same or rec.task == ref_name) else None)
    same = same or t.name == rec.task
    if split not in t.dataset:
        raise ConfigError(f"task {t.name!r} has no split {split!r} (it has {', '.join(t.dataset)})")
    _check_labels(adapter_dir, None if causal else rows, labels, rec, t)
    if adapter_kind in ("text", "image") and t.modality != adapter_kind:
        raise ConfigError(f"{adapter_dir}: the adapter is {_KINDS[adapter_kind]}'s, but task {t.name!r} has "
                          f"{t.modality} inputs")
    if t.free_text and not causal:
        raise ConfigError(f"{adapter_dir}: task {t.name!r} answers in free text, which a causal LM's adapter "
                          "writes; this adapter is a classifier's")
    if causal and t.modality != "text":
        raise ConfigError(f"{adapter_dir}: the adapter is a causal LM's (text), but task {t.name!r} has "
                          f"{t.modality} inputs")

    base = base_model or rec.base_model or recorded_id
    kind = _check_base(adapter_dir, resolve_base_model(base), rec, adapter_kind, recorded_id)
    if not causal and kind in ("text", "image") and t.modality != kind:
        raise ConfigError(f"task {t.name!r} has {t.modality} inputs but the adapter's base model {base} takes "
                          f"{kind}")

    data = t.dataset[split]
    total = len(data)
    recorded_cap = rec.max_test_samples if same and split == "test" else None
    cap = recorded_cap if max_test_samples is None else (max_test_samples or None)
    if cap and cap < total:  # the seeded subset `engine.environment.load_tasks` scores
        data = data.shuffle(seed=rec.seed).select(range(cap))
    if max_length is None:
        max_length = rec.max_length or DEFAULT_MAX_LENGTH
        length_from = f"{rec.where}" if rec.max_length else "the default; the adapter records none"
    else:
        length_from = "--max-length"
    if max_test_samples is None and recorded_cap and cap < total:
        subset = (f"a seeded subset: the run's max_test_samples {cap}, seed {rec.seed}, as its card's metric; "
                  "--max-test-samples all scores the whole split")
    elif cap and cap < total:
        subset = f"a seeded subset (--max-test-samples {cap}, seed {rec.seed})"
    else:
        subset = "the whole split"
    note = (f"evaluate: scoring {len(data):,} of {total:,} {split} examples of {t.name} ({subset}); "
            f"max_length {max_length} ({length_from})")
    if rec.task and t.name != rec.task:
        note += f"; the adapter was trained on {rec.task}"
    print(note, file=sys.stderr, flush=True)

    model, inputs = _load_adapter(adapter_dir, max_length, base)
    prepared = inputs.prepare(data, t)  # as a run prepares it: token ids, pixels, or instructions
    preds = predict_batches(model, inputs, prepared, batch_size, model_device(model),
                            progress=f"evaluate {t.name}" if progress else None)
    common = {"num_examples": len(prepared), "split_examples": total,
              "max_test_samples": cap if cap and cap < total else None, "max_length": max_length, "base_model": base}
    if t.free_text:  # reference answers scored teacher-forced: no labels to compare with
        return {"task": t.name, "split": split, **free_text_scores(preds), **common}
    truth = labels_of(prepared)
    out = {"task": t.name, "split": split, "accuracy": compute("accuracy", truth, preds), **common}
    if t.metric != "accuracy":
        out[t.metric] = compute(t.metric, truth, preds)
    return out
