"""Compact MaTU export: round trip, stock-PEFT equality per task, bit-exact masks, errors, storage."""

import json

import numpy as np
import pytest
import safetensors
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError, OutputDirError, TaskVectorError
from hf_fedtask.export import compact
from hf_fedtask.export.adapter import save_adapter
from hf_fedtask.export.compact import (
    load_task_adapter,
    save_compact,
    storage_report,
    task_state,
)
from hf_fedtask.model.backbone import load_classifier, resolve_base_model

BASE_ID = "hf-fedtask-tests/tiny-bert"
BATCH = {"input_ids": torch.randint(1, 1000, (4, 8), generator=torch.Generator().manual_seed(1)),
         "attention_mask": torch.ones(4, 8, dtype=torch.long)}


def lora_config():
    return LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])


@pytest.fixture(scope="module")
def peft_layout(tiny_bert_dir):
    """(θ_p, head keys) of LoRA r=4 on the tiny BERT: A seeded random, B zero."""
    torch.manual_seed(0)
    model = get_peft_model(load_classifier(resolve_base_model(tiny_bert_dir), 2), lora_config())
    state = get_peft_model_state_dict(model)
    head_keys = [k for k in state if ".classifier." in k]
    init = TaskVector({k: v.detach().clone() for k, v in state.items() if k not in head_keys})
    return init, head_keys


def make_parts(peft_layout, num_tasks, seed=0):
    """Random unified vector, masks, rescalers and heads of 2, 3, 4, ... labels."""
    init, head_keys = peft_layout
    g = torch.Generator().manual_seed(seed)
    unified = init.apply(lambda t: torch.randn(t.shape, generator=g))
    tasks = [f"task{i}" for i in range(num_tasks)]
    masks = {t: init.apply(lambda v: torch.rand(v.shape, generator=g) < 0.5) for t in tasks}
    rescalers = {t: 0.5 + i for i, t in enumerate(tasks)}
    heads = {t: TaskVector({head_keys[0]: torch.randn(2 + i, 32, generator=g),
                            head_keys[1]: torch.randn(2 + i, generator=g)})
             for i, t in enumerate(tasks)}
    return {"peft_config": lora_config(), "base_model_id": BASE_ID, "init": init, "unified": unified,
            "masks": masks, "rescalers": rescalers, "heads": heads}


def test_round_trip_per_task_folders_and_stock_peft_equality(tmp_path, peft_layout, tiny_bert_dir):
    parts = make_parts(peft_layout, 3)
    labels = {"task1": ["a", "b", "c"]}
    folder = save_compact(tmp_path / "out", label_names=labels, card="# card\n", task_folders=True, **parts)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*compact._FILES, "README.md", "task0", "task1", "task2"])
    assert json.loads((folder / "tasks.json").read_text())["tasks"][1] == {
        "name": "task1", "num_labels": 3, "label_names": ["a", "b", "c"]}

    for i, t in enumerate(["task0", "task1", "task2"]):
        state = task_state(folder, t)
        for k, theta in parts["init"].items():
            expected = theta + torch.where(parts["masks"][t][k], parts["rescalers"][t] * parts["unified"][k], 0.0)
            assert torch.equal(state[k], expected), k
        for k, v in parts["heads"][t].items():
            assert torch.equal(state[k], v)
        with safetensors.safe_open(folder / t / "adapter_model.safetensors", "pt") as f:
            assert set(f.keys()) == set(state)
            assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)

        # the same state in an adapter folder written independently, loaded with stock PEFT
        reference = save_adapter(tmp_path / f"ref-{t}", peft_config=lora_config(), state_dict=state,
                                 base_model_id=BASE_ID)
        stock = PeftModel.from_pretrained(load_classifier(resolve_base_model(tiny_bert_dir), 2 + i), reference).eval()
        ours = load_task_adapter(folder, t, base_model=tiny_bert_dir)
        assert isinstance(ours, PeftModel) and not ours.training
        with torch.no_grad():
            assert torch.equal(ours(**BATCH).logits, stock(**BATCH).logits)
    assert load_task_adapter(folder, "task1", base_model=tiny_bert_dir).config.id2label == {0: "a", 1: "b", 2: "c"}


def test_load_task_adapter_is_exported_from_the_package():
    import hf_fedtask

    assert hf_fedtask.load_task_adapter is load_task_adapter


def test_masks_are_bit_exact_in_numpy_packbits_layout(tmp_path, peft_layout):
    parts = make_parts(peft_layout, 3, seed=4)
    init, _ = peft_layout
    odd = {"x.weight": torch.zeros(3, 5), **init.zeros_like()}  # 15 entries first: nothing is byte-aligned
    g = torch.Generator().manual_seed(9)
    masks = {t: TaskVector({k: torch.rand(v.shape, generator=g) < 0.3 for k, v in odd.items()}) for t in parts["masks"]}
    parts.update(init=TaskVector(odd), unified=TaskVector({k: torch.ones_like(v) for k, v in odd.items()}), masks=masks,
                 rescalers={t: 1.0 for t in masks})
    folder = save_compact(tmp_path / "out", **parts)

    with safetensors.safe_open(folder / "masks.safetensors", "np") as f:
        keys = json.loads(f.metadata()["mask_keys"])
        for t, mask in masks.items():
            flat = np.unpackbits(f.get_tensor(t))[: sum(v.numel() for v in odd.values())]
            assert np.array_equal(flat, torch.cat([mask[k].reshape(-1) for k in keys]).numpy())
    for t, mask in masks.items():  # with θ_p = 0, τ = 1, λ = 1 the task state is the mask itself
        state = task_state(folder, t)
        assert all(torch.equal(state[k], mask[k].float()) for k in odd)


def test_unknown_task_lists_the_known_ones(tmp_path, peft_layout):
    folder = save_compact(tmp_path / "out", **make_parts(peft_layout, 3))
    with pytest.raises(ConfigError, match="unknown task 'nope'; known tasks: task0, task1, task2"):
        task_state(folder, "nope")
    with pytest.raises(ConfigError, match="not a compact export"):
        task_state(tmp_path, "task0")


def test_corrupt_files_name_the_file(tmp_path, peft_layout):
    parts = make_parts(peft_layout, 3)
    folder = save_compact(tmp_path / "out", **parts)
    data = (folder / "masks.safetensors").read_bytes()
    (folder / "masks.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(TaskVectorError, match="masks.safetensors") as err:
        task_state(folder, "task0")
    assert "\n" not in str(err.value)

    # a well-formed file whose packed mask has the wrong length
    init = TaskVector.load(folder / "init.safetensors")
    TaskVector({"task0": torch.zeros(3, dtype=torch.uint8)}).save(folder / "masks.safetensors", {
        **init.raw_metadata, "content": "masks", "mask_keys": json.dumps(list(init)),
        "mask_shapes": json.dumps([list(v.shape) for v in init.values()])})
    with pytest.raises(TaskVectorError, match=r"masks.safetensors: key 'task0' is uint8 of shape \(3,\)"):
        task_state(folder, "task0")

    folder = save_compact(tmp_path / "out2", **parts)
    (folder / "rescalers.json").write_text("{not json")
    with pytest.raises(TaskVectorError, match="rescalers.json"):
        task_state(folder, "task0")

    # a file from an export with another PEFT config
    folder = save_compact(tmp_path / "out3", **parts)
    other = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=16, target_modules=["query", "value"])
    save_compact(tmp_path / "out4", **{**parts, "peft_config": other})
    (tmp_path / "out4" / "init.safetensors").replace(folder / "init.safetensors")
    with pytest.raises(TaskVectorError, match=r"out3/init.safetensors: header 'peft_config_hash' mismatch"):
        task_state(folder, "task0")


def test_overwrite_rules_and_failed_writes(tmp_path, peft_layout, monkeypatch):
    parts = make_parts(peft_layout, 3)
    other = tmp_path / "out"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not a compact export"):
        save_compact(other, **parts)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]

    save_compact(other, overwrite=True, **parts)
    save_compact(other, **make_parts(peft_layout, 4))  # a compact export may be replaced
    assert len(json.loads((other / "tasks.json").read_text())["tasks"]) == 4
    before = {p.name: p.read_bytes() for p in other.iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(compact, "pack_bits", broken)
    with pytest.raises(OSError, match="disk full"):
        save_compact(other, **parts)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folders left


def test_bad_arguments_are_value_errors(tmp_path, peft_layout):
    parts = make_parts(peft_layout, 3)
    key = next(iter(parts["init"]))
    bad_mask = {**parts["masks"],
                "task0": TaskVector({**parts["masks"]["task0"], key: torch.ones(2, dtype=torch.bool)})}
    with pytest.raises(ValueError, match="mask of 'task0'"):
        save_compact(tmp_path / "a", **{**parts, "masks": bad_mask})
    with pytest.raises(ValueError, match="task name"):
        save_compact(tmp_path / "a", **{**parts, "masks": {"a::b": parts["masks"]["task0"]},
                                        "rescalers": {"a::b": 1.0}, "heads": {"a::b": parts["heads"]["task0"]}})
    with pytest.raises(ValueError, match="2 label names"):
        save_compact(tmp_path / "a", label_names={"task1": ["x", "y"]}, **parts)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("num_tasks", [3, 8])
def test_storage_is_smaller_than_separate_adapters(tmp_path, peft_layout, num_tasks):
    folder = save_compact(tmp_path / "out", task_folders=True, **make_parts(peft_layout, num_tasks))
    report = storage_report(folder)
    assert report["tasks"] == num_tasks and report["ratio"] < 1
    assert report["compact_bytes"] == sum(report["files"].values())
    for t, size in report["per_task_bytes"].items():  # exact: what the per-task folders hold
        assert size == sum(p.stat().st_size for p in (folder / t).iterdir())
    assert report["separate_bytes"] == sum(report["per_task_bytes"].values())


def test_init_regenerates_from_its_seed_and_a_16_bit_vector_reloads_as_stored(tmp_path, peft_layout, tiny_bert_dir):
    """init_seed: θ_p is left out and rebuilt on reload from the seed (bit for bit: its SHA-256 is checked); a
    float16 τ reloads exactly as stored, θ_p + λ_t·(m_t ⊙ τ) with τ widened to float32; a seed that does not
    rebuild θ_p keeps it stored, saying why; a record that no longer matches is refused naming tasks.json."""
    parts = make_parts(peft_layout, 3)
    parts.update(base_model_id=tiny_bert_dir, unified=parts["unified"].apply(lambda v: v.half()))
    folder = save_compact(tmp_path / "out", init_seed=0, task_folders=True, **parts)
    assert not (folder / "init.safetensors").exists()
    record = json.loads((folder / "tasks.json").read_text())["init"]
    assert record == {"seed": 0, "shared_head": 0, "dtype": "float32", "sha256": compact.init_digest(parts["init"])}
    assert storage_report(folder)["init"] == "regenerated from seed 0"
    for t in parts["masks"]:
        state = task_state(folder, t)
        for k, v in parts["init"].items():
            expected = v + parts["unified"][k].float() * parts["masks"][t][k] * parts["rescalers"][t]
            assert state[k].dtype == torch.float32 and torch.equal(state[k], expected), (t, k)
        with safetensors.safe_open(folder / t / "adapter_model.safetensors", "pt") as f:  # the stock folder too
            assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)
    model = load_task_adapter(folder, "task1", base_model=tiny_bert_dir)
    saved = get_peft_model_state_dict(model)
    assert all(torch.equal(saved[k], v) for k, v in task_state(folder, "task1").items())

    stored = save_compact(tmp_path / "seed1", init_seed=1, **parts)  # seed 1 builds another A: θ_p is stored
    assert (stored / "init.safetensors").exists()
    assert "does not regenerate" in storage_report(stored)["init_stored_because"]
    assert all(torch.equal(task_state(stored, "task0")[k], task_state(folder, "task0")[k]) for k in parts["init"])

    info = json.loads((folder / "tasks.json").read_text())
    info["init"]["seed"] = 1
    (folder / "tasks.json").write_text(json.dumps(info))
    with pytest.raises(TaskVectorError, match=r"tasks.json: θ_p regenerated from seed 1 .* SHA-256"):
        task_state(folder, "task0")


def test_eight_minilm_tasks_take_under_0_15_of_separate_adapters(tmp_path):
    """At the main job's sizes (MiniLM, LoRA r=8 on query/value, 6-label heads), 8 tasks with θ_p regenerated and
    a float16 τ: at most 0.15 of 8 stock adapters ((2 + T/8) / 4T bytes an entry, 0.094, plus the heads)."""
    from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL
    from hf_fedtask.model.host import PeftHost
    from hf_fedtask.model.peft_methods import make_peft_config

    host = PeftHost(resolve_base_model(DEFAULT_BASE_MODEL), make_peft_config("lora", r=8), seed=0)
    init = host.initial_shared()
    g = torch.Generator().manual_seed(0)
    tasks = [f"task{i}" for i in range(8)]
    unified = init.apply(lambda v: (torch.randn(v.shape, generator=g) * 1e-2).half())
    masks = {t: init.apply(lambda v: torch.rand(v.shape, generator=g) < 0.7) for t in tasks}
    folder = save_compact(
        tmp_path / "out", peft_config=host.peft_config, base_model_id=DEFAULT_BASE_MODEL, init=init, unified=unified,
        masks=masks, rescalers={t: 1.0 + i / 8 for i, t in enumerate(tasks)},
        heads={t: host.initial_head(6, seed=i) for i, t in enumerate(tasks)}, init_seed=0)
    report = storage_report(folder)
    assert report["tasks"] == 8 and report["init"] == "regenerated from seed 0" and "init.safetensors" not in report[
        "files"]
    assert report["ratio"] <= 0.15, report
    state = task_state(folder, "task3")  # θ_p rebuilt from MiniLM and seed 0
    assert all(torch.equal(state[k], v + unified[k].float() * masks["task3"][k] * 1.375) for k, v in init.items())
