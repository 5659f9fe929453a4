"""The linearization identities of `hf_fedtask.model.linearize` on a tiny random BERT with LoRA (B ≠ 0)."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.func import functional_call, jacrev

from hf_fedtask.errors import LinearizationError
from hf_fedtask.model.backbone import load_classifier, resolve_base_model
from hf_fedtask.model.linearize import LinearizedModel, linearized
from hf_fedtask.model.tangent_rules import TANGENT_ATTENTION


@pytest.fixture
def lora_model(tiny_bert_dir):
    torch.manual_seed(0)
    base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3)
    config = LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", init_lora_weights=False, lora_dropout=0.1)
    return get_peft_model(base, config).double()


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 3000, (4, 10), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 1])}


def inputs_of(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def random_direction(model, scale=1e-2, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale for n, p in trainable(model).items()}


def shift(model, d, alpha=1.0):
    with torch.no_grad():
        for n, p in trainable(model).items():
            p.add_(d[n], alpha=alpha)


def test_identities_against_jacrev(lora_model, batch):
    model = lora_model.eval()
    x = inputs_of(batch)
    f0 = model(**x).logits.detach()
    lin = LinearizedModel(model).eval()
    assert torch.equal(lin(**x).logits, f0) or torch.allclose(lin(**x).logits, f0, atol=1e-12)

    d = random_direction(model)
    names = sorted(d)
    point = {n: p.detach().clone() for n, p in trainable(model).items()}
    jac = jacrev(lambda theta: functional_call(model, theta, (), x).logits)(point)
    explicit = sum((jac[n].flatten(2) @ d[n].flatten()) for n in names)

    shift(model, d)
    moved = lin(**x).logits.detach()
    assert (moved - f0 - explicit).abs().max() < 1e-6
    assert explicit.abs().max() > 1e-4  # the direction really moves the output

    # linear in d: at θ_lin + 3d the change is three times as large
    shift(model, d, alpha=2.0)
    assert torch.allclose(lin(**x).logits.detach() - f0, 3 * (moved - f0), atol=1e-10)
    # and the non-linear model differs at second order
    assert (model(**x).logits.detach() - lin(**x).logits.detach()).abs().max() > 1e-8
    lin.restore()


def test_gradients_at_point_equal_the_model(lora_model, batch):
    model = lora_model.eval()
    loss = model(**batch).loss
    expected = torch.autograd.grad(loss, list(trainable(model).values()))
    lin = LinearizedModel(model).eval()
    got = torch.autograd.grad(lin(**batch).loss, list(trainable(model).values()))
    for e, g in zip(expected, got, strict=True):
        assert torch.allclose(e, g, atol=1e-10)
    assert any(e.abs().max() > 0 for e in expected)


def test_dropout_follows_train_and_eval(lora_model, batch):
    lin = LinearizedModel(lora_model)
    x = inputs_of(batch)
    lin.eval()
    assert torch.equal(lin(**x).logits, lin(**x).logits)
    lin.train()
    torch.manual_seed(0)
    a = lin(**x).logits
    torch.manual_seed(1)
    b = lin(**x).logits
    assert not torch.allclose(a, b)
    # at θ_lin dropout hits both terms with one mask: the train-mode output equals the model's own
    torch.manual_seed(3)
    ours = lin(**x).logits
    torch.manual_seed(3)
    assert torch.allclose(ours, lora_model.train()(**x).logits, atol=1e-12)


def test_switches_to_tangent_attention_and_restores(tiny_bert_dir, batch):
    base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3, attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(r=4, task_type="SEQ_CLS", init_lora_weights=False))
    with linearized(model) as lin:
        assert model.config._attn_implementation == TANGENT_ATTENTION
        patched = {type(m) for m in model.modules() if "forward" in vars(m)}  # frozen layers take fused rules
        assert {torch.nn.Linear, torch.nn.LayerNorm} <= patched
        lin.train()
        lin(**batch).loss.backward()  # forward-mode AD through attention works
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules())


def test_lora_layers_mode_is_l_lora(tiny_bert_dir, batch):
    """Per-layer linearization: with B0 = 0 (peft's default init) it is LoRA with A frozen at A0,
    i.e. W x + s·B·A0 x (L-LoRA: Tang et al., ICLR 2024, arXiv:2310.04742); the rest of the network
    stays non-linear."""
    torch.manual_seed(0)
    base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS")).double().eval()
    x = inputs_of(batch)
    d = random_direction(model, scale=0.05)
    lin = LinearizedModel(model, mode="lora_layers").eval()
    shift(model, d)
    got = lin(**x).logits.detach()
    lin.restore()
    # reference: the same B, A reset to A0
    with torch.no_grad():
        for n, p in trainable(model).items():
            if "lora_A" in n:
                p.sub_(d[n])
    assert torch.allclose(got, model(**x).logits, atol=1e-10)
    with torch.no_grad():  # and it is not the plain LoRA model at those parameters
        for n, p in trainable(model).items():
            if "lora_A" in n:
                p.add_(d[n])
    assert not torch.allclose(got, model(**x).logits, atol=1e-6)
    assert not any("forward" in vars(m) for m in model.modules())  # restore() removed the patches


def test_trains_under_the_trainer(lora_model, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = lora_model.float()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 3000, (32, 8), generator=gen)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * 32,
                              "labels": [i % 3 for i in range(32)]})
    before = {n: p.detach().clone() for n, p in trainable(model).items()}
    with linearized(model) as lin:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=3,
                                 learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, remove_unused_columns=False, logging_strategy="no")
        out = Trainer(model=lin, args=args, train_dataset=data).train()
        delta = lin.delta()
    assert out.global_step == 12
    for n, p in trainable(model).items():
        assert torch.allclose(delta[n], p.detach() - before[n])
    assert sum(v.abs().sum() for v in delta.values()) > 0


def test_clear_errors(lora_model, batch):
    class NoForwardAD(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x, return_dict=True):
            return type("Out", (), {"logits": NoForwardAD.apply(x * self.w)})()

    with pytest.raises(LinearizationError, match="forward-mode AD"):
        LinearizedModel(Odd())(x=torch.ones(2, 3))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(LinearizationError, match="no trainable parameters"):
        LinearizedModel(frozen)
    with pytest.raises(LinearizationError, match="unknown linearization mode"):
        LinearizedModel(lora_model, mode="taylor2")
    with pytest.raises(LinearizationError, match="no LoRA layer"):
        LinearizedModel(torch.nn.Linear(2, 2), mode="lora_layers")
    with pytest.raises(LinearizationError, match="fused_rules applies to mode 'network' only"):
        LinearizedModel(lora_model, mode="lora_layers", fused_rules=True)
    attention = lora_model.config._attn_implementation
    with pytest.raises(LinearizationError, match="lacks trainable parameter"):
        LinearizedModel(lora_model, point={})
    assert lora_model.config._attn_implementation == attention  # a refused model is left as it was
    assert not any("forward" in vars(m) for m in lora_model.modules())


@pytest.fixture
def padded_batch():
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1000, 3000, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[3, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([2, 0, 1, 1])}


def test_fused_rules_equal_the_generic_formulas(tiny_bert_dir, padded_batch):
    """The fused tangent rules (frozen linear, layer norm, dropout, LoRA, attention) against torch's
    generic forward-mode formulas: same linearized logits and gradients away from θ_lin, in train mode
    (dropout draws the same masks) and with padding (the attention mask reaches the fused attention)."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3, attn_implementation="sdpa")
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", init_lora_weights=False,
                                                lora_dropout=0.1)).double()
        with torch.no_grad():  # layer norms away from their (1, 0) initialization
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_(0, 0.1)
        with linearized(model) if fused else contextlib.nullcontext(LinearizedModel(model, fused_rules=False)) as lin:
            assert (model.config._attn_implementation == TANGENT_ATTENTION) is fused
            assert any("forward" in vars(m) for m in model.modules()) is fused
            shift(model, random_direction(model, scale=0.05))
            lin.train()
            torch.manual_seed(7)
            out = lin(**padded_batch)
            grads = torch.autograd.grad(out.loss, list(trainable(model).values()))
            results.append((out.logits.detach(), grads))
    (logits, grads), (ref_logits, ref_grads) = results
    assert (logits - ref_logits).abs().max() < 1e-10
    assert (logits - ref_logits).abs().max() < 1e-6 * ref_logits.abs().max()
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-10)
    assert all(r.abs().max() > 0 for r in ref_grads)


def test_fused_attention_honours_padding(tiny_bert_dir, padded_batch):
    torch.manual_seed(0)
    base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3, attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(r=4, task_type="SEQ_CLS", init_lora_weights=False)).double().eval()
    x = inputs_of(padded_batch)
    expected = model(**x).logits.detach()
    with linearized(model) as lin:
        got = lin.eval()(**x).logits.detach()
        masked = x["input_ids"].clone()
        masked[1, 6:] = 2999  # tokens under the mask must not change any output
        masked[3, 3:] = 1001
        moved = lin(**{**x, "input_ids": masked}).logits.detach()
    assert torch.allclose(got, expected, atol=1e-12)
    assert torch.allclose(moved, expected, atol=1e-12)


def test_lora_rule_steps_aside_for_disabled_adapters(lora_model, batch):
    """While wrapped, peft's own switches still work: with the adapter disabled the model is the base."""
    model = lora_model.eval()
    x = inputs_of(batch)
    with model.disable_adapter():
        base_logits = model(**x).logits.detach()
    with linearized(model):
        with model.disable_adapter():
            assert torch.allclose(model(**x).logits, base_logits, atol=1e-12)
        assert not torch.allclose(model(**x).logits, base_logits, atol=1e-6)


def test_python_tour_sequence_both_modes_on_one_peft_model(lora_model, batch):
    """A user's sequence (the two `LinearizedModel` lines of docs/how-to/python-tour.md, "Linearized models,
    unlearning and client removal") builds `LinearizedModel(peft_model)` and then
    `LinearizedModel(peft_model, mode="lora_layers")` on one PEFT model: both then train (forward and
    backward) and compute, loss and gradients alike, what each computes on a model of its own; the
    model itself stays the ordinary one (the L-LoRA layers are in place only during that wrapper's forward)."""
    import copy

    peft_model = lora_model.eval()
    ordinary = copy.deepcopy(peft_model)
    alone = {mode: LinearizedModel(copy.deepcopy(peft_model), mode=mode).eval() for mode in ("network", "lora_layers")}
    lin = LinearizedModel(peft_model)  # the Python tour's two lines, in its order
    lin_lora = LinearizedModel(peft_model, mode="lora_layers")
    d = random_direction(peft_model, scale=0.05)
    for model in (peft_model, ordinary, *(w.model for w in alone.values())):
        shift(model, d)
    x = inputs_of(batch)
    for mode, wrapper in (("network", lin), ("lora_layers", lin_lora)):
        params = list(trainable(peft_model).values())
        out = wrapper.eval()(**batch)
        grads = torch.autograd.grad(out.loss, params)
        ref = alone[mode](**batch)
        ref_grads = torch.autograd.grad(ref.loss, list(trainable(alone[mode].model).values()))
        assert torch.allclose(out.logits, ref.logits, atol=1e-10)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.allclose(g, r, atol=1e-10)
        assert all(g.abs().max() > 0 for g in grads)
        assert not torch.allclose(out.logits, ordinary(**x).logits, atol=1e-6)  # linearized, not the model
    assert torch.allclose(peft_model(**x).logits, ordinary(**x).logits, atol=1e-12)
    assert not torch.allclose(lin(**x).logits, lin_lora(**x).logits, atol=1e-6)
    lin_lora.restore()
    lin.restore()
    assert not any("forward" in vars(m) for m in peft_model.modules())
    assert peft_model.config._attn_implementation == ordinary.config._attn_implementation
