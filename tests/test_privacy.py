"""Client-level differential privacy (`hf_fedtask.privacy`): every upload clipped to C, the noise's scale on
the aggregated sums (central and in client shares), ε as dp-accounting and opacus account it, σ calibrated to
a target ε, the refusals, and the Flower Grid giving the in-process run with a fixed noise seed."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import Crash, crash_after, make_config, read_records

from hf_fedtask.core.state import GlobalState
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, unpack_vectors
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError
from hf_fedtask.privacy import accountant
from hf_fedtask.privacy.aggregation import add_central_noise, contributors
from hf_fedtask.privacy.clipping import clip_jointly, global_norm
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.privacy.noise import NoiseGenerator, add_noise, noise_generator
from hf_fedtask.privacy.report import card_rows
from hf_fedtask.privacy.sampling import secret_sample
from hf_fedtask.privacy.server import PLAN, SIGMAS, PrivateAggregation
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


def test_noise_is_chacha20_gaussian_and_leaves_torchs_generator_alone():
    """The generator is ChaCha20 (RFC 8439, A.1 test vector #1: all-zero key and nonce, block counter 0), its
    Box–Muller output is N(0, 1), seeded streams repeat and stay apart, and torch's MT19937 is not drawn from."""
    zero_key = NoiseGenerator(bytes(32)).words(8).astype("<u8").tobytes().hex()
    assert zero_key == ("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
                        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")
    z = noise_generator(3, 0, 1).standard_normal(400_001)
    assert abs(z.mean()) < 0.01 and z.std() == pytest.approx(1.0, rel=0.01)
    assert np.mean(z**4) == pytest.approx(3.0, abs=0.06) and abs(np.mean(z**3)) < 0.03  # Gaussian moments
    assert np.mean(np.abs(z) > 3) == pytest.approx(0.0027, abs=0.0006)  # and tails
    reread = noise_generator(3, 0, 1)  # one stream however it is read
    assert np.array_equal(np.concatenate([reread.standard_normal(k) for k in (1, 2, 997, 399_001)]), z)
    assert not np.array_equal(noise_generator(3, 0, 2).standard_normal(1000), z[:1000])  # another round
    assert not np.array_equal(noise_generator(None, 0, 1).standard_normal(1000), z[:1000])  # os.urandom's key
    u = noise_generator(None).uniform(100_000)
    assert u.min() >= 0 and u.max() < 1 and np.array_equal(u * 2.0**53, np.floor(u * 2.0**53))  # 53-bit grid
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    noised = add_noise({"a": _tv((1000,))}, {"a": 1.0}, noise_generator(None))
    assert torch.equal(torch.rand(3), expected) and noised["a"]["w0"].std().item() == pytest.approx(1.0, rel=0.1)


def test_the_dp_sample_is_uniform_secret_and_never_the_public_seeds():
    """Each client equally likely, another sample each draw without a noise seed; with one, reproducible and a
    function of that seed only (the run seed plays no part)."""
    counts = np.zeros(10)
    draws = [tuple(secret_sample(range(10), 3, round_=1)) for _ in range(5000)]
    for d in draws:
        counts[list(d)] += 1
    assert all(len(set(d)) == 3 for d in draws)
    assert counts / len(draws) == pytest.approx(np.full(10, 0.3), abs=0.03)
    assert len(set(draws)) > 100  # of the 120 possible samples: secret randomness every call
    assert secret_sample(range(10), 3, 4, seed=9) == secret_sample(range(10), 3, 4, seed=9)
    assert len({tuple(secret_sample(range(10), 3, r, seed=9)) for r in range(30)}) > 10
    assert secret_sample([2, 5], 4, 1) == [2, 5]  # all of them: no sample


def test_a_secure_aggregation_sum_is_the_only_upload_not_re_clipped():
    """The re-clip never trusts a client id: an upload claiming id -1 (as the secure sum once was) is clipped;
    only the round's sum, marked by the secure round (`summed`), is not."""
    s = _settings(sigma=0.0, clip=0.5)
    big = {"shared": _tv((100,), value=1.0)}
    liar = add_central_noise([ClientUpdate(-1, 1, dict(big), {"t": 1}), ClientUpdate(0, 1, dict(big), {"t": 1})],
                             s, round_=1)
    assert all(global_norm(u.vectors) == pytest.approx(0.5, rel=1e-6) for u in liar)
    (total,) = add_central_noise([ClientUpdate(-1, 1, dict(big), {})], s, round_=1, summed=True)
    assert global_norm(total.vectors) == pytest.approx(10.0)


# -- accounting ---------------------------------------------------------------------------------------------
def _log_comb(n: int, k: np.ndarray) -> np.ndarray:
    lgamma = np.vectorize(math.lgamma, otypes=[float])
    return math.lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1)


def _wbk_epsilon(population: int, sample: int, sigma: float, rounds: int, delta: float) -> float:
    """An accountant written here from the paper, not from dp-accounting's events: Wang, Balle and
    Kasiviswanathan (AISTATS 2019), Theorem 9, the RDP of a mechanism on a sample of m of n drawn without
    replacement, at integer orders α, for the Gaussian (ε(j) = j/(2s²) with s = σ/2, the noise std over the
    replace-one sensitivity 2C; ε(∞) = ∞, so every min{2, (e^ε(∞) − 1)^j} is 2), composed over the rounds and
    converted classically: ε = min_α rdp(α) + log(1/δ)/(α − 1)."""
    gamma, s = sample / population, sigma / 2
    rdp = lambda j: j / (2 * s * s)  # noqa: E731
    best = math.inf
    for alpha in range(2, 257):
        j = np.arange(3, alpha + 1)
        second = 2 * math.log(gamma) + _log_comb(alpha, np.array(2.0)) + min(
            math.log(4) + math.log(math.expm1(rdp(2))), rdp(2) + math.log(2))
        higher = j * math.log(gamma) + _log_comb(alpha, j) + (j - 1) * rdp(j) + math.log(2)
        terms = np.concatenate([[0.0, float(second)], higher])
        log_a = terms.max() + math.log(np.exp(terms - terms.max()).sum())
        best = min(best, rounds * log_a / (alpha - 1) + math.log(1 / delta) / (alpha - 1))
    return best


def _exact_gaussian_epsilon(sigmas: list[float], delta: float) -> float:
    """The exact ε at δ of rounds of the plain Gaussian mechanism with noise σ_i·C and sensitivity 2C (full
    participation): they compose to a Gaussian of μ = √Σ(2/σ_i)², whose δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)
    (Balle and Wang, "Improving the Gaussian Mechanism for Differential Privacy", ICML 2018); solved by bisection."""
    mu = math.sqrt(sum((2 / s) ** 2 for s in sigmas))
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    low, high = 0.0, 200.0
    for _ in range(200):
        eps = (low + high) / 2
        if phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) > delta:
            low = eps
        else:
            high = eps
    return low


@pytest.mark.parametrize("population,sample,sigma,rounds", [(200, 10, 2.0, 50), (50, 10, 1.3, 20), (4, 2, 0.8, 2)])
def test_sampled_epsilon_is_below_an_independent_wbk_accountant_and_close_to_it(population, sample, sigma, rounds):
    """dp-accounting's ε (its tighter RDP bound and conversion) is at most the paper's Theorem 9 bound converted
    classically, and not far below it; (200, 10, σ 2, 50 rounds) is the reviewer's federation."""
    reported = accountant.epsilon(population, sample, sigma, rounds, 1e-5)
    bound = _wbk_epsilon(population, sample, sigma, rounds, 1e-5)
    assert 0.8 * bound <= reported <= bound


@pytest.mark.parametrize("sigmas", [[1.3] * 20, [4.63] * 4, [0.8], [2.0] * 3 + [3.5] * 7])
def test_unsampled_epsilon_is_above_the_exact_gaussian_one_and_close_to_it(sigmas):
    """With every client in every round the exact (ε, δ) of the composed Gaussians is known: the RDP ε reported for
    the same schedule is an upper bound on it, within 10%."""
    exact = _exact_gaussian_epsilon(sigmas, 1e-5)
    reported = accountant.schedule_epsilon(8, 8, sigmas, 1e-5)
    assert exact <= reported <= 1.1 * exact


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
    running = accountant.RunningAccountant(50, 10, delta)
    assert [running.epsilon([sigma] * r) for r in (1, 2)] == pytest.approx(
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
    for bad in ({"dp_clip": 0.0}, {"dp_delta": 0.0}, {"dp_delta": 1.0}, {"dp_noise": "both"},
                {"dp_noise_multiplier": -1.0}):
        with pytest.raises(ConfigError, match=rf"^config: {next(iter(bad))}: must be"):
            make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, **bad)
    from hf_fedtask.config import RunConfig
    from hf_fedtask.core.fields import allowed_values

    delta = next(f for f in dataclasses.fields(RunConfig) if f.name == "dp_delta")
    assert allowed_values(delta) == "(in (0.0, 1.0))"  # what --help says: 1 is refused
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, strategy="fedyolo", dp_clip=1.0,
                         dp_noise_multiplier=1.0, strategy_options={"sample_weighted": True})
    with pytest.raises(ConfigError, match=r"^sample_weighted: strategy 'fedyolo' cannot weight by sample counts"):
        resolve_privacy(config, build_strategy("fedyolo", {"sample_weighted": True}), 4, 4)


def test_clients_noise_without_secure_aggregation_and_matu_rho_are_refused(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    dp = {"dp_clip": 1.0, "dp_noise_multiplier": 1.0}

    def resolve(strategy, options=None, **settings):
        config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, strategy=strategy,
                             strategy_options=options or {}, **{**dp, **settings})
        return resolve_privacy(config, build_strategy(strategy, options or {}), 4, 4)

    for strategy in ("fedavg", "fedyolo"):  # the server would see each upload with its own share of noise only
        with pytest.raises(ConfigError, match=rf"^dp_noise: clients needs secure aggregation, which strategy "
                                              rf"'{strategy}' does not use here: [^\n]+$"):
            resolve(strategy, dp_noise="clients")
    assert resolve("fedyolo", {"secure_aggregation": True}, dp_noise="clients").noise == "clients"
    with pytest.raises(ConfigError, match=r"^rho: 0.6 has no effect under client-level DP \(Eq. 3[^\n]+: drop rho "
                                          r"or set it to 0$"):
        resolve("matu", {"rho": 0.6})
    for options in ({}, {"rho": 0.0}):  # not given (the paper's default does not apply), or 0: DP's mask of 1
        assert resolve("matu", options) is not None


def test_a_target_run_resumed_for_more_rounds_recalibrates_or_refuses():
    """The reviewer's case, target ε = 4 over 10 rounds resumed for 20 (8 clients, all in every round; a sampled
    federation calibrates the same way, in seconds per search): crashed after 5, the 15 remaining rounds take the
    σ that makes the 20, each at its own σ, spend the target; finished, the budget is spent and the resumption
    refused in one line. The ε is recomputed here round by round, and bounded by the exact Gaussian one."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    n, m, delta = 8, 8, 1e-5
    sigma10 = accountant.calibrate(n, m, 10, 4.0, delta)
    ten = PrivacySettings(clip=1.0, noise_multiplier=sigma10, delta=delta, noise="server", noise_seed=None,
                          population=n, sample=m, rounds=10, target_epsilon=4.0)
    twenty = PrivateAggregation(build_strategy("fedavg", {}), dataclasses.replace(ten, rounds=20))
    plan = {PLAN: {"rounds": 10, "noise_multiplier": sigma10}}
    half = GlobalState(5, {}, {SIGMAS: [sigma10] * 5, **plan})
    assert PrivateAggregation(build_strategy("fedavg", {}), ten).sigma(half) == sigma10  # same length: as planned
    sigma = twenty.sigma(half)
    ref = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for s in [sigma10] * 5 + [sigma] * 15:
        ref.compose(dp_accounting.GaussianDpEvent(s / 2))
    assert sigma > sigma10 and ref.get_epsilon(delta) == pytest.approx(4.0, rel=2e-3)
    assert _exact_gaussian_epsilon([sigma10] * 5 + [sigma] * 15, delta) <= ref.get_epsilon(delta) <= 4.0 * (1 + 1e-9)
    assert accountant.RunningAccountant(n, m, delta).epsilon([sigma10] * 5 + [sigma] * 15) == pytest.approx(
        ref.get_epsilon(delta), rel=1e-9)
    # composing all 20 rounds at the new σ, as the running accountant once did, under-reports what was spent
    assert accountant.epsilon(n, m, sigma, 20, delta) < 0.97 * ref.get_epsilon(delta)
    done = GlobalState(10, {}, {SIGMAS: [sigma10] * 10, **plan})
    with pytest.raises(ConfigError, match=r"^dp_epsilon: the 10 round\(s\) run spent ε = [\d.]+ of the target 4 at "
                                          r"δ = 1e-05: nothing is left for 10 more \(rounds 20\)$"):
        twenty.sigma(done)
    with pytest.raises(ConfigError, match=r"^dp_clip: the state this run continues from has 3 round\(s\) without "
                                          r"a recorded noise multiplier [^\n]+$"):
        twenty.sigma(GlobalState(3, {}, {}))  # e.g. a warm start from a run without DP


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


def test_a_resumed_run_reports_the_epsilon_of_the_sigmas_its_rounds_used(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """Target ε = 4 over 3 rounds, crashed after round 1, resumed for 5: rounds 2-5 recalibrated, the ε reported
    equals dp-accounting composing each round's Gaussian at its recorded σ (and lies above the exact ε of those
    Gaussians); extended again once finished, the run is refused in one line with nothing written."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from hf_fedtask.core.files import LOCK_FILE

    out = tmp_path / "run"
    base = dict(strategy="fedavg", dp_clip=0.05, dp_epsilon=4.0, dp_noise_seed=2, rounds=3, eval_every=100)
    with pytest.raises(Crash):
        run(make_config(tiny_bert_dir, tiny_tasks_dir, out, **base), callbacks=[crash_after(1)])
    results = run(make_config(tiny_bert_dir, tiny_tasks_dir, out, **{**base, "rounds": 5}), resume=True)
    sigmas = [r["privacy"]["noise_multiplier"] for r in read_records(out)]
    assert sigmas[0] == accountant.calibrate(4, 4, 3, 4.0, 1e-5) < sigmas[1]
    assert len(sigmas) == 5 and len(set(sigmas[1:])) == 1 and results["privacy"]["noise_multipliers"] == sigmas
    ref = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for s in sigmas:
        ref.compose(dp_accounting.GaussianDpEvent(s / 2))
    eps = results["privacy"]["epsilon"]
    assert eps == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9) and eps == pytest.approx(4.0, rel=2e-3)
    assert _exact_gaussian_epsilon(sigmas, 1e-5) <= eps <= 4.0 * (1 + 1e-9)
    assert "in round 1, " in dict(card_rows(results["privacy"]))["Noise"]
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE}
    with pytest.raises(ConfigError, match=r"^dp_epsilon: the 5 round\(s\) run spent ε = [\d.]+ of the target 4 at "
                                          r"δ = 1e-05: nothing is left for 2 more \(rounds 7\)$"):
        run(make_config(tiny_bert_dir, tiny_tasks_dir, out, **{**base, "rounds": 7}), resume=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE} == before


def test_a_sampled_run_keeps_its_sample_secret_and_lists_what_is_published_outside_epsilon(tiny_bert_dir,
                                                                                          tiny_tasks_dir, tmp_path):
    """Without a noise seed the sample is secret (another one each draw, never the seeded one of a run without DP),
    the rounds' ids stay under `private` in metrics.jsonl, and results.json and the card say so."""
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.server import Server

    out = tmp_path / "run"
    config = make_config(tiny_bert_dir, tiny_tasks_dir, out, participation=0.5, dp_clip=0.05,
                         dp_noise_multiplier=1.0, rounds=2, export=True)
    server = Server(Environment(config))
    assert len({tuple(server.sample_clients(1)) for _ in range(30)}) > 1
    plain = Server(Environment(make_config(tiny_bert_dir, tiny_tasks_dir, out, participation=0.5)))
    seeded = sorted(int(c) for c in np.random.default_rng([0, 1]).choice(4, size=2, replace=False))
    assert [plain.sample_clients(1) for _ in range(3)] == [seeded] * 3  # without DP: seeded and public, as before
    results = run(config)
    for r in read_records(out):
        assert not {"clients", "failed_clients", "bytes_per_client"} & set(r) and r["replied"] == 2
        assert len(r["private"]["clients"]) == 2 and set(r["private"]["bytes_per_client"]) == {
            str(c) for c in r["private"]["clients"]}
    saved = (out / "results.json").read_text()
    assert '"private"' not in saved and json.loads(saved)["privacy"] == results["privacy"]
    privacy = results["privacy"]
    assert privacy["secret_sample"] is True and "drawn secretly" in privacy["sampling"]
    clipped, replied, counts = privacy["outside_epsilon"]
    assert "clipped_fraction" in clipped and "replied" in replied and "byte" in counts
    card = (out / "adapters" / "colors" / "README.md").read_text()
    assert "drawn secretly" in card and "Published outside ε" in card and "clipped_fraction" in card


def test_flower_grid_equals_the_in_process_run_with_a_fixed_noise_seed(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    pytest.importorskip("flwr")
    from test_flower import assert_same_run, drive, tiny

    # the clients mode needs secure aggregation (FedYolo's variant): masked uploads differ, the noisy sum does not
    for noise, strategy, options in (("server", "fedavg", {}), ("clients", "fedyolo", {"secure_aggregation": True})):
        config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / noise / "flower", strategy, options, rounds=1,
                      participation=0.5, dp_clip=0.05, dp_noise_multiplier=1.0, dp_noise=noise, dp_noise_seed=7)
        drive(config)
        reference = tmp_path / noise / "reference"
        run(config.__class__.from_dict({**config.to_dict(), "output_dir": str(reference)}))
        assert_same_run(reference, tmp_path / noise / "flower", same_uplinks=noise == "server")


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
