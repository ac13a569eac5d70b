"""The header every result JSON of bench/ starts with (date, commit, GPU, jax, jaxlib)."""

from __future__ import annotations

import datetime
import os
import subprocess

import jax


def tree_commit() -> str:
    """``NVFP4_COMMIT`` if set, else ``git rev-parse HEAD`` of this checkout.

    The environment comes first: a copied working tree can carry a .git that describes another
    commit than the files that were copied.
    """
    commit = os.environ.get("NVFP4_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                check=False,
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
        except OSError:
            commit = ""
    return commit or "unknown (tree without git history)"


def run_metadata() -> dict:
    import jaxlib

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "commit": tree_commit(),
        "gpu": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
