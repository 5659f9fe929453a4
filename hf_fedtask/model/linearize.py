"""First-order Taylor models in the trainable parameters: the linearized ("tangent") network of
NTKFedAvg (Muhamed, Mankikar and Smith, 2024, Alg. 1) and tangent task arithmetic (Ortiz-Jimenez,
Favero and Frossard, NeurIPS 2023, arXiv:2305.12827), and the per-LoRA-layer linearization of L-LoRA
(Tang et al., ICLR 2024, arXiv:2310.04742).

    f_lin(x; θ) = f(x; θ_lin) + J_θ f(x; θ_lin) · (θ − θ_lin)

θ are the model's trainable parameters (the PEFT modules and head, or every parameter under full
fine-tuning); everything else stays frozen at its value. One forward pass with dual tensors
(forward-mode AD over a `functional_call`) gives both terms, and gradients flow to θ through the
tangent. Frozen layers take fused forward-mode rules (`hf_fedtask.model.tangent_rules`), so that a
training step costs little more than the extra tangent matmuls (benchmarks/linearize_bench.py measures
it against an ordinary step; its results are in docs/results/benchmarks.md).

Hand-written because no maintained library wraps an arbitrary (PEFT) `transformers` model this way:
research code carries the same two modes, the whole network in gortizji/tangent_task_arithmetic
(src/linearize.py, `LinearizedModel`) and each LoRA layer in tanganke/fusion_bench
(fusion_bench/models/linearized/linearized_model_utils.py, as in tanganke/peta); this one follows their
formulas and adds Trainer compatibility, attention selection and clear errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_fedtask.core.names import LINEARIZATIONS as MODES
from hf_fedtask.errors import LinearizationError
from hf_fedtask.model.device import to_cpu
from hf_fedtask.model.lm_loss import shifted_lm_loss
from hf_fedtask.model.tangent_rules import (
    TANGENT_ATTENTION,
    patch_frozen_modules,
    register_tangent_attention,
    unpatch,
)


def _forward_ad_attention(model: nn.Module, fused: bool) -> str:
    """An attention implementation with forward-mode AD (sdpa's fused CPU kernel has none): the one
    with a fused tangent rule where asked for and the model takes transformers' attention interface,
    else eager."""
    if fused and getattr(model, "_supports_attention_backend", False):
        register_tangent_attention()
        return TANGENT_ATTENTION
    return "eager"


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _tangent_forward(module: nn.Module, names: list[str], point: list[torch.Tensor], args, kwargs):
    """(f(θ_lin), J·(θ − θ_lin)) of `module` called on (args, kwargs), θ = its live parameters.

    Forward-mode AD with dual tensors (`torch.autograd.forward_ad`): the same rules as
    `torch.func.jvp`, without functorch's per-op wrapping, which cost about a tenth of a step."""
    live = dict(module.named_parameters())
    with fwAD.dual_level():
        duals = {n: fwAD.make_dual(p0, live[n] - p0) for n, p0 in zip(names, point, strict=True)}
        flat, spec = tree_flatten(functional_call(module, duals, args, kwargs))
        primal, tangent = [], []
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                p, t = fwAD.unpack_dual(leaf)
                leaf, t = p, (torch.zeros_like(p) if t is None else t)
            else:
                t = leaf
            primal.append(leaf)
            tangent.append(t)
    return tree_unflatten(primal, spec), tree_unflatten(tangent, spec)


_FORWARD_AD_ATTENTIONS = ("eager", TANGENT_ATTENTION)


def _attention_of(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


class LinearizedModel(nn.Module):
    """`model` linearized around `point` (default: its current trainable parameters).

    `mode="network"` (default): the whole network's output is linearized in all trainable
    parameters (NTKFedAvg; tangent task arithmetic). `mode="lora_layers"` (L-LoRA): each peft LoRA
    layer is linearized in its own LoRA weights, the rest of the network stays non-linear; other
    trainable parameters (e.g. the head) are used as they are.

    The wrapper trains under `transformers.Trainer` like the model it wraps: it takes the same
    inputs, returns `loss` (cross-entropy on the linearized logits) and `logits`, and its trainable
    parameters are the wrapped model's. Dropout follows train/eval mode and uses one mask for both
    terms. While it lives it switches the model to an attention with forward-mode AD (in mode
    'lora_layers' only where the model's attention has none) and, in network mode, gives frozen
    layers fused tangent rules (`hf_fedtask.model.tangent_rules`; `fused_rules=False` keeps torch's
    generic formulas, the reference they are tested against; `fused_rules=True` with mode
    'lora_layers', which has no such rules, is refused); `restore()` undoes both. These changes leave
    what the model computes as it was; the L-LoRA layers, which change it, are put in place only while
    this wrapper's own forward runs, so several wrappers of either mode can share one model
    (`LinearizedModel(peft_model)` and `LinearizedModel(peft_model, mode="lora_layers")`, in that order).
    θ_lin lives on the parameters' device and follows them (`.to(device)`).
    """

    accepts_loss_kwargs = False  # the loss is computed here, per batch; Trainer must not pass token counts

    def __init__(self, model: nn.Module, point: Mapping[str, torch.Tensor] | None = None, mode: str = "network",
                 fused_rules: bool | None = None):
        super().__init__()
        if mode not in MODES:
            raise LinearizationError(f"unknown linearization mode {mode!r}; choose one of {', '.join(MODES)}")
        if fused_rules and mode != "network":
            raise LinearizationError(f"fused_rules applies to mode 'network' only, not {mode!r}")
        fused = mode == "network" and fused_rules is not False
        self.model = model
        self.mode = mode
        trainable = _trainable(model)
        if not trainable:
            raise LinearizationError(f"{type(model).__name__} has no trainable parameters to linearize in")
        point = dict(point) if point is not None else {n: p.detach() for n, p in trainable.items()}
        missing = sorted(set(trainable) - set(point))
        if missing:
            raise LinearizationError(f"linearization point lacks trainable parameter {missing[0]!r}")
        self.names = sorted(trainable)
        # θ_lin: frozen copies on the parameters' device and in their dtype, deliberately not buffers
        # (never saved with the model's state); `_apply` moves them along with the parameters
        self.point = {n: point[n].detach().clone().to(trainable[n]) for n in self.names}
        self._patched: list[nn.Module] = []
        self._layer_forwards: list[tuple[nn.Module, object]] = []  # L-LoRA: installed per forward call
        if mode == "lora_layers":
            self._layer_forwards = self._lora_layer_forwards()
        elif fused:
            self._patched = patch_frozen_modules(model)
        self._attention = _attention_of(model)  # switched last: a refused model is left as it was
        if self._attention is not None and mode == "lora_layers" and self._attention in _FORWARD_AD_ATTENTIONS:
            # an attention with forward-mode AD already (e.g. a whole-network wrapper's, which L-LoRA's plain
            # tensors run through as well) stays; any other is switched to eager, as always
            self._attention = None
        if self._attention is not None:
            model.set_attn_implementation(_forward_ad_attention(model, fused))

    def _apply(self, fn, recurse=True):
        """`.to(device)`, `.cuda()`, `.half()`...: θ_lin follows the parameters it is subtracted from
        (changed in place: the L-LoRA layers read this dict)."""
        super()._apply(fn, recurse)
        for n in list(self.point):
            self.point[n] = fn(self.point[n])
        return self

    # -- forward ----------------------------------------------------------------------------
    def forward(self, labels: torch.Tensor | None = None, **inputs) -> SequenceClassifierOutput:
        inputs.pop("num_items_in_batch", None)
        logits = self.linearized_logits(inputs)
        loss = None
        if labels is not None and logits.dim() == 3:  # a causal LM's (batch, length, vocab): token t predicts t+1
            loss = shifted_lm_loss(logits, labels)
        elif labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def linearized_logits(self, inputs: dict) -> torch.Tensor:
        if self.mode == "lora_layers":  # the layers linearize themselves (see _lora_layer_forwards)
            with _installed(self._layer_forwards):
                return self.model(**inputs).logits
        try:
            out0, dout = _tangent_forward(self.model, self.names, [self.point[n] for n in self.names], (),
                                          {**inputs, "return_dict": True})
        except (NotImplementedError, RuntimeError) as e:
            raise LinearizationError(
                f"{type(self.model).__name__} cannot be linearized: an op has no forward-mode AD "
                f"({str(e).splitlines()[0]}); use a model/attention implementation that supports forward-mode AD"
            ) from e
        return out0.logits + dout.logits

    def tangent_logits(self, inputs: dict) -> torch.Tensor:
        """The linear term J·(θ − θ_lin) of the logits alone (whole-network mode): what Gauss-Newton
        products of the linearized model need (F²L²'s removal step)."""
        if self.mode != "network":
            raise LinearizationError("tangent_logits needs the whole network linearized (mode 'network')")
        return _tangent_forward(self.model, self.names, [self.point[n] for n in self.names], (),
                                {**inputs, "return_dict": True})[1].logits

    # -- L-LoRA -----------------------------------------------------------------------------
    def _lora_layer_forwards(self) -> list[tuple[nn.Module, object]]:
        """Each LoRA layer with its linearized forward, not yet installed: `linearized_logits` puts them
        in place for its own call only, so the shared model stays the ordinary (or network-linearized)
        one for everyone else; installing them for the wrapper's life made the model itself L-LoRA and a
        whole-network wrapper of it fail on nested forward-mode AD."""
        from peft.tuners.lora import LoraLayer

        layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, LoraLayer)]
        if not layers:
            raise LinearizationError("mode 'lora_layers' needs a peft LoRA model; this model has no LoRA layer")
        forwards = []
        for prefix, layer in layers:
            names = sorted(n for n, p in layer.named_parameters() if p.requires_grad)
            if not names:
                continue  # an inactive adapter's layer copy
            keys = [f"{prefix}.{n}" for n in names]
            forwards.append((layer, _layer_linearizer(layer, names, self.point, keys)))
        return forwards

    def restore(self) -> None:
        """Undo what wrapping changed on the model (patched layers, attention implementation)."""
        unpatch(self._patched)
        self._patched.clear()
        if self._attention not in (None, _attention_of(self.model)):
            self.model.set_attn_implementation(self._attention)

    # -- the linearization as a task vector ---------------------------------------------------
    def delta(self) -> dict[str, torch.Tensor]:
        """θ − θ_lin: what the linearized model adds to its linearization point (CPU tensors)."""
        live = _trainable(self.model)
        return {n: to_cpu(live[n] - self.point[n]) for n in self.names}


_ABSENT = object()


@contextlib.contextmanager
def _installed(forwards: list[tuple[nn.Module, object]]) -> Iterator[None]:
    """`forwards` as the modules' instance `forward` for the duration; whatever was there before (a
    fused rule of a whole-network wrapper of the same model, or nothing) is put back after."""
    saved = [(module, vars(module).get("forward", _ABSENT)) for module, _ in forwards]
    for module, forward in forwards:
        module.forward = forward
    try:
        yield
    finally:
        for module, previous in saved:
            if previous is _ABSENT:
                vars(module).pop("forward", None)
            else:
                module.forward = previous


def _layer_linearizer(layer: nn.Module, names: list[str], point: Mapping[str, torch.Tensor], keys: list[str]):
    """A forward for one LoRA layer: its own first-order expansion in its LoRA weights, around
    `point[k]` for `keys` (read at each call: the point follows the model's device). The jvp calls the
    layer again; that inner call runs the class's plain forward, so the layer runs once."""
    cls_forward = type(layer).forward
    inside = [False]

    def forward(*args, **kwargs):
        if inside[0]:
            return cls_forward(layer, *args, **kwargs)
        inside[0] = True
        try:
            out0, dout = _tangent_forward(layer, names, [point[k] for k in keys], args, kwargs)
        finally:
            inside[0] = False
        return out0 + dout

    return forward


@contextlib.contextmanager
def linearized(model: nn.Module, point: Mapping[str, torch.Tensor] | None = None,
               mode: str = "network") -> Iterator[LinearizedModel]:
    """`LinearizedModel(model, point, mode)` for the duration of a `with` block, restored after; the
    way a shared in-memory host model is lent to one client's linearized training."""
    lin = LinearizedModel(model, point, mode)
    try:
        yield lin
    finally:
        lin.restore()
