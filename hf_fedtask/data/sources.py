"""`load_task`: turn a task reference (builtin name, save_to_disk folder, csv/json/jsonl/parquet file, or
Hub dataset id) into a `Task` with train/test splits, an input column (text or `Image`) and a
ClassLabel label column."""

from __future__ import annotations

from pathlib import Path

from datasets import (
    ClassLabel,
    Dataset,
    DatasetDict,
    Features,
    Image,
    load_dataset,
    load_from_disk,
)

from hf_fedtask.data.builtin import load_builtin_task
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS
from hf_fedtask.data.images import IMAGE_TASKS
from hf_fedtask.data.task import Task, is_free_text
from hf_fedtask.errors import DataError

IMAGE_COLUMNS = ("image", "img")
TEXT_COLUMNS = ("text", "sentence", "content", "review", "document", "tweet", "utterance", "question", "prompt")
LABEL_COLUMNS = ("label", "labels", "class", "answer")  # a prompt/answer dataset: its answers become the labels
ANSWER_COLUMNS = ("answer", "output", "response", "completion")  # a free-text task's answers
ANSWERS = ("labels", "free_text")
FILE_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_task(
    ref: str,
    *,
    text_column: str | None = None,
    label_column: str | None = None,
    seed: int = 0,
    test_size: float = 0.2,
    cache_dir=None,
    builtin_train_size: int | None = None,
    answers: str | None = None,
) -> Task:
    """Resolve `ref`, in this order: an image task by name (`fashion_mnist`, `digits`: see
    `hf_fedtask.data.images`); builtin task name (or `builtin:<name>`); local save_to_disk folder
    (DatasetDict with train[/test], or a Dataset); local csv/json/jsonl/parquet file; Hub dataset id,
    optionally `repo_id:config_name` for a dataset with configs (task name `<repo name>_<config>`).
    A missing test split is made by a seeded, label-stratified `test_size` split of train. Labels that
    are not a ClassLabel become one, with the sorted distinct values as names.

    Columns, unless given: the input is an `Image` feature column if there is one (`image`, then
    `img`, then the first), which makes an image task, else the first of TEXT_COLUMNS (a text task);
    `text_column=` names the input column of either kind. The label is the first of LABEL_COLUMNS. A local
    folder's dataset card (README.md) may give the task's `instruction` in its front matter.
    `builtin_train_size`: training rows of a builtin task (default 400; an error for any other kind of task,
    whose size is its own).

    `answers="free_text"` (or `answers: free_text` in a local folder's card) makes a free-text task: the
    answer column (the first of ANSWER_COLUMNS) stays a string column, answered word for word by a causal LM
    (instruction tuning), and the test split, where missing, is a plain seeded split."""
    ref = str(ref)
    if answers is not None and answers not in ANSWERS:
        raise DataError(f"{ref}: answers must be one of {', '.join(ANSWERS)}, got {answers!r}")
    if ref.startswith("builtin:") or ref in BUILTIN_TASKS:
        return load_builtin_task(ref.removeprefix("builtin:"), seed=seed, cache_dir=cache_dir,
                                 train_size=builtin_train_size)
    if builtin_train_size is not None:
        raise DataError(f"{ref}: builtin_train_size {builtin_train_size} applies to builtin tasks only; this "
                        "task's training split has its own size (cap it with max_train_samples)")
    if ref in IMAGE_TASKS:
        return IMAGE_TASKS[ref](seed, cache_dir)
    path = Path(ref).expanduser()
    name = path.stem
    if path.is_dir():
        data, kind = _load_dir(path), "local save_to_disk folder"
    elif path.suffix.lower() in FILE_FORMATS:
        if not path.is_file():
            raise DataError(f"{ref}: no such file")
        data = load_dataset(FILE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
        kind = f"local {path.suffix.lower().lstrip('.')} file"
    else:
        repo_id, _, config_name = ref.partition(":")
        try:
            data = load_dataset(repo_id, config_name or None, cache_dir=cache_dir)
        except Exception as e:  # offline, unknown id, gated, network: all reported the same way
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(
                f"{ref}: not a builtin task, local folder or file, and not loadable from the Hub ({reason})"
            ) from e
        kind = "Hub dataset"
        name = "_".join(filter(None, [repo_id.rstrip("/").split("/")[-1], config_name]))
    if isinstance(data, Dataset):
        data = DatasetDict({"train": data})
    if "train" not in data:
        raise DataError(f"{ref}: no 'train' split (splits: {', '.join(data)})")
    card = _card_fields(path) if path.is_dir() else {}
    answers = answers or card.get("answers") or "labels"
    if answers not in ANSWERS:
        raise DataError(f"{path / 'README.md'}: answers must be one of {', '.join(ANSWERS)}, got {answers!r}")
    features = data["train"].features
    text_col = _pick_input(ref, features, text_column)
    if answers == "free_text":
        label_col = _pick_column(ref, list(features), label_column, ANSWER_COLUMNS, "answer")
        if not is_free_text(features[label_col]):
            raise DataError(f"{ref}: free-text answers need a string column; {label_col!r} is {features[label_col]}")
        data = _ensure_test(ref, data, None, seed, test_size)
    else:
        label_col = _pick_column(ref, list(features), label_column, LABEL_COLUMNS, "label")
        data = _encode_labels(data, label_col)
        data = _ensure_test(ref, data, label_col, seed, test_size)
    return Task(
        name=name,
        dataset=DatasetDict({"train": data["train"], "test": data["test"]}),
        text_column=text_col,
        label_column=label_col,
        description=f"{kind} {ref}",
        extra={"source": ref, "source_kind": kind, "seed": seed},
        instruction=card.get("instruction", ""),
    )


def _card_fields(folder: Path) -> dict[str, str]:
    """The string fields hf_fedtask reads from a local folder's dataset card (README.md front matter, as
    `hf-fedtask suite export` writes it): `instruction` (what a causal LM is asked about each input) and
    `answers` (`free_text` for prompt/response rows). Empty without a card."""
    from huggingface_hub import DatasetCard

    card = folder / "README.md"
    if not card.is_file():
        return {}
    try:
        data = DatasetCard.load(card).data.to_dict()
    except (ValueError, OSError):  # an unreadable card is the data's own business: no fields then
        return {}
    return {k: data[k] for k in ("instruction", "answers") if isinstance(data.get(k), str)}


def _load_dir(path: Path) -> DatasetDict | Dataset:
    try:
        return load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path}: not a folder written by save_to_disk ({e})") from e


def _pick_input(ref: str, features: Features, explicit: str | None) -> str:
    """The input column by the rule in `load_task`'s docstring."""
    images = [c for c, f in features.items() if isinstance(f, Image)]
    if explicit is None and images:
        return next((c for c in IMAGE_COLUMNS if c in images), images[0])
    return _pick_column(ref, list(features), explicit, TEXT_COLUMNS, "input", flag="text",
                        looked_for="an Image column, ")


def _pick_column(ref: str, columns: list[str], explicit: str | None, candidates: tuple[str, ...], what: str, *,
                 flag: str | None = None, looked_for: str = "") -> str:
    if explicit is not None:
        if explicit not in columns:
            raise DataError(f"{ref}: {what} column {explicit!r} not found; columns are {', '.join(columns)}")
        return explicit
    for c in candidates:
        if c in columns:
            return c
    # what the CLI can do is rename (`--tasks` takes refs alone); Python callers may name the column instead
    raise DataError(f"{ref}: no {what} column found (looked for {looked_for}{', '.join(candidates)}; its columns are "
                    f"{', '.join(columns)}); rename its {what} column to one of those names (from Python: "
                    f"load_task(ref, {flag or what}_column=NAME))")


def _encode_labels(data: DatasetDict, label_col: str) -> DatasetDict:
    """Cast the label column of every split to one shared ClassLabel (sorted distinct values)."""
    if isinstance(data["train"].features[label_col], ClassLabel):
        return data
    distinct = {v for split in data.values() for v in split[label_col]}
    if None in distinct:
        raise DataError(f"label column {label_col!r} has missing values")
    values = sorted(distinct)
    index = {v: i for i, v in enumerate(values)}
    label = ClassLabel(names=[str(v) for v in values])
    return DatasetDict({
        # input_columns: only the labels are read, so image columns are never decoded here
        name: split.map(lambda b: {label_col: [index[v] for v in b]}, batched=True, input_columns=label_col)
        .cast_column(label_col, label)
        for name, split in data.items()
    })


def _ensure_test(ref: str, data: DatasetDict, label_col: str | None, seed: int, test_size: float) -> DatasetDict:
    """`data` with a test split: its own, or a seeded `test_size` split of train, stratified by `label_col`
    where it can be (None: free-text answers, a plain split)."""
    if "test" in data:
        return data
    if not 0 < test_size < 1:
        raise DataError(f"{ref}: test_size must be in (0, 1), got {test_size}")
    train = data["train"]
    try:
        if label_col is None:
            raise ValueError("nothing to stratify by")
        split = train.train_test_split(test_size=test_size, seed=seed, stratify_by_column=label_col)
    except ValueError:  # a class too small to stratify: fall back to a plain seeded split
        split = train.train_test_split(test_size=test_size, seed=seed)
    return DatasetDict({"train": split["train"], "test": split["test"]})
