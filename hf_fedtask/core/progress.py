"""Progress bars for the phases of a run that take time (scoring, generation, export, conversion): tqdm.auto
bars on stderr, as the training loop's, so stdout keeps only what a command prints as its result.

A bar waits PROGRESS_DELAY seconds before it appears (tqdm's `delay`): quick phases stay quiet, and anything
slower (a causal LM, a large split, thirty adapters) shows how far it is."""

from __future__ import annotations

from collections.abc import Iterable

from tqdm.auto import tqdm

PROGRESS_DELAY = 2.0
"""Seconds a phase with a progress bar runs before the bar appears (tqdm's `delay`)."""


def progress_bar(iterable: Iterable | None = None, *, desc: str, delay: float | None = None, **kwargs) -> tqdm:
    """A tqdm bar on stderr named `desc`, shown after `delay` seconds (default PROGRESS_DELAY); `kwargs` go
    to tqdm (`total`, `unit`, `leave`, `disable`, ...)."""
    return tqdm(iterable, desc=desc, delay=PROGRESS_DELAY if delay is None else delay, dynamic_ncols=True, **kwargs)

