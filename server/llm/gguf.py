"""What a GGUF model file says about itself, read from its header without loading it.

llama.cpp answers a bad file with "failed to init server" and nothing more; this reader names
what is wrong (missing, not GGUF, truncated) in one line before llama.cpp is asked to load it.

Not the ``gguf`` package: its ``GGUFReader`` maps every tensor eagerly (1.8 s for SmolLM2-135M's
272 tensors on 2 cores, against 0.17 s here) and answers a truncated or foreign file with
numpy's ``ValueError`` ("cannot reshape array of size 399424 into shape (576,960)"), so the
checks that name the fault would stay; it would also bring ``requests``, ``pyyaml`` and
``tqdm`` into the server's install.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["GgufError", "GgufInfo", "read_gguf"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
ALIGNMENT = 32
"""The tensor data's default alignment (``general.alignment`` overrides it)."""

# metadata value types (gguf.h)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
_SCALARS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}

_BLOCKS: dict[int, tuple[int, int]] = {
    # ggml type: (bytes per block, elements per block); types missing here are not size-checked
    0: (4, 1),  # F32
    1: (2, 1),  # F16
    2: (18, 32),  # Q4_0
    3: (20, 32),  # Q4_1
    6: (22, 32),  # Q5_0
    7: (24, 32),  # Q5_1
    8: (34, 32),  # Q8_0
    9: (36, 32),  # Q8_1
    10: (84, 256),  # Q2_K
    11: (110, 256),  # Q3_K
    12: (144, 256),  # Q4_K
    13: (176, 256),  # Q5_K
    14: (210, 256),  # Q6_K
    15: (292, 256),  # Q8_K
    16: (66, 256),  # IQ2_XXS
    17: (74, 256),  # IQ2_XS
    18: (98, 256),  # IQ3_XXS
    19: (50, 256),  # IQ1_S
    20: (18, 32),  # IQ4_NL
    21: (110, 256),  # IQ3_S
    22: (82, 256),  # IQ2_S
    23: (136, 256),  # IQ4_XS
    24: (1, 1),  # I8
    25: (2, 1),  # I16
    26: (4, 1),  # I32
    27: (8, 1),  # I64
    28: (8, 1),  # F64
    29: (56, 256),  # IQ1_M
    30: (2, 1),  # BF16
}

_MAX_STRING = 64 << 20
"""A longer metadata string means the header is not what it claims to be."""
_MAX_DIMS = 4
"""``GGML_MAX_DIMS``: a tensor of more dimensions means a damaged header."""


class GgufError(ValueError):
    """The file cannot be a model llama.cpp loads; the message says why, in one line."""


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    version: int
    architecture: str
    name: str | None
    """``general.name``, when the file has one."""
    chat_template: str | None
    """``tokenizer.chat_template``: the Jinja template the model was trained with."""
    size_bytes: int

    @property
    def label(self) -> str:
        """How logs and the page name the model: its file's name (``general.name`` is often a
        training run's)."""
        return self.path.stem


class _Reader:
    def __init__(self, stream: BinaryIO, path: Path, size: int) -> None:
        self._stream = stream
        self._path = path
        self._size = size

    def _check_left(self, size: int) -> None:
        # checked before reading: a damaged count (an array of 2**40 floats) would otherwise
        # ask for that much memory, a MemoryError instead of this line
        if size > self._size - self._stream.tell():
            raise GgufError(f"{self._path}: truncated (the header ends early)")

    def take(self, size: int) -> bytes:
        self._check_left(size)
        data = self._stream.read(size)
        if len(data) != size:
            raise GgufError(f"{self._path}: truncated (the header ends early)")
        return data

    def skip(self, size: int) -> None:
        self._check_left(size)
        self._stream.seek(size, 1)

    def scalar(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def u32(self) -> int:
        return int(self.scalar("<I"))

    def u64(self) -> int:
        return int(self.scalar("<Q"))

    def string(self) -> str:
        length = self.u64()
        if length > _MAX_STRING:
            raise GgufError(f"{self._path}: damaged header (a {length}-byte string)")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.u32(), self.u64()
            if item_kind in _SCALARS:  # skipped whole: token tables are large
                self.skip(struct.calcsize(_SCALARS[item_kind]) * count)
                return None
            for _ in range(count):
                self.value(item_kind)
            return None
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        raise GgufError(f"{self._path}: damaged header (unknown value type {kind})")

    def tell(self) -> int:
        return self._stream.tell()


def read_gguf(path: Path) -> GgufInfo:
    """Read and check ``path``'s header and tensor table; raises :class:`GgufError` when the
    file is missing, unreadable, not GGUF, of an unknown GGUF version, or shorter than its
    tensors need (a download cut short)."""
    try:
        size = path.stat().st_size
        stream = path.open("rb")
    except FileNotFoundError:
        raise GgufError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GgufError(f"{path}: a directory, not a GGUF file") from None
    except OSError as exc:
        raise GgufError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with stream:
        reader = _Reader(stream, path, size)
        magic = stream.read(4)
        if not magic:
            raise GgufError(f"{path}: an empty file, not a GGUF model file")
        if magic != MAGIC:
            raise GgufError(
                f"{path}: not a GGUF model file (it starts with {magic!r}; llama.cpp "
                "reads .gguf files, e.g. from a model's -GGUF repository)"
            )
        version = reader.u32()
        if version not in SUPPORTED_VERSIONS:
            raise GgufError(f"{path}: GGUF version {version}, this llama.cpp reads 2 and 3")
        tensor_count, kv_count = reader.u64(), reader.u64()
        metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.u32())
        data_end = 0
        for _ in range(tensor_count):
            reader.string()  # name
            n_dims = reader.u32()
            if n_dims > _MAX_DIMS:
                raise GgufError(f"{path}: damaged header (a tensor of {n_dims} dimensions)")
            dims = [reader.u64() for _ in range(n_dims)]
            kind, offset = reader.u32(), reader.u64()
            data_end = max(data_end, offset + _tensor_bytes(kind, dims))
        alignment = metadata.get("general.alignment")
        align = alignment if isinstance(alignment, int) and alignment > 0 else ALIGNMENT
        data_start = -(-reader.tell() // align) * align
    if data_end and data_start + data_end > size:  # no tensor data: no padding needed either
        raise GgufError(
            f"{path}: truncated ({size} bytes, its tensors need {data_start + data_end}; "
            "a download cut short?)"
        )
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise GgufError(f"{path}: no general.architecture in its header: not a language model")
    name, template = metadata.get("general.name"), metadata.get("tokenizer.chat_template")
    return GgufInfo(
        path=path,
        version=version,
        architecture=architecture,
        name=name if isinstance(name, str) and name else None,
        chat_template=template if isinstance(template, str) and template else None,
        size_bytes=size,
    )


def _tensor_bytes(kind: int, dims: list[int]) -> int:
    block = _BLOCKS.get(kind)
    if block is None:
        return 0
    elements = 1
    for dim in dims:
        elements *= dim
    block_bytes, block_elements = block
    return elements // block_elements * block_bytes
