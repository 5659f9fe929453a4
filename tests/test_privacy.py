"""Client-level differential privacy (`hf_fedtask.privacy`): every upload clipped to C, the noise's scale on
the aggregated sums (central and in client shares), ε as dp-accounting and opacus account it, σ calibrated to
a target ε, the refusals, and the Flower Grid giving the in-process run with a fixed noise seed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_config, read_records

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, unpack_vectors
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError
from hf_fedtask.privacy import accountant
from hf_fedtask.privacy.aggregation import add_central_noise, contributors
from hf_fedtask.privacy.clipping import clip_jointly, global_norm
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.privacy.settings import PrivacySettings, resolve_privacy
from hf_fedtask.privacy.upload import CLIPPED, private_update
from hf_fedtask.strategies import build_strategy


def _tv(*shapes, value=0.0) -> TaskVector:
    return TaskVector({f"w{i}": torch.full(s, value) for i, s in enumerate(shapes)})


def _settings(noise="server", sigma=2.0, clip=0.5, seed=0) -> PrivacySettings:
    return PrivacySettings(clip=clip, noise_multiplier=sigma, delta=1e-5, noise=noise, noise_seed=seed,
                           population=10, sample=4, rounds=1)


# -- the mechanism, unit by unit ----------------------------------------------------------------------------
def test_clipping_scales_the_whole_upload_jointly_and_leaves_public_entries():
    vectors = {"a": _tv((3, 4), value=1.0), "b": _tv((5,), value=-2.0), "counts": _tv((2,), value=7.0)}
    norm = math.sqrt(12 + 5 * 4)
    clipped, before, was = clip_jointly(vectors, 1.5, skip=["counts"])
    assert was and before == pytest.approx(norm)
    assert global_norm(clipped, skip=["counts"]) == pytest.approx(1.5, rel=1e-6)
    assert torch.equal(clipped["counts"]["w0"], vectors["counts"]["w0"])  # bookkeeping untouched
    assert torch.allclose(clipped["a"]["w0"] / clipped["b"]["w0"][0], vectors["a"]["w0"] / -2.0)  # direction kept
    same, _, was = clip_jointly(vectors, 100.0, skip=["counts"])
    assert not was and same["a"] is vectors["a"]


def test_server_noise_on_zero_updates_has_std_sigma_c_over_the_count():
    """Five zero uploads: each per-entry mean carries N(0, (σC/h)²); a head held by two carries (σC/2)²."""
    s = _settings()
    updates = [ClientUpdate(c, 1, {"shared": _tv((40_000,)), **({"head/t": _tv((40_000,))} if c < 2 else {})},
                            {"t": 1}) for c in range(5)]
    noised = add_central_noise(updates, s, round_=1)
    shared = sum(u.vectors["shared"]["w0"] for u in noised) / 5
    head = sum(u.vectors["head/t"]["w0"] for u in noised if "head/t" in u.vectors) / 2
    assert shared.std().item() == pytest.approx(s.noise_multiplier * s.clip / 5, rel=0.02)
    assert head.std().item() == pytest.approx(s.noise_multiplier * s.clip / 2, rel=0.02)
    again = add_central_noise(updates, s, round_=1)  # a fixed noise seed repeats; another round differs
    assert torch.equal(again[0].vectors["shared"]["w0"], noised[0].vectors["shared"]["w0"])
    other = add_central_noise(updates, s, round_=2)
    assert not torch.equal(other[0].vectors["shared"]["w0"], noised[0].vectors["shared"]["w0"])
    secret = add_central_noise(updates, _settings(seed=None), round_=1)  # default: os.urandom, not the run seed
    assert not torch.equal(secret[0].vectors["shared"]["w0"], noised[0].vectors["shared"]["w0"])


class _Plain(ClientPrivacy):
    public_entries = ("counts",)


def test_client_shares_sum_to_the_central_noise_and_dropouts_are_made_up():
    sigma, clip, h = 1.5, 0.8, 4
    zero = {"shared": _tv((40_000,)), "counts": _tv((1,), value=1.0)}
    shares = {"noise_multiplier": sigma, "contributors": {"shared": h}}
    uploads = [private_update(_Plain(), ClientUpdate(c, 3, dict(zero), {"t": 17}, {"t/train_loss": 0.3}),
                              SimpleNamespace(round=3, client_id=c), clip, shares, noise_seed=5) for c in range(h)]
    each = torch.stack([u.vectors["shared"]["w0"] for u in uploads])
    assert each.std(dim=1).mean().item() == pytest.approx(sigma * clip / math.sqrt(h), rel=0.02)
    assert each.sum(0).var().item() == pytest.approx((sigma * clip) ** 2, rel=0.03)  # the central variance
    assert all(torch.equal(u.vectors["counts"]["w0"], torch.ones(1)) for u in uploads)  # public: no noise
    assert uploads[0].num_samples == {"t": 1} and uploads[0].metrics == {CLIPPED: 0.0}  # no counts, no losses
    # one of the four dropped: the server adds the missing quarter of the variance to the sum
    s = _settings(noise="clients", sigma=sigma, clip=clip)
    made_up = add_central_noise(uploads[:3], s, round_=3, public=["counts"], instructed={"shared": h})
    assert sum(u.vectors["shared"]["w0"] for u in made_up).var().item() == pytest.approx((sigma * clip) ** 2,
                                                                                         rel=0.03)
    assert contributors({0: ["shared", "head/a", "counts"], 1: ["shared"]}, ["counts"]) == {"head/a": 1, "shared": 2}


# -- accounting ---------------------------------------------------------------------------------------------
def test_epsilon_is_dp_accountings_and_opacus_agrees_under_full_participation():
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant
    from opacus.accountants import RDPAccountant

    sigma, rounds, delta = 1.3, 20, 1e-5
    # sampling without replacement, replace-one: built here from dp-accounting's own events
    ref = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    ref.compose(dp_accounting.SampledWithoutReplacementDpEvent(50, 10, dp_accounting.GaussianDpEvent(sigma / 2)),
                rounds)
    assert accountant.epsilon(50, 10, sigma, rounds, delta) == pytest.approx(ref.get_epsilon(delta), rel=1e-9)
    # full participation: the Gaussian of multiplier σ/2 (std σC over the replace-one sensitivity 2C), composed
    opacus = RDPAccountant()
    opacus.history = [(sigma / 2, 1.0, rounds)]
    assert accountant.epsilon(8, 8, sigma, rounds, delta) == pytest.approx(opacus.get_epsilon(delta), rel=0.02)
    running = accountant.RunningAccountant(50, 10, sigma, delta)
    assert [running.advance_to(r) for r in (1, 2)] == pytest.approx(
        [accountant.epsilon(50, 10, sigma, r, delta) for r in (1, 2)], rel=1e-9)
    assert accountant.epsilon(8, 8, 0.0, rounds, delta) == math.inf


def test_calibrated_sigma_hits_the_target_epsilon():
    sigma = accountant.calibrate(8, 8, 10, 4.0, 1e-5)
    assert accountant.epsilon(8, 8, sigma, 10, 1e-5) == pytest.approx(4.0, rel=1e-3)
    assert accountant.epsilon(8, 8, sigma * 0.99, 10, 1e-5) > 4.0  # the smallest such σ


# -- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["tct", "f2l2", "fedper", "matfl"])
def test_strategies_without_client_dp_refuse_it_in_one_line(strategy, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, strategy=strategy, dp_clip=1.0,
                         dp_noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=rf"^dp_clip: strategy '{strategy}' does not support client-level DP: "
                                          r"[^\n]+$"):
        resolve_privacy(config, build_strategy(strategy, {}), 4, 4)


@pytest.mark.parametrize("settings,options,message", [
    ({"dp_noise_multiplier": 1.0}, {}, r"^dp_noise_multiplier: client-level DP needs dp_clip"),
    ({"dp_noise": "clients"}, {}, r"^dp_noise: client-level DP needs dp_clip"),
    ({"dp_clip": 1.0}, {}, r"^dp_clip: give dp_noise_multiplier"),
    ({"dp_clip": 1.0, "dp_noise_multiplier": 1.0, "dp_epsilon": 2.0}, {}, r"^dp_epsilon: 2.0 and dp_noise_multi"),
    ({"dp_clip": 1.0, "dp_noise_multiplier": 1.0}, {"forget_tasks": ["moods"]}, r"^forget_tasks: strategy 'fedavg'"),
    ({"dp_clip": 1.0, "dp_noise_multiplier": 1.0}, {"lora_aggregation": "product"}, r"^lora_aggregation product"),
])
def test_bad_dp_settings_are_refused_in_one_line(settings, options, message, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, strategy_options=options, **settings)
    with pytest.raises(ConfigError, match=message):
        resolve_privacy(config, build_strategy("fedavg", options), 4, 4)


def test_bad_values_and_fedyolo_sample_weighting_are_refused(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    for bad in ({"dp_clip": 0.0}, {"dp_delta": 0.0}, {"dp_noise": "both"}, {"dp_noise_multiplier": -1.0}):
        with pytest.raises(ConfigError, match=rf"^config: {next(iter(bad))}: must be"):
            make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, **bad)
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, strategy="fedyolo", dp_clip=1.0,
                         dp_noise_multiplier=1.0, strategy_options={"sample_weighted": True})
    with pytest.raises(ConfigError, match=r"^sample_weighted: strategy 'fedyolo' cannot weight by sample counts"):
        resolve_privacy(config, build_strategy("fedyolo", {"sample_weighted": True}), 4, 4)


# -- runs ---------------------------------------------------------------------------------------------------
def _uploads(run_dir: Path) -> list[dict[str, TaskVector]]:
    return [unpack_vectors(TaskVector.load(p)) for p in sorted((run_dir / "payloads").rglob("*.uplink.safetensors"))]


DP = {"dp_clip": 0.05, "dp_noise_multiplier": 0.8, "dp_noise_seed": 3, "save_payloads": True, "local_steps": 2}


@pytest.mark.parametrize("strategy,overrides", [
    ("fedavg", {"participation": 0.5, "rounds": 2}),
    ("matu", {"zeta": 0.5, "num_clients": 3}),
    ("scaffold", {"optimizer": "sgd", "learning_rate": 0.5}),
    ("fedyolo", {"strategy_options": {"secure_aggregation": True}, "dp_noise": "clients"}),
])
def test_runs_clip_every_upload_and_report_the_privacy_spent(strategy, overrides, tiny_bert_dir, tiny_tasks_dir,
                                                             tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", strategy=strategy, **{**DP, **overrides})
    results = run(config)
    records = read_records(tmp_path / "run")
    uploads = _uploads(tmp_path / "run")
    assert uploads
    if strategy != "fedyolo":  # masked (int64) uploads cannot be read; their clipping is the client's, as here
        norms = [global_norm(u) for u in uploads]
        assert max(norms) <= config.dp_clip * (1 + 1e-5)
        assert any(n > 0.5 * config.dp_clip for n in norms)  # there was something to clip
    if strategy == "matu":  # per-task float vectors and heads only: no masks, rescalers or task names leave
        assert all(k.startswith(("task/", "head/")) for u in uploads for k in u)
        assert all(t.is_floating_point() for u in uploads for tv in u.values() for t in tv.values())
    population = config.client_count
    sample = max(1, math.ceil(config.participation * population - 1e-9))
    for r in records:
        p = r["privacy"]
        assert p["epsilon"] == pytest.approx(accountant.epsilon(population, sample, 0.8, r["round"], 1e-5))
        assert (p["delta"], p["noise_multiplier"], p["clip"]) == (1e-5, 0.8, 0.05)
        assert r["train_loss"] is None  # clients' training losses stay on the clients under DP
        assert (p["clipped_fraction"] is None) == (strategy == "fedyolo")
    assert results["privacy"]["epsilon"] == records[-1]["privacy"]["epsilon"]
    assert "dp-accounting" in results["privacy"]["accountant"]
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["privacy"]["epsilon"] == results["privacy"]["epsilon"]


def test_noise_moves_the_model_and_the_card_names_the_guarantee(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """The same run with and without noise (same clipping): different states; the exported card's DP section."""
    base = dict(strategy="fedavg", dp_clip=0.05, dp_noise_seed=1, export=True, rounds=1)
    quiet = run(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "quiet", dp_noise_multiplier=0.0, **base))
    noisy = run(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "noisy", dp_epsilon=8.0, **base))
    assert quiet["privacy"]["epsilon"] is None  # ∞: clipping only
    assert noisy["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3)
    assert noisy["privacy"]["target_epsilon"] == 8.0 and noisy["privacy"]["noise_multiplier"] > 0
    a = TaskVector.load(tmp_path / "quiet" / "checkpoint.safetensors")
    b = TaskVector.load(tmp_path / "noisy" / "checkpoint.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("shared"))
    card = (tmp_path / "noisy" / "adapters" / "colors" / "README.md").read_text()
    assert "## Differential privacy" in card and "dp-accounting" in card and "ε" in card


def test_flower_grid_equals_the_in_process_run_with_a_fixed_noise_seed(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    pytest.importorskip("flwr")
    from test_flower import assert_same_run, drive, tiny

    for noise in ("server", "clients"):
        config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / noise / "flower", "fedavg", rounds=1,
                      participation=0.5, dp_clip=0.05, dp_noise_multiplier=1.0, dp_noise=noise, dp_noise_seed=7)
        drive(config)
        reference = tmp_path / noise / "reference"
        run(config.__class__.from_dict({**config.to_dict(), "output_dir": str(reference)}))
        assert_same_run(reference, tmp_path / noise / "flower")


def test_the_dp_table_recipe_writes_its_table(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dp_table", Path(__file__).parents[1] / "recipes" / "dp_table.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "dp"
    flags = ["--tasks", *tiny_tasks_dir, "--base-model", tiny_bert_dir, "--base-model-id", "hf-internal/tiny-bert",
             "--num-clients", "4", "--participation", "0.5", "--rounds", "1", "--local-steps", "1", "--batch-size",
             "8", "--max-length", "16", "--min-samples", "4", "--methods", "fedavg", "--epsilons", "4", "inf",
             "--output-dir", str(out)]
    assert recipe.main(flags) == 0
    table = (out / "dp_table.md").read_text()
    assert "| fedavg |" in table and "ε = 4" in table and "ε = ∞" in table and table in capsys.readouterr().out
    cells = json.loads((out / "dp_table.json").read_text())["fedavg"]
    assert cells["4"]["privacy"]["epsilon"] == pytest.approx(4.0, rel=1e-3)
    assert cells["inf"]["privacy"]["epsilon"] is None
    assert "no DP" in table and cells["no_dp"]["privacy"] is None  # the reference run has no DP at all
    assert (out / "dp_table.png").stat().st_size > 1000
