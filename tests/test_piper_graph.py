"""A Piper voice's decoder rewritten as 2-D convolutions computes what the exported graph does:
on the product's voice (real onnxruntime, real Piper phonemes) and on small graphs with the
shapes a decoder can take; a decoder the rewrite cannot carry over is left as exported."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from media.piper_graph import UnsupportedGraph, decoder_as_2d, noiseless_inputs, voice_graph
from media.tts import Synthesizer, SynthesizerSettings, default_piper_voice, onnx_session
from tests.support import speech

pytestmark = pytest.mark.timeout(120)

RNG = np.random.default_rng(7)


def run(graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(out) for out in onnx_session(graph, 1).run(None, feeds)]


def test_the_voices_decoder_runs_as_2d_and_says_the_same(caplog: pytest.LogCaptureFixture) -> None:
    model, _config = default_piper_voice()
    voice = speech.synthesizer()._voice
    feeds = noiseless_inputs(voice, "Your parcel left the depot this morning, at nine.")
    with caplog.at_level(logging.INFO, logger="media.piper_graph"), voice_graph(model) as path:
        assert path != model
        rewritten = onnx.load(str(path))
        (as_2d, *_) = run(str(path), feeds)
    assert not path.exists()  # a temporary file, gone once the sessions are made
    assert "23 decoder convolutions run as 2-D" in caplog.text
    convolutions = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    assert all(len(n.attribute[0].ints) == 2 for n in convolutions if n.name.startswith("/dec/"))

    (exported, *_) = run(str(model), feeds)
    assert exported.shape == as_2d.shape
    assert exported.size > 22050  # over a second of speech
    assert np.abs(exported - as_2d).max() < 1e-4


def decoder_like(*, extra: onnx.NodeProto | None = None) -> onnx.ModelProto:
    """x (1, 16, T) and a conditioning g (1, 16, 1) through a decoder-shaped graph: a
    convolution, an upsampling transposed convolution, a dilated residual block, a scalar
    division, and a tensor used both inside the decoder and outside it."""
    c = 16
    weights = {
        "pre_w": RNG.normal(size=(c, c, 5)),
        "pre_b": RNG.normal(size=(c,)),
        "cond_w": RNG.normal(size=(c, c, 1)),
        "up_w": RNG.normal(size=(c, c, 8)),
        "res_w": RNG.normal(size=(c, c, 3)),
        "res_b": RNG.normal(size=(c,)),
        "three": np.array(3.0),
    }
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["x2"], name="/enc/Mul"),
        helper.make_node("Conv", ["x2", "pre_w", "pre_b"], ["pre"], name="/dec/pre", pads=[2, 2]),
        helper.make_node("Conv", ["g", "cond_w"], ["cond"], name="/dec/cond"),
        helper.make_node("Add", ["pre", "cond"], ["conditioned"], name="/dec/Add"),
        helper.make_node("LeakyRelu", ["conditioned"], ["act"], name="/dec/act", alpha=0.1),
        helper.make_node(
            "ConvTranspose", ["act", "up_w"], ["up"], name="/dec/up", strides=[4], pads=[2, 2]
        ),
        helper.make_node(
            "Conv",
            ["up", "res_w", "res_b"],
            ["res"],
            name="/dec/res",
            pads=[3, 3],
            dilations=[3],
        ),
        helper.make_node("Add", ["res", "up"], ["summed"], name="/dec/Add_1"),
        helper.make_node("Div", ["summed", "three"], ["scaled"], name="/dec/Div"),
        helper.make_node("Tanh", ["scaled"], ["audio"], name="/dec/Tanh"),
        helper.make_node("ReduceMean", ["up"], ["level"], name="/after/level", keepdims=0),
    ]
    if extra is not None:
        nodes.insert(-2, extra)
    graph = helper.make_graph(
        nodes,
        "decoder-like",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, None]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, c, 1]),
        ],
        [
            helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, c, None]),
            helper.make_tensor_value_info("level", TensorProto.FLOAT, []),
        ],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def feeds() -> dict[str, np.ndarray]:
    return {
        "x": RNG.normal(size=(1, 16, 50)).astype(np.float32),
        "g": RNG.normal(size=(1, 16, 1)).astype(np.float32),
    }


def test_a_decoder_shaped_graph_computes_the_same_in_2d(tmp_path: Path) -> None:
    model = decoder_like()
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp_path / "exported.onnx"))
    assert decoder_as_2d(model) == 4
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp_path / "rewritten.onnx"))
    inputs = feeds()
    before = run(str(tmp_path / "exported.onnx"), inputs)
    after = run(str(tmp_path / "rewritten.onnx"), inputs)
    assert [a.shape for a in before] == [a.shape for a in after] == [(1, 16, 200), ()]
    for a, b in zip(before, after, strict=True):
        assert np.abs(a - b).max() < 1e-4


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (
            helper.make_node("Transpose", ["summed"], ["flipped"], name="/dec/T", perm=[0, 2, 1]),
            "a Transpose node",
        ),
        (
            helper.make_node(
                "Constant",
                [],
                ["bias"],
                name="/dec/Constant",
                value=numpy_helper.from_array(np.ones((1, 16, 1), dtype=np.float32)),
            ),
            None,
        ),
    ],
    ids=["transpose", "unused-constant"],
)
def test_a_decoder_the_rewrite_cannot_carry_is_left_as_exported(
    extra: onnx.NodeProto, reason: str | None
) -> None:
    model = decoder_like(extra=extra)
    exported = model.SerializeToString()
    if reason is None:  # a constant with no user inside the decoder changes nothing
        assert decoder_as_2d(model) == 4
        return
    with pytest.raises(UnsupportedGraph, match=reason):
        decoder_as_2d(model)
    assert model.SerializeToString() == exported


def test_a_constant_tensor_in_the_decoder_keeps_the_graph_as_exported() -> None:
    model = decoder_like()
    bias = numpy_helper.from_array(np.ones((1, 16, 1), dtype=np.float32), "bias")
    model.graph.initializer.append(bias)
    for node in model.graph.node:
        if node.name == "/dec/Add_1":
            node.input[1] = "bias"  # (1, 16, 1) would broadcast over the wrong axis in 2-D
    exported = model.SerializeToString()
    with pytest.raises(UnsupportedGraph, match="a constant of 16 values"):
        decoder_as_2d(model)
    assert model.SerializeToString() == exported


def test_a_graph_without_a_decoder_is_given_as_it_is(tmp_path: Path) -> None:
    model = decoder_like()
    for node in model.graph.node:
        node.name = node.name.replace("/dec/", "/other/")
    path = tmp_path / "voice.onnx"
    onnx.save(model, str(path))
    with voice_graph(path) as graph:
        assert graph == path
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with voice_graph(garbage) as graph:
        assert graph == garbage  # onnxruntime will say what is wrong with it


def test_only_one_thread_sessions_run_the_rewritten_graph(caplog: pytest.LogCaptureFixture) -> None:
    """On two threads the rewritten graph is slower than the exported one: it is for one."""
    with caplog.at_level(logging.INFO, logger="media.piper_graph"):
        Synthesizer.load(SynthesizerSettings(threads=2, deterministic=True)).close()
        assert "run as 2-D" not in caplog.text
        Synthesizer.load(SynthesizerSettings(threads=1, deterministic=True)).close()
        assert "23 decoder convolutions run as 2-D" in caplog.text
