"""Compact MaTU export: T task adapters stored as one shared PEFT init θ_p, one unified task vector τ,
a 1-bit mask m_t and a rescaler λ_t per task, and each task's classification head.

Task t's adapter is θ_p + λ_t·(m_t ⊙ τ) plus its head (MaTU: Tsouvalas, Ozcelebi and Meratnia, 2025,
arXiv:2502.06376, §3.2), so T float32 adapters cost about 2 + T/32 adapter sizes instead of T; with θ_p
regenerated from its seed (`init_seed`) and τ in 16 bits, 1/2 + T/32 (0.094 of T adapters at T = 8, 0.048
at 30, plus the heads both keep: 0.124 and 0.068 with MiniLM's).
`load_task_adapter` rebuilds one as a ready `PeftModel`;
`save_compact(..., task_folders=True)` also writes each as a stock PEFT folder `<folder>/<task>/`.

Folder layout (safetensors files are task-vector files, see `hf_fedtask.core.taskvector_file`, whose header
carries `content` and the `peft_config_hash` of adapter_config.json, so mixed-up files are caught):

    adapter_config.json  the PEFT config; base_model_name_or_path is the base model id
    tasks.json           format marker, task order, num_labels and label names per task
    init.safetensors     θ_p over the shared PEFT keys; absent when θ_p regenerates from the seed the run
                         built its PEFT model with: tasks.json's `init` then records that seed (and the
                         width of a shared head), the dtype and the SHA-256 of θ_p, checked on reload
    unified.safetensors  τ over the same keys (float32, or float16 / bfloat16: a task's adapter is then
                         θ_p + λ_t·(m_t ⊙ τ) with τ widened to float32, exactly what was stored)
    masks.safetensors    per task (key = task name) a uint8 tensor: the masks of all shared keys,
                         flattened in the header's `mask_keys` order, concatenated and bit-packed
                         (numpy packbits layout); `mask_shapes` holds the keys' shapes
    rescalers.json       {task: λ_t}
    heads.safetensors    `<task>::<PEFT key>` -> the task's head tensors (modules_to_save); empty when
                         one head is shared by all tasks (a shared output space): that head is then
                         part of the shared keys, and tasks.json gives its `head_keys` and each
                         task's `head_rows` [start, stop), the rows its adapter carries
    README.md            the card, when given
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import safetensors.torch
import torch
from peft import PeftConfig
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import safetensors_ready
from hf_fedtask.errors import ConfigError, FedTaskError, OutputDirError, TaskVectorError
from hf_fedtask.merge.bitmask import pack_bits, packed_size, unpack_bits

FORMAT = "hf_fedtask.export.compact"
FORMAT_VERSION = "2"  # 2: init.safetensors may be left out (tasks.json's `init`), τ may be 16-bit
READABLE_VERSIONS = ("1", "2")
UNIFIED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TASKS_FILE = "tasks.json"
INIT_FILE = "init.safetensors"
UNIFIED_FILE = "unified.safetensors"
MASKS_FILE = "masks.safetensors"
RESCALERS_FILE = "rescalers.json"
HEADS_FILE = "heads.safetensors"
CARD_FILE = "README.md"
_FILES = (CONFIG_NAME, TASKS_FILE, INIT_FILE, UNIFIED_FILE, MASKS_FILE, RESCALERS_FILE, HEADS_FILE)
_HEAD_SEP = "::"
_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # usable as a folder name and a key prefix


def save_compact(
    folder: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    base_model_id: str,
    init: Mapping[str, torch.Tensor],
    unified: Mapping[str, torch.Tensor],
    masks: Mapping[str, Mapping[str, torch.Tensor]],
    rescalers: Mapping[str, float],
    heads: Mapping[str, Mapping[str, torch.Tensor]],
    label_names: Mapping[str, Sequence[str]] | None = None,
    head_rows: Mapping[str, tuple[int, int]] | None = None,
    head_keys: Sequence[str] = (),
    card: str | None = None,
    task_folders: bool = False,
    overwrite: bool = False,
    finish: Callable[[Path], None] | None = None,
    init_seed: int | None = None,
    shared_head: int = 0,
) -> Path:
    """Write the compact export of the tasks in `masks` (their order is kept) and return the folder.

    `init` and `unified` map the shared PEFT keys (saved naming) to tensors of equal shape and dtype;
    `masks[t]` maps the same keys to bool tensors; `heads[t]` maps the head keys to task t's head (empty
    for every task of a causal LM, which answers in words: `label_names` then give each task's outputs).
    With one head shared by all tasks, `heads[t]` are empty, `head_keys` name that head's keys among
    the shared ones and `head_rows[t]` is the slice of its outputs task t's adapter carries.
    `base_model_id` is recorded in adapter_config.json (a Hub id keeps the export portable). The
    folder is built beside `folder` and swapped in when complete; a non-empty folder that is not a
    compact export is only replaced with `overwrite=True` (else OutputDirError). `finish`, when given, is
    called with the staging folder once everything is written (e.g. to add each task folder's tokenizer),
    before it is swapped in. `unified` may be float32, float16 or bfloat16 (2 bytes an entry instead of 4).
    `init_seed` (with `shared_head`, the outputs of a head shared by all tasks) is the seed the run built its
    PEFT model with: when `regenerate_init` on `base_model_id` gives `init` bit for bit, init.safetensors is
    left out and tasks.json records how to regenerate it; else it is stored, and tasks.json and
    `storage_report` say why. Bad arguments raise ValueError."""
    tasks = list(masks)
    num_labels = _check_arguments(tasks, init, unified, masks, rescalers, heads, label_names or {}, head_rows,
                                  head_keys)
    out = Path(folder).absolute()
    if out.is_dir() and any(out.iterdir()) and not is_compact(out) and not overwrite:
        raise OutputDirError(f"{out} is not empty and not a compact export; pass overwrite=True to replace it")
    init_record = None if init_seed is None else _init_record(init, base_model_id, peft_config, init_seed,
                                                              shared_head)
    with staged_folder(out) as staging:
        config = copy.deepcopy(peft_config)
        config.base_model_name_or_path = base_model_id
        config.inference_mode = True  # what PeftModel.save_pretrained records
        config.save_pretrained(str(staging))
        header = {"base_model": base_model_id, "peft_config_hash": peft_config_hash(config),
                  "task_ids": json.dumps(tasks)}
        if init_record is None or "seed" not in init_record:
            TaskVector(init).save(staging / INIT_FILE, {**header, "kind": "absolute", "content": "init"})
        TaskVector(unified).save(staging / UNIFIED_FILE, {**header, "kind": "delta", "content": "unified"})
        keys = list(init)
        packed = {t: pack_bits(torch.cat([masks[t][k].reshape(-1).cpu() for k in keys])) for t in tasks}
        TaskVector(packed).save(staging / MASKS_FILE, {
            **header, "content": "masks", "mask_keys": json.dumps(keys),
            "mask_shapes": json.dumps([list(init[k].shape) for k in keys]),
        })
        stacked_heads = {f"{t}{_HEAD_SEP}{k}": v for t in tasks for k, v in heads[t].items()}
        TaskVector(stacked_heads).save(staging / HEADS_FILE, {**header, "content": "heads"})
        (staging / RESCALERS_FILE).write_text(json.dumps({t: float(rescalers[t]) for t in tasks}, indent=2))
        info = [{"name": t, "num_labels": num_labels[t],
                 "label_names": list(label_names[t]) if label_names and t in label_names else None,
                 **({"head_rows": list(head_rows[t])} if head_rows else {})} for t in tasks]
        (staging / TASKS_FILE).write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "tasks": info,
                                                      **({"head_keys": list(head_keys)} if head_rows else {}),
                                                      **({"init": init_record} if init_record else {})},
                                                     indent=2))
        if card is not None:
            (staging / CARD_FILE).write_text(str(card), encoding="utf-8")
        if task_folders:
            written = _CompactFolder(staging, _init=init)  # read back: the folders hold what task_state returns
            for t in tasks:
                write_adapter_folder(staging / t, written.config_json, written.task_state(t))
        if finish is not None:
            finish(staging)
    return out


def _check_arguments(tasks, init, unified, masks, rescalers, heads, label_names, head_rows=None,
                     head_keys=()) -> dict[str, int]:
    """Raise ValueError on inconsistent arguments; return num_labels per task."""
    if not tasks:
        raise ValueError("no tasks to save")
    for t in tasks:
        if not _TASK_NAME.fullmatch(t) or t in _FILES or t == CARD_FILE:
            raise ValueError(f"task name {t!r} must match {_TASK_NAME.pattern} and not be a file name of the export")
    for name, per_task in (("rescalers", rescalers), ("heads", heads)):
        if set(per_task) != set(tasks):
            raise ValueError(f"{name} are for tasks {sorted(per_task)}, masks for {sorted(tasks)}")
    if not init:
        raise ValueError("init has no tensors")
    _check_like(init, unified, "unified")
    if any(v.dtype not in UNIFIED_DTYPES for v in unified.values()):
        raise ValueError(f"unified must hold float32, float16 or bfloat16 tensors, got "
                         f"{sorted({str(v.dtype) for v in unified.values()})}")
    for t in tasks:
        _check_like(init, masks[t], f"mask of {t!r}")
        if any(m.dtype != torch.bool for m in masks[t].values()):
            raise ValueError(f"mask of {t!r} must hold bool tensors")
        if not math.isfinite(rescalers[t]):
            raise ValueError(f"rescaler of {t!r} is {rescalers[t]}")
    if head_rows is not None:
        return _check_shared_head(tasks, init, heads, label_names, head_rows, head_keys)
    head_keys = list(heads[tasks[0]])
    if not any(heads[t] for t in tasks) and all(label_names.get(t) is not None for t in tasks):
        # no heads: a causal LM answers in its label words (none: a free-text task)
        return {t: len(label_names[t]) for t in tasks}
    if not head_keys or set(head_keys) & set(init):
        raise ValueError("heads must be non-empty and disjoint from the shared keys")
    num_labels = {}
    for t in tasks:
        if set(heads[t]) != set(head_keys):
            raise ValueError(f"head of {t!r} has keys {list(heads[t])}, the head of {tasks[0]!r} has {head_keys}")
        weights = [v for k, v in heads[t].items() if k.endswith("weight")]
        if not weights:
            raise ValueError(f"head of {t!r} has no weight tensor")
        num_labels[t] = int(weights[-1].shape[0])  # the output layer is the head's last in module order
        if label_names.get(t) is not None and len(label_names[t]) != num_labels[t]:
            raise ValueError(f"{len(label_names[t])} label names for the {num_labels[t]} outputs of the head of {t!r}")
    return num_labels


def _check_shared_head(tasks, init, heads, label_names, head_rows, head_keys) -> dict[str, int]:
    if not head_keys or not set(head_keys) <= set(init):
        raise ValueError("head_keys must name the shared head's keys among init's")
    if set(head_rows) != set(tasks) or any(len(heads[t]) for t in tasks):
        raise ValueError("a shared head needs head_rows for every task and no per-task heads")
    width = int(init[head_keys[0]].shape[0])
    num_labels = {}
    for t in tasks:
        start, stop = head_rows[t]
        if not 0 <= start < stop <= width:
            raise ValueError(f"head_rows of {t!r} are {head_rows[t]}, outside the shared head's {width} outputs")
        num_labels[t] = stop - start
        if label_names.get(t) is not None and len(label_names[t]) != num_labels[t]:
            raise ValueError(f"{len(label_names[t])} label names for the {num_labels[t]} rows of {t!r}")
    return num_labels


def _check_like(ref: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], what: str):
    if set(other) != set(ref):
        raise ValueError(f"{what} has keys {sorted(set(other) ^ set(ref))[:3]} that init lacks or the reverse")
    for k, v in ref.items():
        if other[k].shape != v.shape:
            raise ValueError(f"{what}: key {k!r} is {other[k].dtype}{tuple(other[k].shape)}, "
                             f"init has {v.dtype}{tuple(v.shape)}")


def regenerate_init(base_model: str, peft_config: PeftConfig, seed: int, shared_head: int = 0) -> TaskVector:
    """θ_p as a run builds it (`hf_fedtask.model.host.PeftHost`: the global RNG seeded with `seed`, the base
    model's classifier loaded, then the PEFT model made from `peft_config`), over the shared PEFT keys (with
    a shared head of `shared_head` outputs). Loads the base model (resolved as a run resolves it); the
    caller's RNG state is left as it was. Raises ConfigError where the base model does not load."""
    from hf_fedtask.model.backbone import resolve_base_model
    from hf_fedtask.model.host import PeftHost

    config = copy.deepcopy(peft_config)
    config.inference_mode = False  # as a run builds it (the saved config records True)
    with torch.random.fork_rng(devices=[]):
        return PeftHost(resolve_base_model(base_model), config, seed=seed, shared_head=shared_head).initial_shared()


@functools.lru_cache(maxsize=2)
def _regenerated(folder: Path, base_model: str, config_json: bytes, seed: int, shared_head: int) -> TaskVector:
    """`regenerate_init` for a compact folder, kept for the next task of the same folder (loading each task
    would otherwise load the base model again)."""
    return regenerate_init(base_model, PeftConfig.from_pretrained(str(folder)), seed, shared_head)


def init_digest(init: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over θ_p's keys (in name order), dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for k in sorted(init):
        v = init[k].detach().cpu().contiguous()
        h.update(f"{k}|{str(v.dtype).removeprefix('torch.')}|{list(v.shape)}|".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _init_record(init, base_model_id, peft_config, seed: int, shared_head: int) -> dict:
    """tasks.json's `init`: how θ_p regenerates, or why it is stored (it does not regenerate bit for bit)."""
    dtypes = {v.dtype for v in init.values()}
    if len(dtypes) != 1:
        return {"stored": f"init mixes dtypes {sorted(str(d) for d in dtypes)}"}
    try:
        again = regenerate_init(base_model_id, peft_config, seed, shared_head)
    except (FedTaskError, OSError, ValueError) as exc:
        return {"stored": f"base model {base_model_id!r} does not load here ({' '.join(str(exc).split())[:200]})"}
    if set(again) != set(init) or any(not torch.equal(again[k], init[k]) for k in init):
        return {"stored": f"{base_model_id!r} with seed {seed} does not regenerate this init bit for bit"}
    return {"seed": seed, "shared_head": shared_head, "dtype": str(dtypes.pop()).removeprefix("torch."),
            "sha256": init_digest(init)}


def is_compact(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a compact export (by its tasks.json format marker)."""
    try:
        return json.loads((Path(folder) / TASKS_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class _CompactFolder:
    """A compact export's files, read and validated once; errors name the file at fault. A regenerated θ_p
    is rebuilt on first use (`init`) from `base_model` (else the recorded base model); `_init` supplies it
    (the writer's own, when it reads back what it wrote)."""

    def __init__(self, folder: str | os.PathLike, base_model: str | None = None, _init: TaskVector | None = None):
        self.folder = Path(folder)
        if not (self.folder / TASKS_FILE).is_file():
            raise ConfigError(f"{self.folder}: not a compact export (no {TASKS_FILE})")
        info = _read_json(self.folder / TASKS_FILE)
        header = ((info.get("format"), info.get("format_version"), type(info.get("tasks")))
                  if isinstance(info, dict) else ())
        if header not in [(FORMAT, version, list) for version in READABLE_VERSIONS]:
            raise TaskVectorError(f"{self.folder / TASKS_FILE}: not a {FORMAT} v{'/v'.join(READABLE_VERSIONS)} "
                                  "task list")
        self.tasks = {}
        for entry in info["tasks"]:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("num_labels"), int)):
                raise TaskVectorError(f"{self.folder / TASKS_FILE}: bad task entry {entry!r}")
            rows = entry.get("head_rows")
            if rows is not None and not (isinstance(rows, list) and len(rows) == 2
                                         and all(isinstance(r, int) for r in rows) and 0 <= rows[0] < rows[1]):
                raise TaskVectorError(f"{self.folder / TASKS_FILE}: task {entry['name']!r} has bad head_rows {rows!r}")
            self.tasks[entry["name"]] = entry
        self.head_keys = info.get("head_keys") or []
        if not (isinstance(self.head_keys, list) and all(isinstance(k, str) for k in self.head_keys)):
            raise TaskVectorError(f"{self.folder / TASKS_FILE}: bad head_keys {self.head_keys!r}")
        try:
            self.config_json = (self.folder / CONFIG_NAME).read_bytes()
            config = json.loads(self.config_json)
            expect = {"peft_config_hash": peft_config_hash(config)}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise TaskVectorError(f"{self.folder / CONFIG_NAME}: not a readable PEFT config: {exc}") from None
        self.base_model = config.get("base_model_name_or_path")
        self._regenerate_from = base_model or self.base_model
        self.init_record = info.get("init") if isinstance(info.get("init"), dict) else {}
        self.regenerated = "seed" in self.init_record
        self.masks = TaskVector.load(self.folder / MASKS_FILE, expect={**expect, "content": "masks"})
        self.mask_layout = self._mask_layout()
        shapes = dict(self.mask_layout)
        if self.regenerated:
            record = self.init_record
            if not (isinstance(record.get("seed"), int) and isinstance(record.get("shared_head"), int)
                    and record.get("dtype") in ("float32", "float16", "bfloat16")
                    and isinstance(record.get("sha256"), str)):
                raise TaskVectorError(f"{self.folder / TASKS_FILE}: bad init record {record!r}")
            self._init = _init
        else:
            self._init = TaskVector.load(self.folder / INIT_FILE, template=shapes, expect={**expect, "content": "init"})
        self.unified = TaskVector.load(self.folder / UNIFIED_FILE, template=shapes,
                                       expect={**expect, "content": "unified"})
        bad = [k for k, v in self.unified.items() if v.dtype not in UNIFIED_DTYPES]
        if bad:
            raise TaskVectorError(f"{self.folder / UNIFIED_FILE}: key {bad[0]!r} is {self.unified[bad[0]].dtype}, "
                                  "expected float32, float16 or bfloat16")
        self.heads = TaskVector.load(self.folder / HEADS_FILE, expect={**expect, "content": "heads"})
        self.rescalers = _read_json(self.folder / RESCALERS_FILE)
        if not isinstance(self.rescalers, dict):
            raise TaskVectorError(f"{self.folder / RESCALERS_FILE}: not a {{task: rescaler}} object")

    def _mask_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        source = self.folder / MASKS_FILE
        header = self.masks.raw_metadata
        try:
            layout = [(k, tuple(s)) for k, s in zip(json.loads(header["mask_keys"]), json.loads(header["mask_shapes"]),
                                                    strict=True)]
        except (KeyError, ValueError, TypeError):
            raise TaskVectorError(f"{source}: header 'mask_keys'/'mask_shapes' missing or malformed") from None
        if len({k for k, _ in layout}) != len(layout):
            raise TaskVectorError(f"{source}: header 'mask_keys' repeats a key")
        return layout

    @property
    def init(self) -> TaskVector:
        """θ_p: stored, or regenerated from its seed and checked against the recorded SHA-256 (a base model or
        library version that builds another init is an error naming the file, never a wrong adapter)."""
        if self._init is None:
            record, source = self.init_record, self.folder / TASKS_FILE
            try:
                init = _regenerated(self.folder.absolute(), self._regenerate_from, self.config_json, record["seed"],
                                    record["shared_head"])
            except (FedTaskError, OSError, ValueError) as exc:
                raise FedTaskError(f"{source}: θ_p regenerates from seed {record['seed']} on the base model "
                                   f"{self._regenerate_from!r}, which does not load here "
                                   f"({' '.join(str(exc).split())[:300]}); pass base_model") from None
            init = TaskVector({k: init[k] for k, _ in self.mask_layout if k in init})
            if dict(self.mask_layout) != {k: tuple(v.shape) for k, v in init.items()} or \
                    init_digest(init) != record["sha256"]:
                raise TaskVectorError(f"{source}: θ_p regenerated from seed {record['seed']} on "
                                      f"{self._regenerate_from!r} does not match the recorded SHA-256 (another base "
                                      "model, or a peft/transformers version that initializes differently)")
            self._init = init
        return self._init

    def init_template(self) -> dict[str, torch.Tensor]:
        """Zeros shaped and typed like θ_p, without regenerating it (what sizes are computed from)."""
        if self._init is not None:
            return {k: torch.zeros_like(v) for k, v in self._init.items()}
        dtype = getattr(torch, self.init_record["dtype"])
        return {k: torch.zeros(shape, dtype=dtype) for k, shape in self.mask_layout}

    def task_state(self, task: str, init: Mapping[str, torch.Tensor] | None = None) -> TaskVector:
        """θ_p + λ_t·(m_t ⊙ τ) over the shared keys (τ widened to θ_p's dtype), then the task's head, in saved
        PEFT naming. `init` replaces θ_p (`init_template`: the sizes without regenerating it)."""
        if task not in self.tasks:
            raise ConfigError(f"{self.folder}: unknown task {task!r}; known tasks: {', '.join(self.tasks)}")
        source = self.folder / MASKS_FILE
        total = sum(math.prod(shape) for _, shape in self.mask_layout)
        packed = self.masks.get(task)
        if packed is None or packed.dtype != torch.uint8 or packed.shape != (packed_size(total),):
            found = ("missing" if packed is None
                     else f"{str(packed.dtype).removeprefix('torch.')} of shape {tuple(packed.shape)}")
            raise TaskVectorError(f"{source}: key {task!r} is {found}, expected uint8 of shape ({packed_size(total)},)")
        lam = self.rescalers.get(task)
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam):
            raise TaskVectorError(f"{self.folder / RESCALERS_FILE}: task {task!r} has no finite rescaler ({lam!r})")
        flat = unpack_bits(packed, total)
        init = self.init if init is None else init
        state, offset = {}, 0
        for key, shape in self.mask_layout:
            n = math.prod(shape)
            mask = flat[offset : offset + n].reshape(shape)
            state[key] = init[key] + self.unified[key].to(init[key].dtype) * mask * float(lam)
            offset += n
        rows = self.tasks[task].get("head_rows")
        if rows is not None:  # a shared head: its keys are among the shared ones; the task's rows of it
            missing = [k for k in self.head_keys if k not in state] or ([] if self.head_keys else ["head_keys"])
            if missing:
                raise TaskVectorError(f"{self.folder / TASKS_FILE}: shared head key {missing[0]!r} "
                                      f"is not in {INIT_FILE}")
            return TaskVector({k: v[rows[0]:rows[1]] if k in self.head_keys else v for k, v in state.items()})
        prefix = f"{task}{_HEAD_SEP}"
        head = {k[len(prefix):]: v for k, v in self.heads.items() if k.startswith(prefix)}
        if not head and self.heads:  # (an export without any head is a causal LM's: its words are its outputs)
            raise TaskVectorError(f"{self.folder / HEADS_FILE}: no head for task {task!r}")
        return TaskVector({**state, **head})


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TaskVectorError(f"{path}: cannot read: {' '.join(str(exc).split())}") from None


def task_state(folder: str | os.PathLike, task: str, base_model: str | None = None) -> TaskVector:
    """Task `task`'s full PEFT state (shared modules and head), as its stock adapter folder holds it.
    Where θ_p is regenerated from its seed, the base model (`base_model`, else the recorded one) is loaded.
    Unknown task: ConfigError listing the known ones; corrupt files: TaskVectorError naming the file."""
    return _CompactFolder(folder, base_model).task_state(task)


def load_task_adapter(folder: str | os.PathLike, task: str, base_model: str | None = None):
    """A ready `PeftModel` (eval mode) for `task` of the compact export in `folder`.

    The base is `base_model` (a local folder or Hub id) or the folder's recorded base model, resolved
    like `backbone.resolve_base_model` (the default MiniLM loads offline), with the task's
    num_labels and label names. The task's adapter is written to a temporary folder and loaded with
    stock `PeftModel.from_pretrained`, so the model is exactly what its per-task folder gives."""
    from peft import PeftModel

    from hf_fedtask.export.adapter import load_adapter_base
    from hf_fedtask.model.backbone import quiet_peft_wrap

    compact = _CompactFolder(folder, base_model)
    state = compact.task_state(task)
    name = base_model or compact.base_model
    if not name:
        raise ConfigError(f"{folder}: no base model recorded in {CONFIG_NAME}; pass base_model")
    info = compact.tasks[task]
    _, model = load_adapter_base(name, info["num_labels"], folder)
    if info.get("label_names"):
        model.config.id2label = dict(enumerate(info["label_names"]))
        model.config.label2id = {label: i for i, label in enumerate(info["label_names"])}
    with tempfile.TemporaryDirectory(prefix="hf-fedtask-task-") as tmp:
        write_adapter_folder(Path(tmp), compact.config_json, state)
        try:
            with quiet_peft_wrap():
                peft_model = PeftModel.from_pretrained(model, tmp)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise FedTaskError(f"{folder}: task {task!r} does not load onto {name} "
                               f"({str(exc).splitlines()[0]})") from None
    return peft_model.eval()


def storage_report(folder: str | os.PathLike) -> dict:
    """Bytes of the compact export (its top-level files but the card) against T separate stock
    adapters (adapter_model.safetensors, serialized here exactly as the per-task folders are, plus
    adapter_config.json each), their ratio, and how θ_p is kept (`init`: "stored", or "regenerated from
    seed <s>"; `init_stored_because` where regenerating was asked for but did not reproduce it). Regenerated
    θ_p is not rebuilt: the sizes depend only on its shapes and dtype."""
    compact = _CompactFolder(folder)
    files = {name: (compact.folder / name).stat().st_size for name in _FILES if (compact.folder / name).exists()}
    template = compact.init_template()
    per_task = {t: len(_adapter_bytes(compact.task_state(t, init=template))) + len(compact.config_json)
                for t in compact.tasks}
    compact_bytes, separate_bytes = sum(files.values()), sum(per_task.values())
    record = compact.init_record
    return {"tasks": len(per_task), "compact_bytes": compact_bytes, "separate_bytes": separate_bytes,
            "ratio": compact_bytes / separate_bytes, "files": files, "per_task_bytes": per_task,
            "init": f"regenerated from seed {record['seed']}" if compact.regenerated else "stored",
            **({"init_stored_because": record["stored"]} if "stored" in record else {})}


def _adapter_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """adapter_model.safetensors content, serialized as `save_adapter` writes it."""
    return safetensors.torch.save(safetensors_ready(state), metadata={"format": "pt"})


def write_adapter_folder(folder: Path, config_json: bytes, state: Mapping[str, torch.Tensor],
                         card: str | None = None) -> None:
    """Write a stock PEFT adapter folder: adapter_config.json as given, the weights, the card."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_bytes(config_json)
    (folder / SAFETENSORS_WEIGHTS_NAME).write_bytes(_adapter_bytes(state))
    if card is not None:
        (folder / CARD_FILE).write_text(card, encoding="utf-8")
