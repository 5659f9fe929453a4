"""Small networks for 28×28 images (Fashion-MNIST, MNIST), as `transformers` models: the paper-scale
networks of TCT's and F²L²'s image experiments, trained in full (`peft_method: full`) or with LoRA
on their linear layers, by the same loop, exporters and PEFT loading as any Hub classifier.

`hf-fedtask/small-cnn` (TCT's CNN) and `hf-fedtask/small-mlp` (F²L²'s MLP, 784-100-50-10 on the
grayscale pixels) are registered model builders, not Hub repositories: `materialize` writes the
seeded init, config and image processor into the cache once, and `resolve_base_model` loads it
from there. Loading an exported adapter of it needs `import hf_fedtask` (which registers the
architecture with transformers' Auto classes), as any custom architecture does.

    CNN: conv 5×5 (3→c₁) · ReLU · maxpool 2 → conv 5×5 (c₁→c₂) · ReLU · maxpool 2 → fc (c₂·7·7→h)
         · ReLU → classifier (h→labels)
    MLP (`conv_channels` empty): the first channel's pixels → fc (784→m₁) · ReLU → ... → fc (→h) · ReLU
         → classifier (h→labels), with `mlp_hidden` = (m₁, ...)

Images arrive as 3-channel `pixel_values` (grayscale replicated, as for every image model here).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput

from hf_fedtask.core.files import built_once

SMALL_CNN = "hf-fedtask/small-cnn"
SMALL_MLP = "hf-fedtask/small-mlp"
MODEL_TYPE = "hf_fedtask_small_cnn"
# Fashion-MNIST's pixel mean and std (train split); images are normalized with them
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
BUILDER_VERSION = "v1"


class SmallCNNConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, num_channels: int = 3, image_size: int = 28, conv_channels: tuple[int, ...] = (32, 64),
                 hidden_size: int = 128, initializer_range: float = 0.02, mlp_hidden: tuple[int, ...] = (), **kwargs):
        self.num_channels = num_channels
        self.image_size = image_size
        self.conv_channels = list(conv_channels)
        self.mlp_hidden = list(mlp_hidden)
        self.hidden_size = hidden_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


class SmallCNNModel(nn.Module):
    """The trunk: two conv blocks and a hidden fully connected layer, or (no conv channels) an MLP."""

    def __init__(self, config: SmallCNNConfig):
        super().__init__()
        self.is_mlp = not config.conv_channels
        if self.is_mlp:  # grayscale images arrive replicated on 3 channels: the first one is the image
            sizes = [config.image_size ** 2, *config.mlp_hidden]
            self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
            self.fc = nn.Linear(sizes[-1], config.hidden_size)
            return
        c1, c2 = config.conv_channels
        self.conv1 = nn.Conv2d(config.num_channels, c1, 5, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
        self.fc = nn.Linear(c2 * (config.image_size // 4) ** 2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.is_mlp:
            x = pixel_values[:, 0].flatten(1)
            for layer in self.hidden:
                x = torch.relu(layer(x))
            return torch.relu(self.fc(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv1(pixel_values)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return torch.relu(self.fc(x.flatten(1)))


class SmallCNNForImageClassification(PreTrainedModel):
    config_class = SmallCNNConfig
    base_model_prefix = "cnn"
    main_input_name = "pixel_values"

    def __init__(self, config: SmallCNNConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.cnn = SmallCNNModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_uniform_(module.weight, a=5 ** 0.5)  # torch's own default init
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs) -> ImageClassifierOutput:
        logits = self.classifier(self.cnn(pixel_values))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


AutoConfig.register(MODEL_TYPE, SmallCNNConfig, exist_ok=True)
AutoModelForImageClassification.register(SmallCNNConfig, SmallCNNForImageClassification, exist_ok=True)

PROCESSOR = {
    "image_processor_type": "ViTImageProcessor",
    "do_resize": True,
    "size": {"height": 28, "width": 28},
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [PIXEL_MEAN] * 3,
    "image_std": [PIXEL_STD] * 3,
}


ARCHITECTURES = {SMALL_CNN: ("small-cnn", {}),
                 SMALL_MLP: ("small-mlp", {"conv_channels": (), "mlp_hidden": (100,), "hidden_size": 50})}
"""Builder name -> (cache folder stem, config fields)."""


def materialize(cache_root: Path, seed: int = 0, name: str = SMALL_CNN) -> Path:
    """The folder of `name` (`hf-fedtask/small-cnn` or `-mlp`: config, seeded weights, image
    processor) under `cache_root`, written once (`built_once`)."""
    stem, fields = ARCHITECTURES[name]

    def build(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            torch.manual_seed(seed)
            model = SmallCNNForImageClassification(SmallCNNConfig(num_labels=10, **fields))
        model.save_pretrained(tmp)
        (tmp / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=1))

    return built_once(cache_root / "models" / f"{stem}-{BUILDER_VERSION}-seed{seed}", build)


def weights_digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
