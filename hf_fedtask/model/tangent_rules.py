"""Forward-mode rules for the frozen parts of a linearized network, each one fused kernel each way.

In f_lin(x; θ) = f(x; θ_lin) + J·(θ − θ_lin), every op downstream of the first trainable parameter
carries a tangent, and the training step runs the op three times: primal, tangent (forward mode)
and the tangent's adjoint (the backward pass to θ). torch's generic forward-mode formulas are
correct but, for frozen ops, wasteful: `addmm` spends a matmul on the weight's zero tangent,
layer norm's tangent is a dozen elementwise kernels, attention's goes through `matmul`'s reshape
copies. The rules here give each frozen op a tangent that is a linear map with a fused kernel, and
that map's adjoint a fused kernel too:

* linear, frozen W:     t ↦ t·Wᵀ                          adjoint g ↦ g·W
* layer norm, frozen w: t ↦ w ⊙ J₀t  (J₀ = ∂x̂/∂x, symmetric: native_layer_norm_backward with no weight)
                                                          adjoint g ↦ J₀(w ⊙ g) (native_layer_norm_backward)
* LoRA on a frozen linear (A, B trainable): t ↦ W·t + s·[B | B_t]·[A·(m ⊙ t) + A_t·d ; h], h = A·d, d = m ⊙ x
* dropout, mask m:      t ↦ m ⊙ t                         adjoint: the same product (the generic
                                                          rule re-derives it through `bernoulli`'s decomposition)
* softmax P:            t ↦ P ⊙ (t − Σ P ⊙ t)             adjoint: the same map (the Jacobian is symmetric),
                                                          both `_softmax_backward_data`
* attention:            transformers' attention interface, registered as `TANGENT_ATTENTION`: eager
                        attention's math on contiguous batched matmuls with the softmax rule above.

Hand-written because torch has no fused forward-mode rules for frozen layers and no library
provides them (functorch's formulas are the generic ones this replaces). Every rule is exact: the
identities against `jacrev` in tests/test_linearize.py hold to float64 round-off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TANGENT_ATTENTION = "hf_fedtask_tangent"


def _is_frozen(module: nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters(recurse=False))


def _layer_norm_vjp(g, x, shape, mean, rstd, weight):
    """Jᵀ·g of layer norm at x (J₀·(w ⊙ g); with weight None, J₀·g = J₀ᵀ·g, J₀ being symmetric)."""
    return torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, weight, None, [True, False, False])[0]


# -- the tangent maps: linear in t, with their adjoints as backward -------------------------------
class _LayerNormTangent(torch.autograd.Function):
    @staticmethod
    def forward(t, x, shape, mean, rstd, weight):
        dx = _layer_norm_vjp(t, x, shape, mean, rstd, None)
        return dx if weight is None else dx * weight

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x, ctx.shape, ctx.mean, ctx.rstd, ctx.weight = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        return _layer_norm_vjp(g, ctx.x, ctx.shape, ctx.mean, ctx.rstd, ctx.weight), None, None, None, None, None


class _SoftmaxTangent(torch.autograd.Function):
    """t ↦ P ⊙ (t − Σ P ⊙ t): softmax's Jacobian, symmetric, so the adjoint is the same kernel."""

    @staticmethod
    def forward(t, probs, dim):
        return torch.ops.aten._softmax_backward_data(t, probs, dim, probs.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.probs, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return torch.ops.aten._softmax_backward_data(g, ctx.probs, ctx.dim, ctx.probs.dtype), None, None


# -- the frozen ops: ordinary forward and backward, jvp through the maps above ---------------------
class _FrozenLinear(torch.autograd.Function):
    """`F.linear` with a frozen weight and bias. The generic `addmm` formula also spends a matmul on
    the weight's (zero) tangent and another in the backward pass, in the linearized network on every
    frozen linear (benchmarks/linearize_bench.py gives what this rule saves)."""

    @staticmethod
    def forward(x, module):
        return F.linear(x, module.weight, module.bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.weight = inputs[1].weight

    @staticmethod
    def jvp(ctx, x_t, _):
        return F.linear(x_t, ctx.weight)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight, None


class _FrozenLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, module):
        return torch.native_layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)

    @staticmethod
    def setup_context(ctx, inputs, output):  # output: (y, mean, rstd)
        ctx.x, ctx.shape, ctx.weight = inputs[0], inputs[1].normalized_shape, inputs[1].weight
        ctx.mean, ctx.rstd = output[1], output[2]
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def jvp(ctx, x_t, _):
        return _LayerNormTangent.apply(x_t, ctx.x, ctx.shape, ctx.mean, ctx.rstd, ctx.weight), None, None

    @staticmethod
    def backward(ctx, g, *_):
        return _layer_norm_vjp(g, ctx.x, ctx.shape, ctx.mean, ctx.rstd, ctx.weight), None


class _Dropout(torch.autograd.Function):
    """x ⊙ keep for a drawn, scaled mask; tangent and adjoint are the same product."""

    @staticmethod
    def forward(x, extras):
        return x * extras[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.keep = inputs[1][0]

    @staticmethod
    def jvp(ctx, x_t, _):
        return x_t * ctx.keep

    @staticmethod
    def backward(ctx, g):
        return g * ctx.keep, None


def _dropout_keep(training: bool, p: float, like: torch.Tensor) -> torch.Tensor | None:
    """Dropout's scaled mask, drawn as F.dropout draws it on CPU (bernoulli(1 − p) / (1 − p)), so
    masks match the ordinary model's; None where dropout is the identity."""
    if not training or p == 0:
        return None
    if p == 1:
        return torch.zeros_like(like)
    return torch.empty_like(like).bernoulli_(1 - p).div_(1 - p)


def _dropout_forward(module: nn.Dropout):
    def forward(x):
        keep = _dropout_keep(module.training, module.p, x)
        return x if keep is None else _Dropout.apply(x, (keep,))  # in a tuple: no zero tangent for the mask

    return forward


class _LoraLinear(torch.autograd.Function):
    """peft's vanilla LoRA on a frozen linear: W·x + b + s·B·A·(x ⊙ keep). With A and B carrying
    tangents, the tangent is one matmul through W plus one through [B | B_t] on [h_t | h], h = A·d,
    accumulated in place of the generic rule's four matmuls, a scaling and two sums."""

    @staticmethod
    def forward(x, lora_a, lora_b, extras):
        base, scaling, keep = extras
        d = x if keep is None else x * keep
        h = F.linear(d, lora_a)
        out = F.linear(x, base.weight, base.bias)
        out.view(-1, out.shape[-1]).addmm_(h.view(-1, h.shape[-1]), lora_b.t(), alpha=scaling)
        return out, d, h

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x, ctx.lora_a, ctx.lora_b, ctx.extras = inputs
        _, ctx.d, ctx.h = output
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def jvp(ctx, x_t, a_t, b_t, _):
        base, scaling, keep = ctx.extras
        h_t = None if a_t is None else F.linear(ctx.d, a_t)
        out_t = None
        if x_t is not None:
            part = F.linear(x_t if keep is None else x_t * keep, ctx.lora_a)
            h_t = part if h_t is None else h_t + part
            out_t = F.linear(x_t, base.weight)
        rows = ctx.h.numel() // ctx.h.shape[-1]
        if b_t is not None:  # B·h_t + B_t·h as one matmul
            factors = ctx.h if h_t is None else torch.cat([h_t, ctx.h], -1)
            weights = b_t if h_t is None else torch.cat([ctx.lora_b, b_t], 1)
        else:
            factors, weights = h_t, ctx.lora_b
        if factors is not None:
            lora_t = factors.reshape(rows, -1)
            if out_t is None:
                out_t = (lora_t @ weights.t() * scaling).view(*ctx.h.shape[:-1], -1)
            else:
                out_t = torch.addmm(out_t.view(rows, -1), lora_t, weights.t(), alpha=scaling).view(out_t.shape)
        if out_t is None:
            out_t = ctx.x.new_zeros(*ctx.x.shape[:-1], base.weight.shape[0])
        return out_t, None, None

    @staticmethod
    def backward(ctx, grad, *_):
        base, scaling, keep = ctx.extras
        grad2 = grad.reshape(-1, grad.shape[-1])
        d2, h2 = ctx.d.reshape(-1, ctx.d.shape[-1]), ctx.h.reshape(-1, ctx.h.shape[-1])
        grad_h = grad2 @ ctx.lora_b * scaling
        grad_d = grad_h @ ctx.lora_a
        grad_x = grad2 @ base.weight + (grad_d if keep is None else grad_d * keep.reshape(grad_d.shape))
        return grad_x.view(ctx.x.shape), grad_h.t() @ d2, grad2.t() @ h2 * scaling, None


def _lora_forward(layer: nn.Module):
    """The fused rule while `layer` runs one vanilla LoRA adapter on a frozen nn.Linear; peft's own
    forward otherwise (merged, disabled, several or mixed adapters, variants such as DoRA)."""
    cls_forward = type(layer).forward

    def forward(x, *args, **kwargs):
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if (args or kwargs or layer.disable_adapters or layer.merged or len(active) != 1
                or active[0] in layer.lora_variant or layer.lora_B[active[0]].bias is not None
                or layer.lora_A[active[0]].bias is not None or x.dtype != layer.lora_A[active[0]].weight.dtype):
            return cls_forward(layer, x, *args, **kwargs)
        name = active[0]
        dropout = layer.lora_dropout[name]
        keep = _dropout_keep(dropout.training, dropout.p, x) if isinstance(dropout, nn.Dropout) else None
        return _LoraLinear.apply(x, layer.lora_A[name].weight, layer.lora_B[name].weight,
                                 (layer.base_layer, layer.scaling[name], keep))[0]

    return forward


def _is_lora_on_frozen_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear as LoraLinear

    return (type(module) is LoraLinear and type(module.base_layer) is nn.Linear and _is_frozen(module.base_layer)
            and not module.fan_in_fan_out)


# -- attention, through transformers' attention interface ---------------------------------------------
class _Attention(torch.autograd.Function):
    """softmax(q·kᵀ·scaling + mask) ⊙ keep · v on (batch·heads, tokens, dim) inputs, keep = dropout's
    scaled mask (or None); the output is (batch, tokens, heads, dim). The tangent is written out on
    batched matmuls and the fused softmax map."""

    @staticmethod
    def forward(q, k, v, extras):
        mask, keep, scaling, heads = extras
        scores = torch.bmm(q, k.transpose(1, 2)).view(-1, heads, q.shape[1], k.shape[1]).mul_(scaling)
        if mask is not None:
            scores.add_(mask)
        probs = torch.softmax(scores, -1)
        dropped = probs if keep is None else probs * keep
        return _merge_heads(torch.bmm(dropped.view(q.shape[0], q.shape[1], -1), v), heads), probs, dropped

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.q, ctx.k, ctx.v, ctx.extras = inputs
        _, ctx.probs, ctx.dropped = output
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def jvp(ctx, q_t, k_t, v_t, _):
        _, keep, scaling, heads = ctx.extras
        q, k, v = ctx.q, ctx.k, ctx.v
        scores_t = None  # (q_t·kᵀ + q·k_tᵀ)·scaling
        if q_t is not None:
            scores_t = torch.bmm(q_t, k.transpose(1, 2))
        if k_t is not None:
            part = torch.bmm(q, k_t.transpose(1, 2))
            scores_t = part if scores_t is None else scores_t + part
        out_t = None  # P_t·keep·v + (P·keep)·v_t
        if scores_t is not None:
            probs_t = _SoftmaxTangent.apply(scores_t.view(ctx.probs.shape) * scaling, ctx.probs, -1)
            if keep is not None:
                probs_t = probs_t * keep
            out_t = torch.bmm(probs_t.view(q.shape[0], q.shape[1], -1), v)
        if v_t is not None:
            part = torch.bmm(ctx.dropped.view(q.shape[0], q.shape[1], -1), v_t)
            out_t = part if out_t is None else out_t + part
        out_t = q.new_zeros(q.shape[0], q.shape[1], v.shape[2]) if out_t is None else out_t
        return _merge_heads(out_t, heads), None, None

    @staticmethod
    def backward(ctx, grad, *_):
        _, keep, scaling, heads = ctx.extras
        q, k, v = ctx.q, ctx.k, ctx.v
        grad = grad.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)  # (batch·heads, tokens, dim)
        grad_v = torch.bmm(ctx.dropped.view(q.shape[0], q.shape[1], -1).transpose(1, 2), grad)
        grad_probs = torch.bmm(grad, v.transpose(1, 2)).view(ctx.probs.shape)
        if keep is not None:
            grad_probs = grad_probs * keep
        grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, ctx.probs, -1, ctx.probs.dtype) * scaling
        grad_scores = grad_scores.view(q.shape[0], q.shape[1], -1)
        return torch.bmm(grad_scores, k), torch.bmm(grad_scores.transpose(1, 2), q), grad_v, None


def _merge_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch·heads, tokens, dim) -> contiguous (batch, tokens, heads, dim)."""
    return x.view(-1, heads, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()


def tangent_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0,
                      **kwargs):
    """transformers' eager attention (same math, same dropout draw) with a fused forward-mode rule;
    (batch, heads, tokens, head_dim) in, (batch, tokens, heads, head_dim) out."""
    batch, heads, q_len, head_dim = query.shape
    if key.shape[1] != heads:  # grouped-query attention: as eager's repeat_kv
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    k_len = key.shape[2]
    if scaling is None:
        scaling = head_dim ** -0.5
    keep = _dropout_keep(module.training, dropout, query.new_empty((batch, heads, q_len, k_len)))
    mask = None if attention_mask is None else attention_mask[..., :k_len]
    q, k, v = (x.reshape(batch * heads, x.shape[2], x.shape[3]) for x in (query, key, value))
    # mask, keep and the scalars travel in a tuple: autograd.Function gives them no tangent (no zero fill)
    return _Attention.apply(q, k, v, (mask, keep, scaling, heads))[0], None


def register_tangent_attention() -> None:
    """Make `TANGENT_ATTENTION` a transformers attention implementation, with eager's mask format."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(TANGENT_ATTENTION, tangent_attention)
    AttentionMaskInterface.register(TANGENT_ATTENTION, eager_mask)


# -- patching a model's frozen modules ------------------------------------------------------------------
# the frozen module is passed as a non-tensor argument, so forward mode materializes no zero
# tangents for its weight and bias
_RULES = {
    nn.Linear: lambda module: lambda x: _FrozenLinear.apply(x, module),
    nn.LayerNorm: lambda module: lambda x: _FrozenLayerNorm.apply(x, module)[0],
    nn.Dropout: _dropout_forward,
}


def patch_frozen_modules(model: nn.Module) -> list[nn.Module]:
    """Give every frozen linear, layer norm and dropout of `model`, and every peft LoRA layer on a
    frozen linear, its fused forward-mode rule (an instance `forward`, deleted again by `unpatch`);
    returns the patched modules."""
    patched = []
    for module in model.modules():
        rule = _RULES.get(type(module))
        forward = rule(module) if rule is not None and _is_frozen(module) else None
        if forward is not None:
            module.forward = forward
            patched.append(module)
        elif _is_lora_on_frozen_linear(module):
            module.forward = _lora_forward(module)
            patched.append(module)
    return patched


def unpatch(modules: list[nn.Module]) -> None:
    """Delete the instance `forward`s `patch_frozen_modules` set (one already gone, e.g. removed by a
    second wrapper of the same model, is skipped)."""
    for module in modules:
        vars(module).pop("forward", None)
