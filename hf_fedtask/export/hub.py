"""Publish an exported adapter folder to the Hugging Face Hub, with a model card that says how it
was trained (task, federation, metrics) and how to load it."""

import numbers
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

import httpx2
import jinja2
from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from peft.utils import CONFIG_NAME

from hf_fedtask.core.files import write_atomic
from hf_fedtask.errors import HubError
from hf_fedtask.export.adapter import check_portable_base_model_id, read_adapter_folder
from hf_fedtask.privacy.report import card_rows

CARD_TEMPLATE = "adapter_card.md.j2"

# Keys render_model_card accepts. Required: base_model, task, and num_labels or label_names.
INFO_KEYS = {
    "base_model": "Hub id of the base model, e.g. 'sentence-transformers/all-MiniLM-L6-v2' (required).",
    "task": "Task name, or a list of task names for a many-task adapter (required).",
    "num_labels": "Number of classes of the classification head (or give label_names).",
    "label_names": "Class names in label-id order; sets num_labels and the id2label of the snippet.",
    "repo_id": "Hub repo the adapter is pushed to; used in the title and the load snippet.",
    "peft_method": "PEFT method, e.g. 'lora', 'ia3', 'prompt_tuning'; also a tag.",
    "strategy": "Federated strategy name, e.g. 'fedavg', 'fedprox'; also a tag.",
    "strategy_paper": "Reference (title or URL) of the strategy's paper.",
    "citation": "BibTeX entry to cite, rendered verbatim.",
    "rounds": "Number of federated rounds.",
    "num_clients": "Number of clients in the federation.",
    "participation": "Fraction of clients sampled per round, in (0, 1].",
    "bytes_communicated": "Total bytes sent between server and clients.",
    "metrics": "Evaluation results: {task: {metric: value}}.",
    "hyperparameters": "Training hyperparameters: {name: value}.",
    "datasets": "Hub dataset id per task, {task: dataset_id}; tasks without one are listed by name.",
    "license": "License id, e.g. 'apache-2.0'.",
    "tags": "Extra tags for the Hub.",
    "modality": "'text' (default), 'image' or 'causal_lm' (a causal LM answering instructions): sets the pipeline "
                "tag and the loading snippet.",
    "prompt_template": "causal_lm: the whole prompt, chat template applied, with {input} where the example goes.",
    "label_words": "causal_lm: the words the model answers with, one per label.",
    "user_message": "causal_lm: the user turn sent to the chat template, with {input} where the example goes.",
    "extra_notes": "Free Markdown appended as a Notes section.",
    "privacy": "Client-level differential privacy, as results.json's `privacy` entry (hf_fedtask.privacy.report): "
               "adds a Differential privacy section (ε, δ, clipping, noise, sampling, accountant, what is "
               "published outside ε).",
}
_BASE_TAGS = ["hf-fedtask", "federated-learning", "peft"]
# per input modality: the pipeline tag and the classes of the card's loading snippet
_MODALITIES = {
    "text": ("text-classification", "AutoModelForSequenceClassification", "AutoTokenizer", "tokenizer"),
    "image": ("image-classification", "AutoModelForImageClassification", "AutoImageProcessor", "processor"),
    "causal_lm": ("text-generation", "AutoPeftModelForCausalLM", "AutoTokenizer", "tokenizer"),
}


def _fmt(value) -> str:
    """A value as a Markdown table cell: floats to 4 significant digits, pipes escaped."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        text = f"{float(value):.4g}"
    else:
        text = str(value)
    return text.replace("|", "\\|")


def _plain(value):
    """Numbers as builtin int/float so the YAML header never holds numpy or torch scalars."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _num_labels(info: Mapping) -> int:
    labels = info.get("label_names")
    num = info.get("num_labels")
    if num is None and labels is None:
        raise ValueError("model card info needs 'num_labels' or 'label_names'")
    if num is not None and labels is not None and int(num) != len(labels):
        raise ValueError(f"num_labels={num} but label_names has {len(labels)} names")
    return int(num) if num is not None else len(labels)


def _federation_rows(info: Mapping) -> list[tuple[str, str]]:
    rows = []
    if info.get("strategy"):
        rows.append(("Strategy", info["strategy"]))
    if info.get("rounds") is not None:
        rows.append(("Rounds", _fmt(info["rounds"])))
    if info.get("num_clients") is not None:
        rows.append(("Clients", _fmt(info["num_clients"])))
    if info.get("participation") is not None:
        rows.append(("Participation", f"{float(info['participation']):.0%} of clients per round"))
    if info.get("bytes_communicated") is not None:
        size = int(info["bytes_communicated"])
        rows.append(("Bytes communicated", f"{size:,} ({size / 2**20:.2f} MiB)"))
    return rows


def _card_context(info: Mapping) -> dict:
    """Validate `info` and turn it into the template's variables and the card's YAML metadata."""
    unknown = sorted(set(info) - set(INFO_KEYS))
    if unknown:
        raise ValueError(f"unknown model card info keys {unknown}; accepted: {sorted(INFO_KEYS)}")
    for key in ("base_model", "task"):
        if not info.get(key):
            raise ValueError(f"model card info needs {key!r}")
    check_portable_base_model_id(info["base_model"])
    num_labels = _num_labels(info)

    tasks = [info["task"]] if isinstance(info["task"], str) else list(info["task"])
    metrics = {task: {name: value for name, value in values.items() if value is not None}
               for task, values in (info.get("metrics") or {}).items()}
    tasks += [task for task in metrics if task not in tasks]
    metric_names = list(dict.fromkeys(name for values in metrics.values() for name in values))
    dataset_ids = info.get("datasets") or {}
    peft_method = info.get("peft_method")
    strategy = info.get("strategy")
    repo_id = info.get("repo_id") or "<user>/<adapter-repo>"
    labels = info.get("label_names")
    modality = info.get("modality", "text")
    if modality not in _MODALITIES:
        raise ValueError(f"model card info: modality must be one of {', '.join(_MODALITIES)}, got {modality!r}")
    pipeline, auto_model, auto_processor, processor_name = _MODALITIES[modality]

    eval_results = [
        EvalResult(
            task_type=pipeline,
            dataset_type=dataset_ids.get(task, task),
            dataset_name=task,
            metric_type=name,
            metric_value=_plain(value),
        )
        for task, values in metrics.items()
        for name, value in values.items()
    ]
    tags = _BASE_TAGS + [pipeline] + [t.lower() for t in (strategy, peft_method) if t] + list(info.get("tags") or [])
    card_data = ModelCardData(
        base_model=info["base_model"],
        library_name="peft",
        pipeline_tag=pipeline,
        license=info.get("license"),
        tags=tags,
        datasets=[dataset_ids.get(task, task) for task in tasks],
        metrics=metric_names or None,
        model_name=(info.get("repo_id") or "hf-fedtask-adapter") if eval_results else None,
        eval_results=eval_results or None,
    )

    method = f"{peft_method} adapter" if peft_method else "PEFT adapter"
    what = {"image": "classifies images into", "text": "classifies text into",
            "causal_lm": "answers an instruction with one of"}[modality]
    answers = f"{what} {num_labels} {'words' if modality == 'causal_lm' else 'classes'}"
    if modality == "causal_lm" and not num_labels:
        answers = "answers instructions in free text"
    summary = (
        f"A {method} for [`{info['base_model']}`](https://huggingface.co/{info['base_model']}) "
        f"that {answers} "
        f"for the task{'s' if len(tasks) > 1 else ''} "
        f"{', '.join(f'`{t}`' for t in tasks)}. It was trained by federated fine-tuning with "
        f"`hf_fedtask`{f' using the **{strategy}** strategy' if strategy else ''}: clients train the "
        "adapter on their private data and only the adapter weights travel to the server."
    )
    return {
        "card_data": card_data,
        "title": repo_id.split("/")[-1] if info.get("repo_id") else f"{method} for {', '.join(tasks)}",
        "summary": summary,
        "base_model": info["base_model"],
        "repo_id": repo_id,
        "num_labels": num_labels,
        "id2label": dict(enumerate(labels)) if labels else None,
        "label2id": {name: i for i, name in enumerate(labels)} if labels else None,
        "strategy": strategy,
        "strategy_paper": info.get("strategy_paper"),
        "citation": info.get("citation"),
        "federation_rows": _federation_rows(info),
        "privacy_rows": card_rows(info["privacy"]) if info.get("privacy") else None,
        "metric_names": metric_names,
        "metric_rows": [[task] + [_fmt(metrics[task][m]) if m in metrics[task] else "–" for m in metric_names]
                        for task in metrics],
        "hyperparameter_rows": [(name, _fmt(value)) for name, value in (info.get("hyperparameters") or {}).items()
                                if value is not None],
        "extra_notes": info.get("extra_notes"),
        "auto_model": auto_model,
        "auto_processor": auto_processor,
        "processor_name": processor_name,
        "causal_lm": modality == "causal_lm",
        "prompt_template": info.get("prompt_template"),
        "label_words": info.get("label_words"),
        "user_message": info.get("user_message"),
    }


def render_model_card(info: Mapping) -> ModelCard:
    """Render the adapter's model card from `info` (keys and meaning in INFO_KEYS).

    The YAML header carries base_model, library_name 'peft', tags, datasets, pipeline_tag,
    license and the metrics as a model-index; the body describes the federation, metrics and
    hyperparameters and gives a copy-pasteable snippet that loads the adapter. Sections whose
    keys are missing are left out.
    """
    context = _card_context(info)
    template = resources.files("hf_fedtask.model_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    return ModelCard.from_template(context.pop("card_data"), template_str=template, **context)


# a section added to an existing card (`put_card_section`): its heading, a paragraph, and a table made like the
# template's own tables (header row, `|---|` rule, cells through `_fmt`)
_SECTION_TEMPLATE = """{{ heading }}

{{ intro }}

|{% for name in columns %} {{ name }} |{% endfor %}
|{% for name in columns %}---|{% endfor %}
{%- for row in rows %}
|{% for cell in row %} {{ cell }} |{% endfor %}
{%- endfor %}
"""


def _sections(lines: list[str]) -> list[int]:
    """Indices of the lines that open a `## ` section, fenced code blocks skipped (a prompt may hold `##`)."""
    starts, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            starts.append(i)
    return starts


def put_card_section(card_file: str | os.PathLike, heading: str, intro: str, columns: list[str],
                     rows: list[list], *, eval_results: Sequence[EvalResult] = (), source: str | None = None) -> None:
    """Put a section of scores into an existing model card (README.md), in place: `heading` (`## ...`), `intro`
    and a table of `columns` and `rows`, rendered like the card's own tables. A section of the same heading is
    replaced; a new one goes after the card's Evaluation section (else before How to load, else at the end).
    `eval_results` replace the model-index entries whose `source_name` is `source`, so the Hub shows them.
    The card is read and written back by huggingface_hub's `ModelCard` (a card of ours reads back unchanged)."""
    path = Path(card_file)
    card = ModelCard.load(path)
    section = jinja2.Template(_SECTION_TEMPLATE).render(
        heading=heading, intro=intro, columns=columns, rows=[[_fmt(cell) for cell in row] for row in rows])
    lines = card.text.split("\n")
    starts = _sections(lines)
    titles = {lines[i].strip(): i for i in starts}
    ends = dict(zip(starts, [*starts[1:], len(lines)]))
    if heading in titles:
        begin, end = titles[heading], ends[titles[heading]]
    else:
        after = titles.get("## Evaluation")
        begin = end = ends[after] if after is not None else titles.get("## How to load", len(lines))
    new = section.rstrip("\n").split("\n") + [""]  # a blank line before the next section, or the final newline
    head = lines[:begin]
    if head and head[-1].strip():
        head.append("")
    card.text = "\n".join(head + new + lines[end:])
    if eval_results:
        kept = [r for r in card.data.eval_results or () if r.source_name != source]
        card.data.eval_results = kept + list(eval_results)
        card.data.model_name = card.data.model_name or "hf-fedtask-adapter"
    write_atomic(path, str(card))


def check_adapter_folder(folder: str | os.PathLike) -> Path:
    """Raise HubError unless `folder` is a PEFT adapter folder whose base model is a Hub id,
    so nothing unloadable or machine-specific is ever published."""
    path = Path(folder)
    config, _ = read_adapter_folder(path, error=HubError)
    try:
        check_portable_base_model_id(config["base_model_name_or_path"])
    except ValueError as err:
        raise HubError(f"{path / CONFIG_NAME}: bad base_model_name_or_path: {err}") from None
    return path


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    endpoint: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
) -> str:
    """Create `repo_id` (if needed) as a model repo and upload the adapter `folder`; return the
    commit URL. The endpoint defaults to $HF_ENDPOINT, then the public Hub. Every failure, from
    a bad folder to the network or the server, raises a one-line HubError naming repo and endpoint.
    """
    path = check_adapter_folder(folder)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, exist_ok=True, private=private, repo_type="model")
        commit = api.upload_folder(
            folder_path=path,
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload PEFT adapter with hf_fedtask",
        )
    except (httpx2.HTTPError, HfHubHTTPError, OfflineModeIsEnabled, OSError, ValueError, RuntimeError) as err:
        # huggingface_hub wraps a failed LFS upload as RuntimeError("Error while uploading '<file>' to the
        # Hub.") raised from the HTTP error: name that error, and let any other RuntimeError through
        inner = err.__cause__ if isinstance(err, RuntimeError) else err
        if not isinstance(inner, (httpx2.HTTPError, HfHubHTTPError, OSError, ValueError)):
            raise
        cause = " ".join(str(inner).split()) or "no details"
        where = f"{' '.join(str(err).split())} " if inner is not err else ""
        raise HubError(f"push of {path} to {repo_id!r} at {endpoint} failed: "
                       f"{where}{type(inner).__name__}: {cause}") from err
    return commit.commit_url
