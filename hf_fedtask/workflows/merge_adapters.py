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

Heads (modules_to_save keys) are merged like the rest when all inputs' have the same shape, else it
is an error; `unify` keeps each input's own head instead.

Output: a PEFT adapter folder (adapter_config.json of the first adapter folder among the inputs, else
of `--base-adapter`; the merged adapter_model.safetensors; a README card), written atomically. For
`unify` it is the compact export of `hf_fedtask.export.compact` with one task per input, named after the
input, plus each input's reconstructed adapter under OUT/<name>/.
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
    check_portable_base_model_id,
    read_adapter_config,
    read_adapter_folder,
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
    overwrite: bool = False,
) -> Path:
    """Merge the adapters or task vectors at `paths` with `method` (see METHODS) into `out`; return it.

    `weights` (one per input, default 1) apply to task_arithmetic, ties and dare; `density` (default
    0.2 for ties, 0.5 for dare) is the fraction kept; `dare_variant` is "linear" or "ties"; `rescaler`
    is unify's λ (see `hf_fedtask.merge.unify`). Bad inputs raise a one-line FedTaskError naming the
    file, before anything is written; an existing non-empty `out` is replaced only with `overwrite`."""
    density = _check_options(len(paths), method, weights, density, {
        "majority sign method": (majority_sign, SIGN_METHODS), "TIES scope": (scope, ("tensor", "model")),
        "DARE variant": (dare_variant, ("linear", "ties")), "rescaler": (rescaler, RESCALERS)})
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
        _check_compatible(x, ref, head_keys, allow_head_shapes=method == "unify" and not x.delta)

    if method == "unify":
        return _unify(inputs, base, config_file, config, head_keys, rescaler, out)
    vectors = [x.tensors if x.delta or base is None else x.tensors - base.tensors for x in inputs]
    merged = _merge(vectors, method, weights, density, majority_sign, scope, seed, dare_variant)
    state = merged if base is None else base.tensors + merged
    params = {"weights": weights}
    if method == "ties":
        params.update(density=density, majority_sign=majority_sign, scope=scope)
    elif method == "dare":
        params.update(density=density, seed=seed, dare_variant=dare_variant)
        if dare_variant == "ties":
            params["majority_sign"] = majority_sign
    card = _card(inputs, base, method, params, config.get("base_model_name_or_path"))
    with staged_folder(out) as staging:
        write_adapter_folder(staging, config_file.read_bytes(),
                             TaskVector({k: state[k] for k in inputs[0].tensors}), card)
    return out


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
                      config_file)
    if p.is_file():
        tv = TaskVector.load(p)
        header = tv.metadata
        if header.get("kind") not in ("delta", "absolute") or not header.get("peft_config_hash"):
            raise TaskVectorError(f"{p}: header needs 'kind' (delta or absolute) and 'peft_config_hash'")
        return _Input(str(p), p.name.removesuffix(".safetensors"), TaskVector(dict(tv)), header["kind"] == "delta",
                      header.get("base_model"), header["peft_config_hash"], None)
    raise ConfigError(f"{p}: no such adapter folder or task-vector file")


def _check_compatible(x: _Input, ref: _Input, head_keys: set[str], allow_head_shapes: bool) -> None:
    """Raise a one-line error naming `x` unless it has `ref`'s base model, PEFT config, keys, shapes, dtypes."""
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
        if t.shape != r.shape and not (allow_head_shapes and key in head_keys):
            hint = ("; heads of different sizes cannot be merged (--method unify keeps one per input)"
                    if key in head_keys else "")
            raise TaskVectorError(f"{x.source}: key {key!r} has shape {tuple(t.shape)}, "
                                  f"{ref.source} has {tuple(r.shape)}{hint}")
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
    try:
        return save_compact(out, peft_config=peft_config, base_model_id=base_model, init=init, unified=unified.vector,
                            masks=masks, rescalers=rescalers, heads=heads, card=card, task_folders=True, overwrite=True)
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
