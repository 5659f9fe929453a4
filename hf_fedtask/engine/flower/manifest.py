"""The Flower app manifest (the `pyproject.toml` that `flwr run APP_DIR` bundles into a FAB).

The FAB carries no code: its components point into the installed `hf_fedtask` package, and it
declares no runtime dependencies, since SuperLinks run with `--disable-runtime-dependency-installation`
and the package is installed beside Flower. The repository's `flower-app/pyproject.toml` is this
manifest written down (a test keeps the two equal); `write_app_dir` makes one anywhere, e.g. for an
installed package without the repository.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w

from hf_fedtask.engine.flower.settings import AppSettings

APP_NAME = "hf-fedtask-flower"  # FAB names: letters, digits and hyphens, starting with a letter
PUBLISHER = "hf-fedtask"
DESCRIPTION = "hf_fedtask federated runs on Flower SuperNodes (the code is the installed hf_fedtask package)"


def manifest() -> dict:
    from hf_fedtask import __version__

    return {
        "project": {
            "name": APP_NAME,
            "version": __version__,
            "description": DESCRIPTION,
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {"flwr": {"app": {
            "publisher": PUBLISHER,
            "components": {
                "serverapp": "hf_fedtask.engine.flower.app:server_app",
                "clientapp": "hf_fedtask.engine.flower.app:client_app",
            },
            "config": AppSettings.defaults(),
        }}},
    }


def write_app_dir(folder: str | Path) -> Path:
    """Write the manifest as `folder/pyproject.toml` (the folder's name must be a valid app name for
    `flwr build`: letters, digits and hyphens)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(tomli_w.dumps(manifest()))
    return folder
