"""How a DP run reports the privacy it spent and keeps the rest to itself: results.json's `privacy` entry (from the
settings and the rounds' records), the model card's "Differential privacy" section (from that entry), and the
round record with the sampled clients kept under `private`.

Under DP each round's sample is secret (`hf_fedtask.privacy.sampling`), so the ids of the clients sampled, of
those that failed and each client's byte counts move under the record's `private` key (`private_record`): the
server's own metrics.jsonl and checkpoint keep them, nothing published reads them (results.json, model cards and
Hub READMEs take only the `privacy` entry and run totals). What is published outside ε is listed in the entry
(`outside_epsilon`) and on the card.
"""

from __future__ import annotations

import itertools

import numpy as np

from hf_fedtask.privacy.settings import PrivacySettings

ADJACENCY = ("client-level (user-level): neighbouring federations differ in one client's whole data, replaced "
             "(the number of clients is public)")
PRIVATE = "private"  # the round record's key holding what only the server may read
PRIVATE_FIELDS = ("clients", "failed_clients", "bytes_per_client")
REPLIED = "replied"  # the public count of clients that replied in a DP round (the ids are private)


def private_record(record: dict) -> dict:
    """`record` (a round's metrics) with the sampled clients' ids, failures and per-client bytes under `private`
    and only the number of clients that replied left public (`replied`)."""
    out = {k: v for k, v in record.items() if k not in PRIVATE_FIELDS}
    out[REPLIED] = len(record.get("clients", []))
    out[PRIVATE] = {k: record[k] for k in PRIVATE_FIELDS if k in record}
    return out


def round_clients(record: dict) -> list[int]:
    """The ids of the clients that replied in a round, from its record, DP or not (for the server's own use)."""
    return record["clients"] if "clients" in record else record[PRIVATE]["clients"]


def privacy_results(settings: PrivacySettings | None, history: list[dict]) -> dict:
    """`{"privacy": ...}` for results.json ({} when DP is off): ε after the last round (None: ∞, no noise), the σ each
    round used (`noise_multiplier` the last, `noise_multipliers` per round where they differ), the mechanism, the
    sampling and whether it is secret, the accountant, and what is published outside ε."""
    records = [h["privacy"] for h in history if "privacy" in h]
    if settings is None or not records:
        return {}
    clipped = [r["clipped_fraction"] for r in records if r.get("clipped_fraction") is not None]
    sigmas = [r["noise_multiplier"] for r in records]
    outside = (["the share of uploads clipped each round (clipped_fraction, un-noised; its mean here)"] if clipped
               else [])
    outside += ["the number of clients that replied each round (dropouts)",
                "byte and parameter counts of the uploads and downloads"]
    return {"privacy": {"epsilon": records[-1]["epsilon"], **settings.describe(), "noise_multiplier": sigmas[-1],
                        **({"noise_multipliers": sigmas} if len(set(sigmas)) > 1 else {}),
                        "rounds": len(records), "adjacency": ADJACENCY,
                        "mean_clipped_fraction": float(np.mean(clipped)) if clipped else None,
                        "outside_epsilon": outside}}


def card_rows(privacy: dict) -> list[tuple[str, str]]:
    """The model card's DP table from results.json's `privacy` entry."""
    eps = privacy["epsilon"]
    rows = [("Guarantee", f"(ε = {'∞' if eps is None else f'{eps:.3g}'}, δ = {privacy['delta']:g}) after "
                          f"{privacy['rounds']} rounds"),
            ("Adjacency", privacy["adjacency"]),
            ("Clipping", f"each client's whole upload to L2 norm C = {privacy['clip']:g}"),
            ("Noise", f"Gaussian, std σ·C on every aggregated sum, σ = {_sigmas(privacy)} "
                      f"(drawn on the {privacy['noise']}; seed: {privacy['noise_seed']})"
                      + (f", calibrated to target ε = {privacy['target_epsilon']:g}"
                         if privacy.get("target_epsilon") else "")),
            ("Sampling", privacy["sampling"]),
            ("Accountant", privacy["accountant"])]
    if privacy.get("outside_epsilon"):
        rows.append(("Published outside ε", "; ".join(privacy["outside_epsilon"])))
    return rows


def _sigmas(privacy: dict) -> str:
    """σ, or σ per run of rounds when a resumed run changed it (`1.2 in rounds 1–5, 1.5 in rounds 6–20`)."""
    per_round = privacy.get("noise_multipliers")
    if not per_round:
        return f"{privacy['noise_multiplier']:.4g}"
    parts, first = [], 1
    for sigma, group in itertools.groupby(per_round):
        last = first + len(list(group)) - 1
        parts.append(f"{sigma:.4g} in rounds {first}–{last}" if last > first else f"{sigma:.4g} in round {first}")
        first = last + 1
    return ", ".join(parts)
