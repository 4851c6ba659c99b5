"""``server.llm.gguf``: a model file's header read (and its faults named) before llama.cpp
loads it; and what llama.cpp says of a file whose header reads well but names an architecture it
does not know."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from server.llm.gguf import GgufError, read_gguf
from server.llm.llamacpp import EmbeddedLLM, EmbeddedSettings, ModelLoadError
from tests.conftest import EXAMPLES
from tests.support.models import smollm2_copy, smollm2_gguf, with_architecture

pytestmark = pytest.mark.timeout(30)

HEADER_CUT = 4096
"""Bytes kept of a file cut in its header: past the counts, inside the metadata (the token
table alone is hundreds of kB)."""


def gguf_header(entries: dict[str, bytes], tensors: bytes = b"", tensor_count: int = 0) -> bytes:
    """A GGUF v3 header of ``entries`` (key -> its type and value, packed) and ``tensors`` (the
    packed tensor infos)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, len(entries))
    for key, typed_value in entries.items():
        out += struct.pack("<Q", len(key)) + key.encode() + typed_value
    return out + tensors


def string_value(text: str) -> bytes:
    return struct.pack("<IQ", 8, len(text)) + text.encode()


def one_line_about(path: Path, err: GgufError) -> str:
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    return message


def test_the_test_model_reads_as_a_llama_chat_model() -> None:
    path = smollm2_gguf()

    info = read_gguf(path)

    assert info.path == path
    assert info.version == 3
    assert info.architecture == "llama"
    assert info.chat_template is not None
    assert "<|im_start|>" in info.chat_template  # ChatML, as SmolLM2 was trained
    assert info.name is not None
    assert info.label == "SmolLM2-135M-Instruct.Q4_1"  # the file's name, not general.name
    assert info.size_bytes == path.stat().st_size


# -- files that are not a model llama.cpp loads ----------------------------------------------------


def missing(tmp_path: Path) -> Path:
    return tmp_path / "absent.gguf"


def directory(tmp_path: Path) -> Path:
    path = tmp_path / "models.gguf"
    path.mkdir()
    return path


def foreign(tmp_path: Path) -> Path:
    """A playbook named like a model."""
    path = tmp_path / "support.gguf"
    path.write_text("name: support\n" + (EXAMPLES / "support.yaml").read_text())
    return path


def empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    return path


def cut_in_header(tmp_path: Path) -> Path:
    return smollm2_copy(tmp_path / "cut.gguf", HEADER_CUT)


def bad_version(tmp_path: Path) -> Path:
    path = smollm2_copy(tmp_path / "v4.gguf", HEADER_CUT)
    with path.open("r+b") as stream:
        stream.seek(4)
        stream.write(struct.pack("<I", 4))
    return path


def no_architecture(tmp_path: Path) -> Path:
    path = tmp_path / "nameless.gguf"
    path.write_bytes(gguf_header({"general.name": string_value("no architecture here")}))
    return path


def damaged_array_count(tmp_path: Path) -> Path:
    """An array of 2**40 float32 in a 60-byte file: read as written, a 4 TiB allocation."""
    path = tmp_path / "damaged-count.gguf"
    scores = struct.pack("<IIQ", 9, 6, 1 << 40)
    path.write_bytes(gguf_header({"tokenizer.ggml.scores": scores}))
    return path


def damaged_dimensions(tmp_path: Path) -> Path:
    """A tensor of 2**31 dimensions (ggml has at most 4)."""
    path = tmp_path / "damaged-dims.gguf"
    tensor = struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1 << 31) + b"\0" * 64
    entries = {"general.architecture": string_value("llama")}
    path.write_bytes(gguf_header(entries, tensor, tensor_count=1))
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (missing, "no such file"),
        (directory, "a directory, not a GGUF file"),
        (foreign, "not a GGUF model file (it starts with b'name'"),
        (empty, "an empty file, not a GGUF model file"),
        (cut_in_header, "truncated (the header ends early)"),
        (bad_version, "GGUF version 4, this llama.cpp reads 2 and 3"),
        (no_architecture, "no general.architecture in its header"),
        (damaged_array_count, "truncated (the header ends early)"),
        (damaged_dimensions, "damaged header (a tensor of 2147483648 dimensions)"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_a_file_llama_cpp_cannot_load_is_named_in_one_line(
    tmp_path: Path, make: Callable[[Path], Path], says: str
) -> None:
    path = make(tmp_path)

    with pytest.raises(GgufError) as caught:
        read_gguf(path)

    assert says in one_line_about(path, caught.value)


def test_a_file_cut_in_its_tensor_data_says_how_much_is_missing(tmp_path: Path) -> None:
    whole = smollm2_gguf().stat().st_size
    kept = whole // 2
    path = smollm2_copy(tmp_path / "half.gguf", kept)

    with pytest.raises(GgufError) as caught:
        read_gguf(path)

    message = one_line_about(path, caught.value)
    match = re.search(
        r"truncated \((\d+) bytes, its tensors need (\d+); a download cut short\?\)", message
    )
    assert match is not None, message
    assert int(match.group(1)) == kept
    assert kept < int(match.group(2)) <= whole


def test_a_file_missing_only_its_last_bytes_is_truncated(tmp_path: Path) -> None:
    path = smollm2_copy(tmp_path / "short.gguf", smollm2_gguf().stat().st_size - 1)

    with pytest.raises(GgufError, match="its tensors need"):
        read_gguf(path)


# -- an architecture llama.cpp does not know ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_unknown_architecture_reads_but_llama_cpp_refuses_it_by_name(tmp_path: Path) -> None:
    path = with_architecture(smollm2_copy(tmp_path / "llamz.gguf"), "llamz")

    info = read_gguf(path)
    assert info.architecture == "llamz"
    with pytest.raises(ModelLoadError) as caught:
        EmbeddedLLM.start(info, EmbeddedSettings(threads=1, slots=1))

    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: llama.cpp cannot load it")
    assert "architecture 'llamz'" in message
