"""Houlsby bottleneck adapters as a PEFT method.

Hand-written because peft (0.21) has no bottleneck adapter. The structure mirrors peft's own tuners
(`peft/tuners/ia3`): a config (`BottleneckConfig`), a layer that wraps a target module
(`BottleneckLayer`) and the tuner that injects it (`BottleneckModel`). Importing this module
registers the method with peft under the name "bottleneck" (`peft_type` "BOTTLENECK", parameter
prefix "bottleneck_"), so `get_peft_model`, `save_pretrained`, stock `PeftModel.from_pretrained` /
`load_adapter` and `get_peft_model_state_dict` / `set_peft_model_state_dict` treat it like a built-in
method. `import hf_fedtask` arranges that import as soon as peft itself is imported.

Each adapted module's output h becomes h + up(act(down(h))), with down: d -> bottleneck_dim and
up: bottleneck_dim -> d (both with bias). Saved keys follow LoRA's adapter-name-free naming, e.g.
`base_model.model.bert.encoder.layer.0.output.bottleneck_down.weight`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from peft.config import PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import PeftType, register_peft_method
from torch import nn

__all__ = [
    "TRANSFORMERS_MODELS_TO_BOTTLENECK_TARGET_MODULES_MAPPING",
    "BottleneckConfig",
    "BottleneckLayer",
    "BottleneckModel",
]


def _add_peft_type(name: str) -> PeftType:
    """Add `name` to peft's `PeftType` enum. `register_peft_method` only accepts names that are
    members of that closed enum, so a method defined outside peft has to extend it first; the
    member's value equals its name, as for every built-in type, so that the "BOTTLENECK" string
    read back from adapter_config.json finds the registered config class."""
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member._sort_order_ = len(PeftType._member_names_)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    type.__setattr__(PeftType, name, member)  # EnumType.__setattr__ refuses new members
    return member


_add_peft_type("BOTTLENECK")

# Houlsby-style placement: one adapter per transformer block, after its feed-forward part.
# BERT-like: `layer.N.output` (BertOutput, the post-LayerNorm block output; not `attention.output`).
# ViT (transformers 5, ViTLayer has no `output` module): `layers.N.mlp`, the FFN output before the
# residual add. Wrapping a module inside the block (not the block itself) keeps the adapter's effect
# in the `hidden_states` that transformers records from the block's output.
_BERT_LIKE = r"(.*\.)?encoder\.layer\.\d+\.output"
TRANSFORMERS_MODELS_TO_BOTTLENECK_TARGET_MODULES_MAPPING = {
    "bert": _BERT_LIKE,
    "roberta": _BERT_LIKE,
    "xlm-roberta": _BERT_LIKE,
    "electra": _BERT_LIKE,
    "vit": r"(.*\.)?layers\.\d+\.mlp",
}

NON_LINEARITIES = {
    "relu": nn.functional.relu,
    "gelu": nn.functional.gelu,
    "tanh": torch.tanh,
    "silu": nn.functional.silu,
}


@dataclass
class BottleneckConfig(PeftConfig):
    """
    Configuration of a [`BottleneckModel`] (Houlsby et al., 2019, https://huggingface.co/papers/1902.00751).

    Args:
        bottleneck_dim (`int`):
            Width of the bottleneck: each adapter holds 2 * d * bottleneck_dim + bottleneck_dim + d parameters.
        non_linearity (`str`):
            Activation between the down and up projection: one of "relu", "gelu", "tanh", "silu".
        target_modules (`Optional[Union[List[str], str]]`):
            The modules whose output gets an adapter: a regex (full match) or a list of names matched exactly or as
            a suffix. `None` takes the per-architecture default from
            `TRANSFORMERS_MODELS_TO_BOTTLENECK_TARGET_MODULES_MAPPING`. Note that a list entry "output" also matches
            BERT's `attention.output`.
        exclude_modules (`Optional[Union[List[str], str]]`):
            Modules not to adapt, matched like `target_modules`.
        modules_to_save (`Optional[List[str]]`):
            Modules apart from the adapters that are trainable and saved, e.g. the classification head.
        init_weights (`bool`):
            Zero-initialize the up projection so that the adapter starts as the identity (default). `False` keeps
            both projections random, which is only useful for tests.
    """

    bottleneck_dim: int = field(default=8, metadata={"help": "Width of the adapter bottleneck."})
    non_linearity: str = field(
        default="relu", metadata={"help": f"Activation in the bottleneck, one of {', '.join(NON_LINEARITIES)}."}
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Module names or a regex of the modules whose output gets an adapter. If not specified, modules "
            "are chosen according to the model architecture."
        },
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or a regex of the modules not to adapt."}
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules apart from the adapters to be set as trainable and saved in the final checkpoint, e.g. "
            "the randomly initialized classifier of a sequence classification model."
        },
    )
    init_weights: bool = field(
        default=True, metadata={"help": "Zero-initialize the up projection so the adapter starts as the identity."}
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.BOTTLENECK
        if not isinstance(self.bottleneck_dim, int) or self.bottleneck_dim <= 0:
            raise ValueError(f"`bottleneck_dim` must be a positive integer, got {self.bottleneck_dim!r}")
        if self.non_linearity not in NON_LINEARITIES:
            raise ValueError(
                f"Unknown `non_linearity` {self.non_linearity!r}; choose one of {', '.join(NON_LINEARITIES)}"
            )
        self.target_modules = (
            set(self.target_modules) if isinstance(self.target_modules, list) else self.target_modules
        )
        self.exclude_modules = (
            set(self.exclude_modules) if isinstance(self.exclude_modules, list) else self.exclude_modules
        )


def _output_features(module: nn.Module) -> int:
    """The width d of a module's output: a Linear's `out_features`, else the last Linear or LayerNorm
    registered inside it (BertOutput ends in `LayerNorm`, ViT's MLP in `fc2`)."""
    for sub in reversed(list(module.modules())):
        if isinstance(sub, nn.LayerNorm):
            return sub.normalized_shape[-1]
        if isinstance(sub, nn.Linear):
            return sub.out_features
    raise ValueError(
        f"Cannot infer the output width of {type(module).__name__} for a bottleneck adapter: target a module that is "
        "or ends in an nn.Linear or nn.LayerNorm"
    )


class BottleneckLayer(nn.Module, BaseTunerLayer):
    """Wraps a target module and adds h + up(act(down(h))) to its output h (the first element if the
    module returns a tuple). Holds one down/up pair per adapter name; active adapters are applied in
    order, each to the previous one's result."""

    adapter_layer_names = ("bottleneck_down", "bottleneck_up")
    other_param_names = ("bottleneck_non_linearity",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: BottleneckConfig, **kwargs) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.bottleneck_down = nn.ModuleDict({})
        self.bottleneck_up = nn.ModuleDict({})
        self.bottleneck_non_linearity: dict[str, str] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        self.hidden_size = _output_features(self.get_base_layer())
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)

    def update_layer(self, adapter_name: str, config: BottleneckConfig, **kwargs) -> None:
        """Add (or replace) the adapter `adapter_name`, on the device of the base layer and in its dtype
        (float32 beside a quantized base layer, whose weights are not floating point)."""
        weight = next(self.get_base_layer().parameters(), None)
        factory = {}
        if weight is not None:
            factory["device"] = weight.device
            if weight.is_floating_point():
                factory["dtype"] = weight.dtype
        self.bottleneck_down[adapter_name] = nn.Linear(self.hidden_size, config.bottleneck_dim, **factory)
        self.bottleneck_up[adapter_name] = nn.Linear(config.bottleneck_dim, self.hidden_size, **factory)
        self.bottleneck_non_linearity[adapter_name] = config.non_linearity
        if config.init_weights:
            self.reset_bottleneck_parameters(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def reset_bottleneck_parameters(self, adapter_name: str) -> None:
        """Zero the up projection so the adapter is the identity until trained."""
        if adapter_name in self.bottleneck_up:
            nn.init.zeros_(self.bottleneck_up[adapter_name].weight)
            nn.init.zeros_(self.bottleneck_up[adapter_name].bias)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(
            "Bottleneck adapters cannot be merged into the base weights: h + up(act(down(h))) is non-linear. Keep the "
            "PeftModel, or use `unload()` to get the base model back without the adapters."
        )

    def unmerge(self) -> None:
        # nothing is ever merged (see `merge`)
        return

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        result = self.base_layer(*args, **kwargs)
        if self.disable_adapters:
            return result
        hidden = result[0] if isinstance(result, tuple) else result
        for active_adapter in self.active_adapters:
            if active_adapter not in self.bottleneck_down:
                continue
            down = self.bottleneck_down[active_adapter]
            up = self.bottleneck_up[active_adapter]
            act = NON_LINEARITIES[self.bottleneck_non_linearity[active_adapter]]
            x = self._cast_input_dtype(hidden, down.weight.dtype)
            hidden = hidden + up(act(down(x))).to(hidden.dtype)
        return (hidden, *result[1:]) if isinstance(result, tuple) else hidden

    def __repr__(self) -> str:
        return "bottleneck." + super().__repr__()


class BottleneckModel(BaseTuner):
    """
    Injects Houlsby bottleneck adapters ([`BottleneckLayer`]) into a transformers model.

    Args:
        model ([`~transformers.PreTrainedModel`]): The model to be adapted.
        config ([`BottleneckConfig`]): The configuration of the adapters.
        adapter_name (`str`): The name of the adapter, defaults to `"default"`.
        low_cpu_mem_usage (`bool`, `optional`, defaults to `False`):
            Create empty adapter weights on meta device. Useful to speed up the loading process.

    Example:

        ```py
        >>> import hf_fedtask  # registers the method with peft
        >>> from hf_fedtask.model.bottleneck import BottleneckConfig
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForSequenceClassification

        >>> model = AutoModelForSequenceClassification.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
        >>> model = get_peft_model(model, BottleneckConfig(task_type="SEQ_CLS", bottleneck_dim=8))
        ```

    Merging is impossible (the adapter is non-linear): `merge_adapter` and `merge_and_unload` raise, `unload`
    works.
    """

    prefix: str = "bottleneck_"
    tuner_layer_cls = BottleneckLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_BOTTLENECK_TARGET_MODULES_MAPPING

    def _create_and_replace(
        self,
        bottleneck_config: BottleneckConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs,
    ) -> None:
        if isinstance(target, BottleneckLayer):
            target.update_layer(adapter_name, bottleneck_config)
        else:
            new_module = BottleneckLayer(target, adapter_name, bottleneck_config)
            if adapter_name not in self.active_adapters:
                # adding an additional adapter: it is not automatically trainable
                new_module.requires_grad_(False)
            self._replace_module(parent, target_name, new_module, target)

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        # BaseTuner's version re-ties `child.weight` and reads it for device placement, which assumes a Linear-like
        # target; bottleneck targets are whole sub-blocks (BertOutput, ViT's MLP) without a `weight`, and
        # `update_layer` already creates the adapters on the base layer's device.
        setattr(parent, child_name, new_module)

    def _check_merge_allowed(self):
        raise ValueError(
            "Bottleneck adapters cannot be merged into the base weights: h + up(act(down(h))) is non-linear. Keep the "
            "PeftModel, or use `unload()` to get the base model back without the adapters."
        )


if PeftType.BOTTLENECK not in PEFT_TYPE_TO_CONFIG_MAPPING:  # importlib.reload must not register twice
    register_peft_method(
        name="bottleneck", config_cls=BottleneckConfig, model_cls=BottleneckModel, prefix="bottleneck_"
    )
elif PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.BOTTLENECK].__module__ != __name__:
    warnings.warn("peft already has a method named 'bottleneck'; hf_fedtask's bottleneck adapter is not registered")
