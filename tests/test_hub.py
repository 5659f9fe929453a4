"""Model cards and publishing, against the loopback Hub stand-in (no network)."""

import hashlib
import json
import math
import socket
from pathlib import Path

import httpx2
import huggingface_hub.constants
import pytest
import tomllib
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, get_peft_model_state_dict
from test_save_adapter import tiny_peft_model

from hf_fedtask.cli import main
from hf_fedtask.errors import HubError
from hf_fedtask.export.adapter import save_adapter
from hf_fedtask.export.hub import push_to_hub, render_model_card

INFO = {
    "base_model": "me/tiny-bert",
    "task": ["sst2", "agnews"],
    "label_names": ["negative", "neutral", "positive"],
    "repo_id": "me/fed-tiny",
    "strategy": "fedprox",
    "strategy_paper": "Li et al. 2020, https://arxiv.org/abs/1812.06127",
    "peft_method": "lora",
    "metrics": {"sst2": {"accuracy": 0.8125, "f1": 0.7931}, "agnews": {"accuracy": 0.6406}},
    "hyperparameters": {"lr": 5e-4, "r": 4, "mu": 0.01},
    "rounds": 5,
    "num_clients": 4,
    "participation": 0.5,
    "bytes_communicated": 1234567,
    "license": "apache-2.0",
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """An exported tiny LoRA adapter folder with a rendered card."""
    tmp = tmp_path_factory.mktemp("export")
    model = tiny_peft_model(tmp / "base", LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]))
    return save_adapter(tmp / "adapter", peft_config=model.peft_config["default"],
                        state_dict=get_peft_model_state_dict(model), base_model_id="me/tiny-bert",
                        card=render_model_card(INFO))


@pytest.fixture(scope="module")
def big_adapter_dir(tmp_path_factory):
    """A LoRA adapter folder shaped like one for a BERT-large classifier (24 layers, hidden 1024,
    r=32 on query and value, classifier head saved), built from random tensors: its
    adapter_model.safetensors is ~12.6 MB, above the Hub's 10 MB limit for regular uploads."""
    hidden, layers, r = 1024, 24, 32
    generator = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        for module in ("query", "value"):
            prefix = f"base_model.model.bert.encoder.layer.{i}.attention.self.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(r, hidden, generator=generator)
            state[f"{prefix}.lora_B.weight"] = torch.randn(hidden, r, generator=generator)
    state["base_model.model.classifier.weight"] = torch.randn(3, hidden, generator=generator)
    state["base_model.model.classifier.bias"] = torch.zeros(3)
    config = LoraConfig(task_type="SEQ_CLS", r=r, target_modules=["query", "value"])
    folder = save_adapter(tmp_path_factory.mktemp("big") / "adapter", peft_config=config, state_dict=state,
                          base_model_id="me/bert-large",
                          card=render_model_card({**INFO, "base_model": "me/bert-large"}))
    assert (folder / "adapter_model.safetensors").stat().st_size > 10 * 2**20
    return folder


def _assert_lfs_push(store, repo_id, folder, *, parts):
    """The weights went through LFS (batch call, storage PUT(s) of exactly their bytes, verify,
    an lfsFile commit line) and the small files inline; the repo holds every file byte-identical."""
    weights = (folder / "adapter_model.safetensors").read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    small = {name: (folder / name).read_bytes() for name in ("README.md", "adapter_config.json")}
    assert {path: mode for (repo, path), mode in store.upload_modes.items() if repo == repo_id} == {
        "adapter_model.safetensors": "lfs", "README.md": "regular", "adapter_config.json": "regular"}

    batches = [b for b in store.lfs_batches if b["repo"] == repo_id]
    assert len(batches) == 1
    assert batches[0]["operation"] == "upload" and batches[0]["hash_algo"] == "sha256"
    assert batches[0]["objects"] == [{"oid": oid, "size": len(weights)}]  # only the weights, never README/config
    assert batches[0]["ref"] == {"name": "main"}

    puts = [(part, size) for put_oid, part, size in store.storage_puts if put_oid == oid]
    if parts is None:
        assert puts == [(None, len(weights))]
    else:
        chunk = store.multipart_chunk_size
        assert puts == [(n + 1, min(chunk, len(weights) - n * chunk)) for n in range(parts)]
    assert store.lfs_objects[oid] == weights
    assert store.lfs_verifies == [oid]

    commit = [c for c in store.commits if c.repo == repo_id][-1]
    assert commit.lfs == {"adapter_model.safetensors": oid}
    assert commit.regular == small
    assert store.repos[repo_id] == {"adapter_model.safetensors": weights, **small}


def test_card_metadata_and_body():
    card = ModelCard(str(render_model_card(INFO)))
    assert card.data.base_model == "me/tiny-bert"
    assert card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-classification"
    assert card.data.license == "apache-2.0"
    assert {"hf-fedtask", "federated-learning", "peft", "fedprox", "lora"} <= set(card.data.tags)
    assert card.data.datasets == ["sst2", "agnews"]
    assert {(r.dataset_name, r.metric_type, r.metric_value) for r in card.data.eval_results} == {
        ("sst2", "accuracy", 0.8125), ("sst2", "f1", 0.7931), ("agnews", "accuracy", 0.6406)}
    for text in ("| sst2 | 0.8125 | 0.7931 |", "| agnews | 0.6406 | – |", "num_labels=3,",
                 "id2label={0: 'negative', 1: 'neutral', 2: 'positive'}",
                 'PeftModel.from_pretrained(base, "me/fed-tiny")', "| Rounds | 5 |", "| Clients | 4 |",
                 "50% of clients per round", "1,234,567", "| mu | 0.01 |", "arxiv.org/abs/1812.06127"):
        assert text in card.text, text


def test_minimal_card_renders_without_none_noise():
    card = render_model_card({"base_model": "me/tiny-bert", "task": "sst2", "num_labels": 2})
    assert "None" not in str(card)
    assert "num_labels=2," in card.text and "id2label" not in card.text
    assert "## Evaluation" not in card.text and "## Federation" not in card.text
    assert "## Hyperparameters" not in card.text and "## Citation" not in card.text

    nones = {key: None for key in ("label_names", "strategy", "strategy_paper", "peft_method", "rounds",
                                   "participation", "bytes_communicated", "license", "extra_notes")}
    card = render_model_card({"base_model": "me/tiny-bert", "task": "sst2", "num_labels": 2, **nones,
                              "metrics": {"sst2": {"accuracy": 0.5, "f1": None}},
                              "hyperparameters": {"lr": 0.001, "local_steps": None}})
    assert "None" not in str(card)
    assert "| sst2 | 0.5 |" in card.text and "| lr | 0.001 |" in card.text and "local_steps" not in card.text
    assert ModelCard(str(card)).data.tags == ["hf-fedtask", "federated-learning", "peft", "text-classification"]


@pytest.mark.parametrize("info, match", [
    ({"task": "sst2", "num_labels": 2}, "base_model"),
    ({"base_model": "me/b", "task": "sst2"}, "num_labels"),
    ({"base_model": "me/b", "task": "sst2", "num_labels": 2, "label_names": ["a"]}, "num_labels=2"),
    ({"base_model": "/local/base", "task": "sst2", "num_labels": 2}, "local path"),
    ({"base_model": "me/b", "task": "sst2", "num_labels": 2, "metric": {}}, "unknown"),
])
def test_bad_card_info_is_rejected(info, match):
    with pytest.raises(ValueError, match=match):
        render_model_card(info)


def test_push_uploads_every_file_byte_identical(hub_stub, adapter_dir):
    endpoint, store = hub_stub
    url = push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint=endpoint)
    assert url.startswith(f"{endpoint}/me/fed-tiny/commit/")
    assert store.repos["me/fed-tiny"] == {p.name: p.read_bytes() for p in adapter_dir.iterdir()}
    assert len(store.repos["me/fed-tiny"]) == 3
    assert store.private == {"me/fed-tiny": False}
    # a *.safetensors file goes through LFS whatever its size, as on the Hub
    assert set(store.commits[-1].lfs) == {"adapter_model.safetensors"}
    assert set(store.commits[-1].regular) == {"README.md", "adapter_config.json"}

    push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint=endpoint)  # existing repo is fine
    assert (len(store.commits) == 2
            and store.repos["me/fed-tiny"] == {p.name: p.read_bytes() for p in adapter_dir.iterdir()})


def test_push_of_a_large_adapter_goes_through_lfs(hub_stub, big_adapter_dir):
    endpoint, store = hub_stub
    url = push_to_hub(big_adapter_dir, "me/fed-big", token="hf_test", endpoint=endpoint)
    assert url.startswith(f"{endpoint}/me/fed-big/commit/")
    _assert_lfs_push(store, "me/fed-big", big_adapter_dir, parts=None)
    assert store.private == {"me/fed-big": False}

    # pushing again: the batch API says the object is already stored, so nothing is PUT again,
    # and the new commit still points at it
    puts = len(store.storage_puts)
    push_to_hub(big_adapter_dir, "me/fed-big", token="hf_test", endpoint=endpoint)
    assert len(store.lfs_batches) == 2 and len(store.storage_puts) == puts
    assert store.commits[-1].lfs == store.commits[0].lfs
    assert store.private == {"me/fed-big": False}  # an existing repo keeps its visibility


@pytest.mark.parametrize("private", [True, False])
def test_cli_push_multipart_lfs_and_private_flag(hub_stub, big_adapter_dir, capsys, private):
    """`hf-fedtask push [--private]`: the flag reaches create_repo, and the weights travel through
    the HF multipart LFS transfer when the server asks for it (chunks of 4 MiB here)."""
    endpoint, store = hub_stub
    store.multipart_chunk_size = 4 * 2**20
    argv = ["push", str(big_adapter_dir), "--repo-id", "me/cli-big", "--endpoint", endpoint, "--token", "hf_x"]
    assert main(argv + ["--private"] * private) == 0
    assert capsys.readouterr().out.strip().startswith(f"{endpoint}/me/cli-big/commit/")
    assert store.private == {"me/cli-big": private}
    assert [p.get("visibility") for p in store.create_payloads] == ["private" if private else "public"]
    size = (big_adapter_dir / "adapter_model.safetensors").stat().st_size
    _assert_lfs_push(store, "me/cli-big", big_adapter_dir, parts=math.ceil(size / store.multipart_chunk_size))


def test_refused_lfs_upload_is_one_line_hub_error(hub_stub, adapter_dir):
    endpoint, store = hub_stub
    store.storage_fail_status = 403  # e.g. an expired upload URL; 403 is not retried
    with pytest.raises(HubError) as err:
        push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint=endpoint)
    message = str(err.value)
    assert "\n" not in message and "'me/fed-tiny'" in message and "403" in message
    assert store.commits == [] and store.repos == {"me/fed-tiny": {}}


def test_stand_in_refuses_what_the_hub_refuses(hub_stub):
    """The stand-in is strict where the Hub is: bytes that do not hash to the announced oid are not
    stored, a commit cannot point at an object never uploaded nor inline a file preupload sent to LFS."""
    endpoint, store = hub_stub
    with httpx2.Client(base_url=endpoint) as client:
        assert client.post("/api/repos/create", json={"name": "r", "organization": "me"}).status_code == 200
        data = b"weights" * 1000
        oid = hashlib.sha256(data).hexdigest()
        batch = client.post("/me/r.git/info/lfs/objects/batch", json={
            "operation": "upload", "transfers": ["basic"], "objects": [{"oid": oid, "size": len(data)}],
            "hash_algo": "sha256"}).json()
        href = batch["objects"][0]["actions"]["upload"]["href"]
        assert href.startswith(endpoint)
        assert client.put(href, content=data[:-1] + b"X").status_code == 400
        assert oid not in store.lfs_objects
        verify = batch["objects"][0]["actions"]["verify"]["href"]
        assert client.post(verify, json={"oid": oid, "size": len(data)}).status_code == 404

        def commit(line):
            header = {"key": "header", "value": {"summary": "s", "description": ""}}
            return client.post("/api/models/me/r/commit/main", content="\n".join(map(json.dumps, [header, line])))

        assert commit({"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": oid,
                                                   "size": len(data)}}).status_code == 400
        modes = client.post("/api/models/me/r/preupload/main", json={"files": [
            {"path": "w.safetensors", "sample": "", "size": len(data)}]}).json()
        assert modes["files"][0]["uploadMode"] == "lfs"
        assert commit({"key": "file", "value": {"path": "w.safetensors", "content": "AA==",
                                                "encoding": "base64"}}).status_code == 400
        assert client.put(href, content=data).status_code == 200
        assert client.post(verify, json={"oid": oid, "size": len(data)}).status_code == 200
        assert commit({"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": oid,
                                                   "size": len(data)}}).status_code == 200
        assert store.repos["me/r"] == {"w.safetensors": data}


def test_endpoint_from_hf_endpoint_env(hub_stub, adapter_dir, monkeypatch):
    endpoint, store = hub_stub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    push_to_hub(adapter_dir, "me/env-repo", token="hf_test")
    assert set(store.repos["me/env-repo"]) == {p.name for p in adapter_dir.iterdir()}


def test_connection_refused_is_one_line_hub_error(hub_stub, adapter_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(HubError) as err:
        push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint=closed)
    message = str(err.value)
    assert "\n" not in message and "'me/fed-tiny'" in message and closed in message and "ConnectError" in message


@pytest.mark.parametrize("status", [401, 500])
def test_server_error_is_one_line_hub_error(hub_stub, adapter_dir, status):
    endpoint, store = hub_stub
    store.fail_status = status
    with pytest.raises(HubError) as err:
        push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint=endpoint)
    message = str(err.value)
    assert "\n" not in message and "'me/fed-tiny'" in message and str(status) in message
    assert store.repos == {}


def test_offline_mode_is_hub_error(adapter_dir, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="OfflineModeIsEnabled"):
        push_to_hub(adapter_dir, "me/fed-tiny", token="hf_test", endpoint="http://127.0.0.1:9")


@pytest.mark.parametrize("breakage", ["no_weights", "no_config", "local_base", "no_base"])
def test_non_adapter_folder_fails_before_any_request(hub_stub, adapter_dir, tmp_path, breakage):
    endpoint, store = hub_stub
    folder = tmp_path / "copy"
    folder.mkdir()
    for path in adapter_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    if breakage == "no_weights":
        (folder / "adapter_model.safetensors").unlink()
    elif breakage == "no_config":
        (folder / "adapter_config.json").unlink()
    else:
        config = folder / "adapter_config.json"
        base = f'"{tmp_path}"' if breakage == "local_base" else "null"
        config.write_text(config.read_text().replace('"me/tiny-bert"', base))
    with pytest.raises(HubError):
        push_to_hub(folder, "me/fed-tiny", token="hf_test", endpoint=endpoint)
    assert store.requests == []


def test_templates_are_packaged_with_every_subpackage():
    """pyproject lists packages by hand (to map model_cards/ to hf_fedtask.model_cards): every
    hf_fedtask subpackage must be listed, and the card template must ship as package data."""
    root = Path(__file__).resolve().parents[1]
    setuptools_cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "hf_fedtask").rglob("__init__.py")}
    assert found | {"hf_fedtask.model_cards"} == set(setuptools_cfg["packages"])
    assert setuptools_cfg["package-dir"]["hf_fedtask.model_cards"] == "model_cards"
    assert "*.j2" in setuptools_cfg["package-data"]["hf_fedtask.model_cards"]
    assert (root / "model_cards" / "adapter_card.md.j2").is_file()
