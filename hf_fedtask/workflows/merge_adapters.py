"""One-shot merging of PEFT adapters (`hf-fedtask merge`): mergekit-style, no federation.

Inputs are PEFT adapter folders (adapter_config.json + adapter_model.safetensors) or task-vector
files written by `TaskVector.save`, all of one base model and one PEFT config (checked through
`base_model_name_or_path` / the `base_model` header and `peft_config_hash`).

Task vectors. An input's task vector is its saved PEFT tensors minus those of `--base-adapter` (the
shared PEFT init θ_p) when given, else minus zero: then the raw adapter tensors are merged, as peft's
`add_weighted_adapter(combination_type="linear"|"ties"|"dare_*")` does. The result is base + merge.
For LoRA this merges A and B separately, so the merged ΔW = s·B·A has cross terms B_i·A_j and is not
the weighted sum of the inputs' ΔW_i (peft issue #3004); with a common base adapter the error is of
second order in the updates. Unlike peft (which weights A and B by √(w·s) and sets lora_alpha = r),
weights multiply the tensors themselves and the output keeps the inputs' config, hence their scaling
s = lora_alpha/r. Task-vector files of kind "delta" are already τ and need `--base-adapter`; files of
kind "absolute" are treated like adapter folders.

Heads (modules_to_save keys) are merged like the rest only when they classify into one label set: the
same label names (an exported adapter's `classifier/config.json` or `hf_fedtask.json`) and the same
number of labels. Heads of unrelated label sets (negative/positive with female/male, or 2 labels with 6)
are refused unless told what to do, as mergekit asks `tokenizer_source` when vocabularies differ:
`head_from` keeps one input's head as it is (and its label names, tokenizer and classifier config), and
`no_head` writes the shared modules only. peft's `add_weighted_adapter` refuses adapters with
modules_to_save altogether. `unify` keeps each input's own head.

Output: a PEFT adapter folder (adapter_config.json of the first adapter folder among the inputs, else
of `--base-adapter`; the merged adapter_model.safetensors; a README card), written atomically, that loads
by the route an exported adapter does: the tokenizer or image processor files and `classifier/config.json`
of the input whose head is kept (the first adapter folder when heads are merged), and `hf_fedtask.json`
with the label names. For `unify` it is the compact export of `hf_fedtask.export.compact` with one task
per input, named after the input, its label names in tasks.json, plus each input's reconstructed adapter
under OUT/<name>/ with that input's tokenizer and classifier config.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from peft import PeftConfig
from peft.utils import CONFIG_NAME

from hf_fedtask import merge
from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError, OutputDirError, TaskVectorError
from hf_fedtask.export.adapter import (
    adapter_label_names,
    check_portable_base_model_id,
    copy_loading_files,
    read_adapter_config,
    read_adapter_folder,
    read_metadata,
    write_metadata,
)
from hf_fedtask.export.compact import save_compact, write_adapter_folder
from hf_fedtask.merge.ties import SIGN_METHODS
from hf_fedtask.merge.unify import RESCALERS

METHODS = ("task_arithmetic", "ties", "dare", "unify")
DEFAULT_DENSITY = {"ties": 0.2, "dare": 0.5}


@dataclass
class _Input:
    """One input's tensors and identity."""

    source: str  # the path as given, for messages
    name: str  # folder name or file stem
    tensors: TaskVector
    delta: bool  # a task vector (τ) rather than PEFT parameters
    base_model: str | None
    config_hash: str
    config_file: Path | None  # adapter_config.json of an adapter folder
    label_names: list[str] | None = None  # what its head classifies into, where the folder records it
    metadata: dict | None = None  # an exported adapter's hf_fedtask.json

    @property
    def folder(self) -> Path | None:
        return self.config_file.parent if self.config_file is not None else None

    def matches(self, ref: str) -> bool:
        """Whether `ref` (a --head-from value) names this input: its path, folder name or task."""
        if Path(ref).exists() and Path(self.source).exists():
            return Path(ref).resolve() == Path(self.source).resolve()
        return ref in (self.name, (self.metadata or {}).get("task"))


def merge_inputs(
    paths: Sequence[str | os.PathLike],
    method: str,
    *,
    out: str | os.PathLike,
    weights: Sequence[float] | None = None,
    density: float | None = None,
    majority_sign: str = "total",
    scope: str = "tensor",
    seed: int = 0,
    dare_variant: str = "linear",
    rescaler: str = "global_sum",
    base_adapter: str | os.PathLike | None = None,
    head_from: str | os.PathLike | None = None,
    no_head: bool = False,
    overwrite: bool = False,
) -> Path:
    """Merge the adapters or task vectors at `paths` with `method` (see METHODS) into `out`; return it.

    `weights` (one per input, default 1) apply to task_arithmetic, ties and dare; `density` (default
    0.2 for ties, 0.5 for dare) is the fraction kept; `dare_variant` is "linear" or "ties"; `rescaler`
    is unify's λ (see `hf_fedtask.merge.unify`). Heads are merged only when they share a label set;
    `head_from` (an input's path, folder name or task) keeps that input's head instead, `no_head` writes
    the shared modules only (see the module). Bad inputs raise a one-line FedTaskError naming the
    file, before anything is written; an existing non-empty `out` is replaced only with `overwrite`."""
    density = _check_options(len(paths), method, weights, density, {
        "majority sign method": (majority_sign, SIGN_METHODS), "TIES scope": (scope, ("tensor", "model")),
        "DARE variant": (dare_variant, ("linear", "ties")), "rescaler": (rescaler, RESCALERS)})
    if head_from is not None and no_head:
        raise ConfigError("give --head-from or --no-head, not both")
    if method == "unify" and (head_from is not None or no_head):
        raise ConfigError(f"{'--head-from' if head_from is not None else '--no-head'} does not apply to "
                          "--method unify (it keeps each input's own head)")
    weights = list(weights) if weights is not None else [1.0] * len(paths)
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputDirError(f"{out} exists and is not empty; pass --overwrite to replace it")

    inputs = [read_input(p) for p in paths]
    base = read_input(base_adapter) if base_adapter is not None else None
    for x in inputs:
        if x.delta and base is None:
            raise ConfigError(f"{x.source}: a 'delta' task vector is measured from the PEFT init; "
                              "pass it as --base-adapter")
    config_file = next((x.config_file for x in [*inputs, base] if x is not None and x.config_file), None)
    if config_file is None:
        raise ConfigError("task-vector files carry no PEFT config: give an adapter folder as input or --base-adapter")
    config = read_adapter_config(config_file)
    head_modules = set(config.get("modules_to_save") or ())
    head_keys = {k for k in inputs[0].tensors if head_modules & set(k.split("."))}
    ref = base if base is not None else inputs[0]
    for x in inputs:
        _check_compatible(x, ref, head_keys)
    if (head_from is not None or no_head) and not head_keys:
        raise ConfigError(f"{'--head-from' if head_from is not None else '--no-head'}: the inputs have no head "
                          "(no modules_to_save in adapter_config.json)")
    keeper = _head_input(inputs, head_from) if head_from is not None else None

    if method == "unify":
        _check_own_heads(inputs, base, head_keys)
        return _unify(inputs, base, config_file, config, head_keys, rescaler, out)
    merge_heads = keeper is None and not no_head
    if merge_heads:
        _check_same_heads(inputs, base, head_keys)
    elif keeper is not None and keeper.delta:
        _check_same_heads([keeper], base, head_keys)
    keys = [k for k in inputs[0].tensors if merge_heads or k not in head_keys]

    def part(tv: TaskVector) -> TaskVector:
        return tv if merge_heads else tv.filter(lambda k: k not in head_keys)

    vectors = [part(x.tensors) if x.delta or base is None else part(x.tensors) - part(base.tensors) for x in inputs]
    merged = _merge(vectors, method, weights, density, majority_sign, scope, seed, dare_variant)
    state = dict(merged if base is None else part(base.tensors) + merged)
    if keeper is not None:
        state.update(_absolute_head(keeper, base, head_keys))
        keys += [k for k in keeper.tensors if k in head_keys]
    params = {"weights": weights}
    if method == "ties":
        params.update(density=density, majority_sign=majority_sign, scope=scope)
    elif method == "dare":
        params.update(density=density, seed=seed, dare_variant=dare_variant)
        if dare_variant == "ties":
            params["majority_sign"] = majority_sign
    head = ("none" if not head_keys else "merged" if merge_heads else "dropped (--no-head)" if no_head
            else f"kept from `{keeper.name}` (--head-from)")
    params["head"] = head
    card = _card(inputs, base, method, params, config.get("base_model_name_or_path"))
    source = keeper if keeper is not None else next((x for x in [*inputs, base] if x is not None and x.folder), None)
    labelled = bool(head_keys) and not no_head and source is not base  # the base adapter's head is only the init
    with staged_folder(out) as staging:
        write_adapter_folder(staging, config_file.read_bytes(), TaskVector({k: state[k] for k in keys}), card)
        if source is not None and source.folder is not None:  # the tokenizer, and the label names of the head kept
            copy_loading_files(source.folder, staging, classifier=labelled)
        write_metadata(staging, _merged_metadata(inputs, source, method, head, labelled=labelled))
    return out


def _head_input(inputs: list[_Input], head_from) -> _Input:
    """The input `--head-from` names (by path, folder name or task), or one ConfigError listing them."""
    found = [x for x in inputs if x.matches(str(head_from))]
    if len(found) != 1:
        what = "no input" if not found else f"{len(found)} inputs"
        raise ConfigError(f"--head-from {str(head_from)!r}: {what} of this merge has that path, name or task; "
                          f"give one of {', '.join(x.source for x in inputs)}")
    return found[0]


def _absolute_head(x: _Input, base: _Input | None, head_keys: set[str]) -> dict:
    """`x`'s head as PEFT parameters (a delta task vector's is added to the base adapter's)."""
    return {k: x.tensors[k] + base.tensors[k] if x.delta else x.tensors[k] for k in x.tensors if k in head_keys}


def _head_rows(x: _Input, head_keys: set[str]) -> int | None:
    """Outputs of `x`'s head: the rows of its last weight (the output layer comes last in module order)."""
    weights = [k for k in x.tensors if k in head_keys and k.endswith("weight")]
    return int(x.tensors[weights[-1]].shape[0]) if weights else None


def _labels(x: _Input, head_keys: set[str]) -> str:
    rows, names = _head_rows(x, head_keys), x.label_names
    if names:
        return f"{len(names)} labels [{', '.join(names[:6])}{', …' if len(names) > 6 else ''}]"
    return f"{rows} labels (names not recorded)"


def _check_same_heads(inputs: list[_Input], base: _Input | None, head_keys: set[str]) -> None:
    """Heads are merged: refuse, naming both, heads of other sizes or other label names than the first's
    (and than --base-adapter's, which the task vectors are measured from)."""
    ref = inputs[0]
    fix = ("pass --head-from <input> to keep one input's head, or --no-head to write the shared modules only "
           "(--method unify keeps one head per input)")
    for x in [*inputs, *([base] if base is not None else [])]:
        if x is ref:
            continue
        for key in sorted(head_keys):
            if key in x.tensors and x.tensors[key].shape != ref.tensors[key].shape:
                raise TaskVectorError(f"{x.source}: its head has {_labels(x, head_keys)}, {ref.source}'s has "
                                      f"{_labels(ref, head_keys)}: heads of different sizes cannot be merged; {fix}")
        has_head = any(k in x.tensors for k in head_keys)  # a causal LM's adapter has none: its labels are words
        if has_head and x is not base and x.label_names and ref.label_names and x.label_names != ref.label_names:
            raise ConfigError(f"{x.source}: its head has {_labels(x, head_keys)}, {ref.source}'s has "
                              f"{_labels(ref, head_keys)}: heads of unrelated label sets cannot be merged; {fix}")


def _check_own_heads(inputs: list[_Input], base: _Input | None, head_keys: set[str]) -> None:
    """unify keeps each input's head: each one's recorded label names must be as many as its outputs, and a
    delta input's head must fit the base adapter's it is added to."""
    for x in inputs:
        rows = _head_rows(x, head_keys)
        if x.label_names and rows is not None and len(x.label_names) != rows:
            raise ConfigError(f"{x.source}: records {len(x.label_names)} label names "
                              f"[{', '.join(x.label_names[:6])}] but its head has {rows} outputs")
        if x.delta:
            _check_same_heads([x], base, head_keys)


def _merged_metadata(inputs: list[_Input], source: _Input | None, method: str, head: str, labelled: bool) -> dict:
    """The merged adapter's hf_fedtask.json: what it was merged from, and, from the input whose head (and
    label names) it carries, the task, labels, input kind and max_length `hf-fedtask evaluate` checks against."""
    meta = {"merge": {"method": method, "inputs": [x.name for x in inputs], "head": head}}
    recorded = (source.metadata or {}) if source is not None else {}
    tasks = {(x.metadata or {}).get("task") for x in inputs}
    if labelled and source is not None and source.label_names:
        meta["label_names"] = list(source.label_names)
        if head != "merged" or len(tasks) == 1:  # one task's head: evaluate defaults to that task
            meta.update({k: recorded[k] for k in ("task", "task_source") if k in recorded})
    meta.update({k: recorded[k] for k in ("modality", "base_model", "base_model_revision", "max_length", "data")
                 if k in recorded})
    return meta


def _check_options(n: int, method: str, weights, density, choices: dict[str, tuple[str, str]]) -> float | None:
    """Validate the options for `method`; return the density to use (None where it does not apply).
    `choices` maps an option name to (value given, allowed values)."""
    for option, (value, allowed) in {"method": (method, METHODS), **choices}.items():
        if value not in allowed:
            raise ConfigError(f"unknown {option} {value!r}; choose one of {', '.join(allowed)}")
    if n < 1:
        raise ConfigError("no inputs to merge")
    if weights is not None:
        if method == "unify":
            raise ConfigError("--weights does not apply to --method unify")
        if len(weights) != n:
            raise ConfigError(f"{len(weights)} weights for {n} inputs")
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"weights must be finite numbers, got {list(weights)}")
    if method not in DEFAULT_DENSITY:
        if density is not None:
            raise ConfigError(f"--density does not apply to --method {method}")
        return None
    density = DEFAULT_DENSITY[method] if density is None else density
    if not 0 < density <= 1:
        raise ConfigError(f"--density must be in (0, 1], got {density}")
    return density


def read_input(path: str | os.PathLike) -> _Input:
    p = Path(path)
    if p.is_dir():
        config_file = p / CONFIG_NAME
        config, tensors = read_adapter_folder(p)
        tensors = TaskVector(tensors)
        return _Input(str(p), p.name, tensors, False, config.get("base_model_name_or_path"), peft_config_hash(config),
                      config_file, adapter_label_names(p), read_metadata(p))
    if p.is_file():
        tv = TaskVector.load(p)
        header = tv.metadata
        if header.get("kind") not in ("delta", "absolute") or not header.get("peft_config_hash"):
            raise TaskVectorError(f"{p}: header needs 'kind' (delta or absolute) and 'peft_config_hash'")
        return _Input(str(p), p.name.removesuffix(".safetensors"), TaskVector(dict(tv)), header["kind"] == "delta",
                      header.get("base_model"), header["peft_config_hash"], None)
    raise ConfigError(f"{p}: no such adapter folder or task-vector file")


def _check_compatible(x: _Input, ref: _Input, head_keys: set[str]) -> None:
    """Raise a one-line error naming `x` unless it has `ref`'s base model, PEFT config, keys, shapes, dtypes
    (heads' shapes are checked where heads are merged: `_check_same_heads`)."""
    if x.base_model != ref.base_model:
        raise ConfigError(f"{x.source}: base model {x.base_model!r} differs from {ref.source}'s {ref.base_model!r}")
    if x.config_hash != ref.config_hash:
        raise ConfigError(f"{x.source}: PEFT config differs from {ref.source}'s "
                          f"(peft_config_hash {x.config_hash} vs {ref.config_hash})")
    for key in ref.tensors:
        if key not in x.tensors:
            raise TaskVectorError(f"{x.source}: key {key!r} is missing ({ref.source} has it)")
    for key, t in x.tensors.items():
        if key not in ref.tensors:
            raise TaskVectorError(f"{x.source}: unexpected key {key!r} ({ref.source} lacks it)")
        r = ref.tensors[key]
        if t.shape != r.shape and key not in head_keys:
            raise TaskVectorError(f"{x.source}: key {key!r} has shape {tuple(t.shape)}, "
                                  f"{ref.source} has {tuple(r.shape)}")
        if t.dtype != r.dtype:
            raise TaskVectorError(f"{x.source}: key {key!r} has dtype {t.dtype}, {ref.source} has {r.dtype}")


def _merge(vectors, method, weights, density, majority_sign, scope, seed, dare_variant) -> TaskVector:
    if method == "task_arithmetic":
        return merge.task_arithmetic(vectors, weights)
    if method == "ties":
        return merge.ties(vectors, weights, density=density, majority_sign_method=majority_sign, scope=scope)
    if dare_variant == "linear":
        return merge.dare_linear(vectors, weights, density=density, seed=seed)
    return merge.dare_ties(vectors, weights, density=density, seed=seed, majority_sign_method=majority_sign)


def _unify(inputs, base, config_file, config, head_keys, rescaler, out) -> Path:
    """MaTU/EMR unification of the shared keys; each input keeps its own head."""
    names = [x.name for x in inputs]
    if len(set(names)) != len(names):
        raise ConfigError(f"inputs must have distinct names for --method unify, got {names}")

    def shared(tv: TaskVector) -> TaskVector:
        return tv.filter(lambda k: k not in head_keys)

    init = shared(base.tensors) if base else shared(inputs[0].tensors).zeros_like()
    vectors = [shared(x.tensors) if x.delta else shared(x.tensors) - init for x in inputs]
    unified = merge.unify(vectors, rescaler=rescaler)
    # m_t where λ_t·(m_t ⊙ τ) is non-zero: the same task state, whatever layout Unified keeps masks in
    masks = {x.name: unified.mask(t) for t, x in enumerate(inputs)}
    heads = {x.name: TaskVector({k: x.tensors[k] + base.tensors[k] if x.delta else x.tensors[k] for k in head_keys})
             for x in inputs}
    base_model = config.get("base_model_name_or_path")
    if not base_model:
        raise ConfigError(f"{config_file}: no base_model_name_or_path to record in the compact export")
    try:
        peft_config = PeftConfig.from_pretrained(str(config_file.parent))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{config_file}: not a PEFT config: {' '.join(str(exc).split())}") from None
    rescalers = {x.name: float(unified.rescalers[t]) for t, x in enumerate(inputs)}
    card = _card(inputs, base, "unify", {"rescaler": rescaler}, base_model)
    label_names = {x.name: x.label_names for x in inputs if x.label_names}

    def finish(staging: Path) -> None:  # each input's folder loads like the input: its tokenizer, its labels
        for x in inputs:
            if x.folder is not None:
                copy_loading_files(x.folder, staging / x.name)
            write_metadata(staging / x.name, _merged_metadata([x], x, "unify", "kept", labelled=True))

    try:
        return save_compact(out, peft_config=peft_config, base_model_id=base_model, init=init, unified=unified.vector,
                            masks=masks, rescalers=rescalers, heads=heads, label_names=label_names, card=card,
                            task_folders=True, overwrite=True, finish=finish)
    except ValueError as exc:  # e.g. an input name that cannot be a task name
        raise ConfigError(f"--method unify: {exc}") from None


def _card(inputs, base, method, params, base_model) -> str:
    """A short model card: inputs, method and parameters."""
    header = ["---", "library_name: peft", f"tags: [hf-fedtask, merge, {method}]"]
    try:
        check_portable_base_model_id(base_model)
        header.insert(1, f"base_model: {json.dumps(base_model)}")
    except ValueError:
        pass  # a local path is not Hub metadata
    lines = [*header, "---", "", f"# Merged adapter ({method})", "",
             f"Merged one-shot by `hf-fedtask merge --method {method}` from:", ""]
    lines += [f"- `{x.name}`" for x in inputs]
    origin = f"`{base.name}` (`--base-adapter`)" if base else "zero (the raw adapter tensors are merged)"
    lines += ["", f"Task vectors are measured from {origin}.", "", "| parameter | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in params.items()]
    if method == "unify":
        lines += ["", ("Each input's adapter: stock PEFT from the folder `<name>/`, or "
                       "`hf_fedtask.load_task_adapter(\"<this folder>\", \"<name>\")` from the compact files.")]
    return "\n".join(lines) + "\n"
