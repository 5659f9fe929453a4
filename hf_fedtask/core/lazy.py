"""Package attributes imported on first use (PEP 562), the one mechanism behind every lazy package of
hf_fedtask: a package names what its submodules define and gets a module `__getattr__` and `__dir__`,
so that importing it (for `hf-fedtask --help`, `RunConfig`, a Flower ClientApp process) loads no torch
until a heavy name is read."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_attributes(package: str, names: Mapping[str, str], before: Callable[[], object] | None = None):
    """`(__getattr__, __dir__)` for `package`, whose `names` (name -> submodule) are imported from those
    submodules when first read and then kept as ordinary attributes; `before` runs before each first
    read (e.g. registering every strategy before any is handed out)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if before is not None:
            before()
        value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
