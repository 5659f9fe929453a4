"""`hf-fedtask merge`: outputs equal peft's add_weighted_adapter / our operators, reload with stock
PEFT, unify writes a loadable compact export, and bad inputs fail in one line writing nothing."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from hf_fedtask import merge
from hf_fedtask.cli import main
from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata
from hf_fedtask.export.compact import load_task_adapter, storage_report, task_state
from hf_fedtask.model.backbone import load_classifier, resolve_base_model

BATCH = {"input_ids": torch.randint(1, 1000, (4, 8), generator=torch.Generator().manual_seed(1)),
         "attention_mask": torch.ones(4, 8, dtype=torch.long)}
WEIGHTS = "adapter_model.safetensors"
METADATA = "hf_fedtask.json"  # what the merge was made from (hf_fedtask.export.adapter.METADATA_FILE)


def base_model(tiny_bert_dir, num_labels=3):
    """The tiny BERT classifier; its head (not in the checkpoint) is seeded, so headless adapters compare."""
    torch.manual_seed(1)
    return load_classifier(resolve_base_model(tiny_bert_dir), num_labels)


def make_adapters(tiny_bert_dir, out, *, head=True, labels=(3, 3, 3), r=4):
    """An untrained adapter `init` and one trained-looking adapter per entry of `labels`, all from the
    same seeded LoRA init (lora_alpha = r, so peft's merge scaling is 1 like the inputs')."""
    kwargs = {"task_type": "SEQ_CLS"} if head else {}
    folders = []
    for i, num_labels in enumerate([labels[0], *labels]):
        torch.manual_seed(0)
        model = get_peft_model(base_model(tiny_bert_dir, num_labels),
                               LoraConfig(r=r, lora_alpha=r, target_modules=["query", "value"], **kwargs))
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.1 * torch.randn(p.shape, generator=g))
        folder = out / ("init" if i == 0 else f"task{i - 1}")
        model.save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1:]


def run(argv, capsys):
    """Exit code, stdout and stderr of `hf-fedtask merge ARGV`."""
    capsys.readouterr()  # drop what building the adapters printed
    code = main(["merge", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("method, peft_kwargs", [("task_arithmetic", {"combination_type": "linear"}),
                                                 ("ties", {"combination_type": "ties", "density": 0.5})])
def test_raw_merge_equals_peft_add_weighted_adapter(tmp_path, tiny_bert_dir, capsys, method, peft_kwargs):
    _, adapters = make_adapters(tiny_bert_dir, tmp_path, head=False)
    out = tmp_path / "merged"
    # peft weighs A and B by sqrt(w·s), s = 1 here: our weights 1, 2, 0.5 are its 1, 4, 0.25
    extra = ["--density", "0.5"] if method == "ties" else []
    code, stdout, _ = run(["--method", method, "--weights", "1,2,0.5", *extra, *adapters, "-o", out], capsys)
    assert code == 0 and str(out) in stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", WEIGHTS, METADATA]
    assert (out / "adapter_config.json").read_bytes() == (adapters[0] / "adapter_config.json").read_bytes()

    peft_model = PeftModel.from_pretrained(base_model(tiny_bert_dir), adapters[0], adapter_name="task0")
    for a in adapters[1:]:
        peft_model.load_adapter(a, adapter_name=a.name)
    peft_model.add_weighted_adapter([a.name for a in adapters], [1.0, 4.0, 0.25], "merged", **peft_kwargs)
    expected = get_peft_model_state_dict(peft_model, adapter_name="merged")
    got = load_file(out / WEIGHTS)
    assert set(got) == set(expected)
    for k in got:
        torch.testing.assert_close(got[k], expected[k])

    peft_model.set_adapter("merged")
    reloaded = PeftModel.from_pretrained(base_model(tiny_bert_dir), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**BATCH).logits, peft_model.eval()(**BATCH).logits)


def loaded(folder):
    return TaskVector(load_file(folder / WEIGHTS))


@pytest.mark.parametrize("method, argv, operator", [
    ("task_arithmetic", [], lambda vs, w: merge.task_arithmetic(vs, w)),
    ("ties", ["--density", "0.3", "--majority-sign", "frequency", "--scope", "model"],
     lambda vs, w: merge.ties(vs, w, 0.3, "frequency", "model")),
    ("dare", ["--density", "0.6", "--seed", "3"], lambda vs, w: merge.dare_linear(vs, w, 0.6, seed=3)),
    ("dare", ["--density", "0.6", "--seed", "3", "--dare-variant", "ties"],
     lambda vs, w: merge.dare_ties(vs, w, 0.6, 3)),
])
def test_merge_from_base_adapter_equals_our_operators(tmp_path, tiny_bert_dir, capsys, method, argv, operator):
    init, adapters = make_adapters(tiny_bert_dir, tmp_path)
    out = tmp_path / "merged"
    code, _, err = run(["--method", method, "--weights", "1.5,1,0.5", *argv, "--base-adapter", init, *adapters,
                        "-o", out], capsys)
    assert code == 0, err
    theta = loaded(init)
    expected = theta + operator([loaded(a) - theta for a in adapters], [1.5, 1.0, 0.5])
    got = load_file(out / WEIGHTS)
    assert set(got) == set(expected) and any(".classifier." in k for k in got)  # heads merged like the rest
    assert all(torch.equal(got[k], expected[k]) for k in got)
    card = (out / "README.md").read_text()
    assert f"({method})" in card and "task0" in card and "`init` (`--base-adapter`)" in card

    reloaded = PeftModel.from_pretrained(base_model(tiny_bert_dir), out).eval()
    assert torch.equal(get_peft_model_state_dict(reloaded)[next(iter(got))], got[next(iter(got))])


def test_task_vector_files_merge_like_their_adapters(tmp_path, tiny_bert_dir, capsys):
    init, adapters = make_adapters(tiny_bert_dir, tmp_path)
    config = json.loads((init / "adapter_config.json").read_text())
    theta = loaded(init)
    files = []
    for a in adapters:
        meta = make_metadata(base_model=config["base_model_name_or_path"], base_model_revision="local",
                             peft_config_hash=peft_config_hash(config), kind="delta", task_ids=[a.name])
        (loaded(a) - theta).save(tmp_path / f"{a.name}.safetensors", meta)
        files.append(tmp_path / f"{a.name}.safetensors")
    assert run(["--method", "ties", "--base-adapter", init, *adapters, "-o", tmp_path / "a"], capsys)[0] == 0
    assert run(["--method", "ties", "--base-adapter", init, *files, "-o", tmp_path / "b"], capsys)[0] == 0
    a, b = load_file(tmp_path / "a" / WEIGHTS), load_file(tmp_path / "b" / WEIGHTS)
    assert all(torch.equal(a[k], b[k]) for k in a)

    code, _, err = run(["--method", "ties", *files, "-o", tmp_path / "c"], capsys)
    assert code == 2 and "task0.safetensors" in err and "--base-adapter" in err and not (tmp_path / "c").exists()


def test_unify_writes_a_compact_export_and_per_input_adapters(tmp_path, tiny_bert_dir, capsys):
    init, adapters = make_adapters(tiny_bert_dir, tmp_path, labels=(2, 3, 4))  # heads of different sizes
    out = tmp_path / "unified"
    code, stdout, err = run(["--method", "unify", "--base-adapter", init, *adapters, "-o", out], capsys)
    assert code == 0, err
    assert "separate adapters (ratio" in stdout

    theta = loaded(init)
    shared = theta.filter(lambda k: ".classifier." not in k)
    unified = merge.unify([loaded(a).filter(shared.__contains__) - shared for a in adapters])
    for t, a in enumerate(adapters):
        state = task_state(out, a.name)
        reconstructed = shared + unified.task_vector(t)
        assert all(torch.equal(state[k], reconstructed[k]) for k in shared)
        assert all(torch.equal(state[k], v) for k, v in loaded(a).items() if ".classifier." in k)

        stock = PeftModel.from_pretrained(base_model(tiny_bert_dir, 2 + t), out / a.name).eval()
        ours = load_task_adapter(out, a.name, base_model=tiny_bert_dir)
        with torch.no_grad():
            assert torch.equal(ours(**BATCH).logits, stock(**BATCH).logits)
    assert storage_report(out)["ratio"] < 1


def test_bad_inputs_exit_2_naming_the_file_and_write_nothing(tmp_path, tiny_bert_dir, capsys):
    init, adapters = make_adapters(tiny_bert_dir, tmp_path / "ok", labels=(3, 3, 2))
    _, other_rank = make_adapters(tiny_bert_dir, tmp_path / "r8", labels=(3,), r=8)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((init / "adapter_config.json").read_bytes())
    (corrupt / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    out = tmp_path / "out"
    cases = [
        ([*adapters[:2], other_rank[0]], "ties", "r8/task0", "PEFT config differs"),
        (adapters, "ties", "task2", "heads of different sizes"),
        ([adapters[0], corrupt], "task_arithmetic", "corrupt/adapter_model.safetensors", "cannot read"),
        ([adapters[0], tmp_path / "missing"], "task_arithmetic", "missing", "no such adapter folder"),
    ]
    for inputs, method, name, reason in cases:
        code, _, err = run(["--method", method, *inputs, "-o", out], capsys)
        assert code == 2 and name in err and reason in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "ok", "r8"]

    code, _, err = run(["--method", "ties", "--weights", "1,2", *adapters[:2], "--density", "1.5", "-o", out], capsys)
    assert code == 2 and "--density" in err
    code, _, err = run(["--method", "unify", "--weights", "1,2", *adapters[:2], "-o", out], capsys)
    assert code == 2 and "--weights" in err
    code, _, err = run(["--method", "unify", "--head-from", "task0", *adapters[:2], "-o", out], capsys)
    assert code == 2 and "--head-from does not apply to --method unify" in err and not out.exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(["--method", "task_arithmetic", *adapters[:2], "-o", out], capsys)
    assert code == 2 and "--overwrite" in err and [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run(["--method", "task_arithmetic", *adapters[:2], "-o", out, "--overwrite"], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", WEIGHTS, METADATA]


def labelled_adapters(tiny_bert_dir, out, label_sets):
    """`make_adapters` whose folders carry what a run's export carries: the tokenizer, `classifier/config.json`
    with the label names, and `hf_fedtask.json` naming the task (task0, task1, ...)."""
    from transformers import AutoConfig, AutoTokenizer

    from hf_fedtask.export.adapter import classifier_config_for, write_metadata

    init, adapters = make_adapters(tiny_bert_dir, out, labels=[len(n) for n in label_sets])
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    for folder, names in zip(adapters, label_sets):
        classifier_config_for(AutoConfig.from_pretrained(tiny_bert_dir), list(names), tiny_bert_dir).save_pretrained(
            folder / "classifier")
        tokenizer.save_pretrained(folder)
        write_metadata(folder, {"task": folder.name, "label_names": list(names), "modality": "text", "max_length": 16})
    return init, adapters


def readme_route(folder):
    """The README's loading route for an exported adapter: transformers' PEFT integration, label names from
    `classifier/config.json`, the folder's own tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(folder, subfolder="classifier")
    model = AutoModelForSequenceClassification.from_pretrained(folder, config=config).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def test_heads_of_unrelated_labels_are_refused_and_head_from_keeps_one(tmp_path, tiny_bert_dir, capsys):
    from peft import set_peft_model_state_dict
    from transformers import pipeline

    init, adapters = labelled_adapters(tiny_bert_dir, tmp_path, [("negative", "positive"), ("female", "male")])
    out = tmp_path / "merged"
    code, _, err = run(["--method", "ties", "--base-adapter", init, *adapters, "-o", out], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(s in err for s in ("task1", "[female, male]", "[negative, positive]", "--head-from", "--no-head"))
    assert not out.exists()

    code, _, err = run(["--method", "ties", "--base-adapter", init, *adapters, "--head-from", "task1", "-o", out],
                       capsys)
    assert code == 0, err
    theta = loaded(init)
    shared = theta.filter(lambda k: ".classifier." not in k)
    expected = shared + merge.ties([loaded(a).filter(shared.__contains__) - shared for a in adapters], [1, 1], 0.2)
    expected = {**expected, **{k: v for k, v in loaded(adapters[1]).items() if ".classifier." in k}}
    got = load_file(out / WEIGHTS)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    meta = json.loads((out / METADATA).read_text())
    assert meta["label_names"] == ["female", "male"] and meta["task"] == "task1"
    assert "kept from `task1`" in (out / "README.md").read_text()

    model, tokenizer = readme_route(out)  # loads as a run's export does, with the kept head's label names
    assert model.config.id2label == {0: "female", 1: "male"}
    reference = PeftModel.from_pretrained(base_model(tiny_bert_dir, 2), adapters[1]).eval()
    set_peft_model_state_dict(reference, expected)
    with torch.no_grad():
        torch.testing.assert_close(model(**BATCH).logits, reference(**BATCH).logits)
    answers = pipeline("text-classification", model=model, tokenizer=tokenizer)(["a day", "a night"])
    assert {a["label"] for a in answers} <= {"female", "male"}

    code, _, err = run(["--method", "ties", "--base-adapter", init, *adapters, "--no-head", "-o", tmp_path / "bare"],
                       capsys)
    assert code == 0, err
    assert not any(".classifier." in k for k in load_file(tmp_path / "bare" / WEIGHTS))
    assert not (tmp_path / "bare" / "classifier").exists() and (tmp_path / "bare" / "tokenizer.json").exists()
    code, _, err = run(["--method", "ties", *adapters, "--head-from", "task7", "-o", tmp_path / "x"], capsys)
    assert code == 2 and "task7" in err and not (tmp_path / "x").exists()


def test_heads_of_one_label_set_are_merged_and_the_output_loads_like_an_export(tmp_path, tiny_bert_dir, capsys):
    init, adapters = labelled_adapters(tiny_bert_dir, tmp_path, [("negative", "positive")] * 2)
    out = tmp_path / "merged"
    code, _, err = run(["--method", "task_arithmetic", "--weights", "0.5,0.5", "--base-adapter", init, *adapters,
                        "-o", out], capsys)
    assert code == 0, err
    theta = loaded(init)
    expected = theta + merge.task_arithmetic([loaded(a) - theta for a in adapters], [0.5, 0.5])
    got = load_file(out / WEIGHTS)
    assert any(".classifier." in k for k in got) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert json.loads((out / METADATA).read_text())["label_names"] == ["negative", "positive"]
    model, _ = readme_route(out)
    reference = PeftModel.from_pretrained(base_model(tiny_bert_dir, 2), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**BATCH).logits, reference(**BATCH).logits)
    assert model.config.id2label == {0: "negative", 1: "positive"}


def test_unify_keeps_each_inputs_label_names(tmp_path, tiny_bert_dir, capsys):
    init, adapters = labelled_adapters(tiny_bert_dir, tmp_path, [("negative", "positive"), ("red", "green", "blue")])
    out = tmp_path / "unified"
    code, _, err = run(["--method", "unify", "--base-adapter", init, *adapters, "-o", out], capsys)
    assert code == 0, err
    tasks = {t["name"]: t for t in json.loads((out / "tasks.json").read_text())["tasks"]}
    assert tasks["task0"]["label_names"] == ["negative", "positive"]
    assert tasks["task1"]["label_names"] == ["red", "green", "blue"]
    assert load_task_adapter(out, "task1", base_model=tiny_bert_dir).config.id2label == {0: "red", 1: "green",
                                                                                          2: "blue"}
    model, _ = readme_route(out / "task1")  # each input's folder loads like the input did
    assert model.config.id2label == {0: "red", 1: "green", 2: "blue"}

    bad = tmp_path / "bad"
    shutil.copytree(adapters[1], bad)
    config = json.loads((bad / "classifier" / "config.json").read_text())
    config["id2label"] = {"0": "red", "1": "green"}  # 2 names for a head of 3 outputs
    (bad / "classifier" / "config.json").write_text(json.dumps(config))
    code, _, err = run(["--method", "unify", "--base-adapter", init, adapters[0], bad, "-o", tmp_path / "u2"],
                       capsys)
    assert code == 2 and "bad" in err and "2 label names" in err and "3 outputs" in err
    assert not (tmp_path / "u2").exists()
