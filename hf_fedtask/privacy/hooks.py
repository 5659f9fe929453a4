"""Hook of `Capabilities.client_dp`: what a strategy declares so that its run can be client-level DP.

A supporting strategy's aggregation must be a function of per-entry sums of its clients' uploads, each
client weighing the same in every sum it contributes to, divided by data-independent counts (sampled
contributors), followed by any post-processing (MaTU's cross-task step). The defaults suit a strategy whose
uploads are already plain float vectors and whose `server_aggregate` is such a uniform mean; a strategy
overrides what differs: an upload form that packs data-dependent values the mechanism cannot clip or noise
(`private_upload`, `private_templates`), a weighted or non-linear aggregation (`private_aggregate`), entries
computed from public information only (`public_entries`), options it cannot honour under DP (`check_private`).
"""

from __future__ import annotations

from typing import ClassVar

from hf_fedtask.core.wire import ClientUpdate


class ClientPrivacy:
    """Mixin of the strategies that declare `capabilities.client_dp` (see the module docstring)."""

    # upload entries computed from public information alone (e.g. FedYolo's slot counts): never clipped or noised
    public_entries: ClassVar[tuple[str, ...]] = ()

    def check_private(self, config) -> None:
        """Refuse (ConfigError, one line) options of this strategy or run that DP cannot honour."""

    def private_upload(self, update: ClientUpdate, job) -> ClientUpdate:
        """The client's upload under DP (runs on the client, before clipping): every data-dependent value a
        float vector entry; the upload as it is by default."""
        return update

    def private_templates(self, state, client_id: int, tasks: list[str]) -> dict:
        """The layout of `private_upload`'s output (keys, shapes, dtypes); `update_templates` by default."""
        return self.update_templates(state, client_id, tasks)

    def private_aggregate(self, state, updates: list[ClientUpdate]):
        """The server step under DP from clipped, noised uploads whose sample counts are 1 per task held;
        `server_aggregate` by default (for strategies whose aggregation is already a uniform mean)."""
        return self.server_aggregate(state, updates)
