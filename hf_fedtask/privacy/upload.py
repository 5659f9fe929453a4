"""What a client does to its upload under client-level DP, after the strategy's `client_update`: the
strategy's DP form (`private_upload`), every entry but the public ones clipped jointly to L2 norm C, in the
`clients` noise mode its share of each sum's noise added, and the data-dependent side values replaced: sample
counts by 1 per task held (the tasks held are the public allocation; aggregation weights are uniform under
DP) and the training metrics by whether the upload was clipped (train losses stay on the client).

`PrivacyStep` is that step as a client applies it after `client_update`, as Flower's `fixedclipping_mod` follows a
ClientApp (a secure-aggregation masking step, if any, comes after it)."""

from __future__ import annotations

import dataclasses

from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.privacy.clipping import clip_jointly
from hf_fedtask.privacy.noise import CLIENT_STREAM, add_noise, noise_generator, share_std

CLIPPED = "dp/clipped"  # the one metric an upload carries under DP: 1.0 when it was clipped
SHARES = "dp_shares"  # instruction config in the clients mode: {"noise_multiplier": σ, "contributors": {entry: h}}


def private_update(strategy, update: ClientUpdate, job, clip: float, shares: dict | None = None,
                   noise_seed: int | None = None) -> ClientUpdate:
    """`update` as a client sends it under DP (see the module docstring); `shares`: the clients-mode
    instruction (σ and each entry's number of contributors h: this client adds N(0, σ²C²/h) to each)."""
    update = strategy.private_upload(update, job)
    vectors, _, clipped = clip_jointly(update.vectors, clip, skip=strategy.public_entries)
    if shares:
        sigma, contributors = float(shares["noise_multiplier"]), shares["contributors"]
        stds = {name: share_std(sigma, clip, int(contributors[name])) for name in vectors
                if name in contributors and name not in strategy.public_entries}
        vectors = add_noise(vectors, stds, noise_generator(noise_seed, CLIENT_STREAM, job.round, job.client_id))
    return dataclasses.replace(update, vectors=vectors, num_samples={t: 1 for t in update.num_samples},
                               metrics={CLIPPED: float(clipped)})


class PrivacyStep:
    """A client's DP step: `private_update` with the run's clip C and noise seed, and the instruction's shares in the
    clients mode (`SHARES` of its config)."""

    def __init__(self, strategy, clip: float, noise_seed: int | None = None):
        self.strategy, self.clip, self.noise_seed = strategy, clip, noise_seed

    def __call__(self, update: ClientUpdate, ins, job) -> ClientUpdate:
        return private_update(self.strategy, update, job, self.clip, ins.config.get(SHARES), self.noise_seed)
