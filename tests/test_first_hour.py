"""What a new user trips on in the first hour (issue 52): a mistyped or uncached base model, the precision and
privacy a run does not say, library warnings that look like errors, the order of refusals, a refused run that
leaves folders behind. Fast unit checks; the CLI's refusals without torch are in tests/test_cli_startup.py."""

from __future__ import annotations

import warnings

import httpx
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.model.backbone import (
    DEFAULT_BASE_MODEL,
    BaseModelRef,
    base_config,
    check_base_model,
    resolve_base_model,
)


@pytest.mark.parametrize("name,says", [
    ("./no_such_folder", "--base-model ./no_such_folder: no such folder"),
    ("sentence-transformers/all-MiniLM-L6-v3",
     "--base-model sentence-transformers/all-MiniLM-L6-v3: not in the Hub cache and HF_HUB_OFFLINE=1 (offline); did "
     f"you mean {DEFAULT_BASE_MODEL}? the models available offline are: {DEFAULT_BASE_MODEL}, "),
    ("HuggingFaceTB/SmolLM2-135M", "did you mean HuggingFaceTB/SmolLM2-135M-Instruct?"),
])
def test_an_unloadable_base_model_is_one_line_naming_what_would_load(name, says, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        check_base_model(name, "--base-model")
    assert says in str(e.value) and "\n" not in str(e.value)
    if "offline" in says:
        assert str(e.value).endswith("hf-fedtask/tiny-llama; a local folder must exist")
    with pytest.raises(ConfigError, match="^base model "):  # every loader of a base model checks it the same way
        resolve_base_model(name)


def test_base_model_folders_and_the_hub_cache(tmp_path, tiny_bert_dir, monkeypatch):
    """A folder must hold config.json; a cached Hub id passes offline (huggingface_hub's own lookup); online, an
    id that is not cached is left to the download."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_base_model(tiny_bert_dir)
    with pytest.raises(ConfigError, match="the folder holds no config.json"):
        check_base_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file"):
        check_base_model(str(tmp_path / "weights.bin"))
    resolve_base_model(DEFAULT_BASE_MODEL)  # places the embedded MiniLM into the (test session's) Hub cache
    from hf_fedtask.model.hub_cache import cached_in_hub, cached_models

    assert cached_in_hub(DEFAULT_BASE_MODEL) and DEFAULT_BASE_MODEL in cached_models()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    check_base_model("someone/not-cached-yet")  # no network call: the download decides


def test_a_hub_id_the_hub_does_not_know_is_one_line_where_it_loads(monkeypatch):
    """Online, huggingface_hub's RepositoryNotFoundError (an OSError, as transformers rewraps it) becomes one
    ConfigError naming the id; the Hub is never called (AutoConfig is replaced)."""
    import transformers

    def not_found(*args, **kwargs):
        response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/x/y"))
        raise RepositoryNotFoundError("404 Client Error. Repository Not Found for url: ...\nmore lines",
                                      response=response)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", not_found)
    with pytest.raises(ConfigError) as e:
        base_config(BaseModelRef("x/y", "x/y", "main"))
    assert str(e.value) == "base model x/y: cannot be loaded (404 Client Error. Repository Not Found for url: ...)"


def test_bf16_on_a_cpu_says_whether_it_is_native_or_emulated(monkeypatch):
    from hf_fedtask.model.device import precision_in_words

    cpu = torch.device("cpu")
    assert precision_in_words("no", cpu) == "fp32"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    assert precision_in_words("bf16", cpu).endswith("; emulated on this CPU (no AVX512-BF16, AMX or Arm BF16 "
                                                    "instructions): slower than fp32")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": True})
    assert precision_in_words("bf16", cpu).endswith("; native on this CPU (avx512_bf16, amx_bf16)")


def test_the_end_of_a_run_gives_exact_match_and_privacy_spent_read_defensively():
    from hf_fedtask.engine.announce import end_lines

    results = {"mean_exact_match": 0.25, "tasks": {"a": {"exact_match": 0.5}, "b": {"exact_match": 0.0}},
               "privacy": {"epsilon": None, "delta": 1e-5, "rounds": 3, "noise_multiplier": 0.0, "clip": 1.0}}
    assert end_lines(results) == [
        "generation exact match: mean 0.2500 (a 0.5000, b 0.0000)",
        "privacy spent: epsilon = infinite (no noise) at delta = 1e-05 after 3 rounds (client-level; sigma = 0, "
        "clip C = 1)"]
    assert end_lines({"privacy": {"epsilon": 2.5}}) == ["privacy spent: epsilon = 2.5 (client-level)"]
    assert end_lines({"tasks": {}}) == []


def test_wrapping_a_model_in_peft_shows_no_deprecation_of_the_libraries(tiny_bert_dir):
    """peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model; the host does
    not pass that FutureWarning on to the user (it still fires outside `quiet_peft_wrap`)."""
    from peft import get_peft_model

    from hf_fedtask.model.backbone import load_classifier
    from hf_fedtask.model.host import PeftHost
    from hf_fedtask.model.peft_methods import make_peft_config

    ref = resolve_base_model(tiny_bert_dir, "tests/tiny-bert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeftHost(ref, make_peft_config("lora", r=2))
        quiet = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
        get_peft_model(load_classifier(ref, 2), make_peft_config("lora", r=2))
        loud = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert quiet == []
    if not loud:
        pytest.skip("this peft/transformers pair no longer warns: nothing to silence")


def test_tct_on_a_causal_lm_is_refused_for_the_model_before_its_rounds(tiny_tasks_dir, tmp_path):
    """TCT's rounds check used to come first, so a user fixed --rounds only to be told TCT does not run on a
    causal LM at all."""
    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.server import Server

    config = RunConfig(strategy="tct", suite=None, tasks=list(tiny_tasks_dir), base_model="hf-fedtask/tiny-llama",
                       rounds=1, max_length=64, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="^strategy 'tct' does not run on the causal LM hf-fedtask/tiny-llama"):
        Server(Environment(config)).check()


def test_a_run_folder_lock_removes_the_parents_it_made(tmp_path):
    """A refused run under a new nested --output-dir leaves none of the folders it made for its lock."""
    from hf_fedtask.core.files import folder_lock

    with pytest.raises(OutputDirError), folder_lock(tmp_path / "a" / "b" / "c"):
        raise OutputDirError("refused")
    assert list(tmp_path.iterdir()) == []


def test_the_stock_loading_example_shows_no_load_report(finished_fedavg, tiny_bert_dir, tmp_path):
    """examples/load_adapter.py loads an exported adapter with stock transformers: the base's head, which the
    adapter's own replaces, is not reported as MISSING in a LOAD REPORT that reads like an error."""
    import importlib.util
    import json
    import logging
    import shutil
    from pathlib import Path

    adapter = shutil.copytree(Path(finished_fedavg) / "adapters" / "colors", tmp_path / "colors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = tiny_bert_dir  # the tiny base is local, not on the Hub
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    spec = importlib.util.spec_from_file_location("load_adapter",
                                                  Path(__file__).parents[1] / "examples" / "load_adapter.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)  # every transformers logger propagates to it
    try:
        labels = example.main(str(adapter), ["red apple"])
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert labels[0] in {"red", "blue", "green"}
    assert not [r for r in records if "LOAD REPORT" in r.getMessage()]


def test_a_mistyped_config_key_names_the_closest_one():
    from hf_fedtask.config import RunConfig

    for key, close in (("roundz", "rounds"), ("kapa", "kappa")):
        with pytest.raises(ConfigError, match=rf"^run.yaml: unknown key '{key}' \(did you mean '{close}'\?\)$"):
            RunConfig.from_dict({key: 3}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"^run.yaml: unknown key 'zzz'$"):
        RunConfig.from_dict({"zzz": 3}, source="run.yaml")
