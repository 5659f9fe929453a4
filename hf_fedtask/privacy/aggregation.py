"""The server's part of client-level DP, between receiving the uploads and the strategy's `private_aggregate`:
uniform weights (sample counts replaced by 1 per task held), the central noise on every sum, and, in the
`clients` noise mode, the noise of dropped clients made up.

Every strategy that supports DP aggregates by summing each entry (the shared modules, a task's head, a
slot) over its contributors, so noise on a sum can ride on the contributors' uploads: in the `server` mode
each of the r received contributors to an entry gets a share N(0, σ²C²/r) (a secure-aggregation sum, one
update, gets all of N(0, σ²C²)); their sum carries exactly the central noise. Every individual upload is
re-clipped first, whatever client id it names; only a secure-aggregation sum, which the secure round marks
as such (`summed`), is not (its addends were clipped on their clients; the server cannot clip a sum, so
under secure aggregation a client that skips clipping is not caught). In the `clients` mode the h
contributors the server instructed added their shares themselves; a client that drops leaves its share
out, so the sum would carry less noise than accounted: the server adds the missing (h − r)/h of the variance
to the sum. The released model then carries the accounted noise, but the server itself decoded a sum with
the survivors' shares only: against the server, dropouts weaken the clients mode's guarantee (in proportion
to the share of contributors lost).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.privacy.clipping import clip_jointly
from hf_fedtask.privacy.noise import SERVER, SERVER_STREAM, add_noise, noise_generator, share_std
from hf_fedtask.privacy.upload import CLIPPED


def contributors(layouts: Mapping[int, Iterable[str]], public: Iterable[str] = ()) -> dict[str, int]:
    """Each entry's number of contributors among the clients whose upload entries are `layouts`."""
    public, out = set(public), {}
    for names in layouts.values():
        for name in names:
            if name not in public:
                out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def uniform(updates: list[ClientUpdate]) -> list[ClientUpdate]:
    """The updates with sample count 1 for every task held: under DP every contributor weighs the same
    (the server enforces it whatever a client reports)."""
    return [dataclasses.replace(u, num_samples={t: 1 for t in u.num_samples}) for u in updates]


def clipped_fraction(updates: list[ClientUpdate]) -> float | None:
    """The share of the uploads their clients clipped (None when no upload says: a secure-aggregation sum)."""
    flags = [u.metrics[CLIPPED] for u in updates if CLIPPED in u.metrics]
    return float(sum(flags) / len(flags)) if flags else None


def add_central_noise(updates: list[ClientUpdate], settings, round_: int, public: Iterable[str] = (),
                      instructed: Mapping[str, int] | None = None,
                      received: Mapping[str, int] | None = None, summed: bool = False) -> list[ClientUpdate]:
    """`updates` (clipped; the one sum under secure aggregation, `summed`) whose per-entry sums carry N(0, σ²C²):
    the server mode draws it here (re-clipping every individual upload first, so a client that skipped clipping
    cannot raise the sensitivity); the clients mode adds what dropped contributors left out (`instructed`: h per
    entry, `received`: r per entry when `updates` is a single sum; else counted from `updates`)."""
    public = set(public)
    sigma, clip = settings.noise_multiplier, settings.clip
    counts = contributors({i: u.vectors for i, u in enumerate(updates)}, public)
    generator = noise_generator(settings.noise_seed, SERVER_STREAM, round_)
    if settings.noise == SERVER:
        out = list(updates)
        for i in sorted(range(len(updates)), key=lambda i: updates[i].client_id):  # noise drawn in client order
            u = updates[i]
            vectors = u.vectors if summed else clip_jointly(u.vectors, clip, skip=public)[0]
            stds = {n: share_std(sigma, clip, counts[n]) for n in vectors if n not in public}
            out[i] = dataclasses.replace(u, vectors=add_noise(vectors, stds, generator))
        return out
    got = dict(received) if received is not None else counts
    missing = {n: sigma * clip * math.sqrt((h - got.get(n, 0)) / h)
               for n, h in (instructed or {}).items() if got.get(n, 0) < h and n in counts}
    if not missing:
        return updates
    out = list(updates)
    for n in sorted(missing):  # onto the first contributor's entry: the sum is what counts
        i = next(i for i, u in enumerate(out) if n in u.vectors)
        out[i] = dataclasses.replace(out[i], vectors=add_noise(out[i].vectors, {n: missing[n]}, generator))
    return out
