"""A Piper voice's ONNX graph with its decoder's convolutions in onnxruntime's fastest CPU form.

Most of a Piper (VITS) synthesis is its decoder's 1-D convolutions: HiFi-GAN's upsampling and
residual blocks, run at up to the audio's sample rate. onnxruntime runs a 1-D convolution as an
im2col copy and a matrix product; a 2-D one whose channels are a multiple of its SIMD block
goes to its NCHWc kernels (direct convolution over channel-blocked tensors). Giving the
decoder's tensors a height of 1 is the same arithmetic in the other kernel: on one AVX-512
thread, a 4.6 s sentence's decoder takes ~231 ms instead of ~287 (the whole synthesis ~340
instead of ~405), and the audio differs from the original graph's by ~1e-6 of full scale. On
two threads the rewritten graph was 12-19 % slower: :mod:`media.tts` runs it on one.

:func:`voice_graph` rewrites a voice's decoder (the nodes under ``/dec/``, as Piper exports
them) when every node there is a convolution or an element-wise operation with scalar
constants, and leaves the graph as it is otherwise.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx

__all__ = [
    "DECODER_PREFIX",
    "decoder_as_2d",
    "graph_feed",
    "noiseless_inputs",
    "split_at_decoder",
    "voice_graph",
]

log = logging.getLogger(__name__)

DECODER_PREFIX = "/dec/"
"""The name prefix of a Piper voice's decoder nodes (its VITS generator, exported by PyTorch)."""

_CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "LeakyRelu", "Relu", "Tanh", "Constant"})
_SPATIAL_ATTRIBUTES = {"kernel_shape": 1, "strides": 1, "dilations": 1, "output_padding": 0}
_HEIGHT_AXIS = 2


class UnsupportedGraph(ValueError):
    """The decoder holds a node that the rewrite cannot carry over to 2-D."""


@contextmanager
def voice_graph(model: Path) -> Iterator[Path]:
    """The voice ``model``'s graph for onnxruntime, while inside: a temporary file of it with
    its decoder rewritten (:func:`decoder_as_2d`), or ``model`` itself when there is nothing to
    rewrite or the rewrite does not apply (logged). A file rather than bytes: a session made
    from bytes keeps them for its life (another copy of the weights)."""
    import onnx

    rewritten = 0
    try:
        graph = onnx.load(str(model))
    except Exception:  # not a readable ONNX file: onnxruntime will say what is wrong with it
        log.debug("Piper voice %s: not read as ONNX", model.name, exc_info=True)
    else:
        try:
            rewritten = decoder_as_2d(graph)
        except UnsupportedGraph as error:
            log.info("Piper voice %s: decoder kept as exported (%s)", model.name, error)
        except Exception:
            log.warning("Piper voice %s: decoder kept as exported", model.name, exc_info=True)
    if not rewritten:
        yield model
        return
    log.info("Piper voice %s: %d decoder convolutions run as 2-D", model.name, rewritten)
    with tempfile.TemporaryDirectory(prefix="vocable-voice-") as directory:
        path = Path(directory) / model.name
        onnx.save(graph, str(path))
        del graph
        yield path


def graph_feed(voice: Any, ids: list[int], config: Any) -> dict[str, np.ndarray]:
    """The inputs Piper's ``phoneme_ids_to_audio`` gives a ``voice``'s graph for the phoneme
    ``ids`` with the ``SynthesisConfig`` ``config`` (unset fields: the voice's own)."""
    length_scale = voice.config.length_scale if config.length_scale is None else config.length_scale
    noise = voice.config.noise_scale if config.noise_scale is None else config.noise_scale
    noise_w = voice.config.noise_w_scale if config.noise_w_scale is None else config.noise_w_scale
    feed: dict[str, np.ndarray] = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([noise, length_scale, noise_w], dtype=np.float32),
    }
    if voice.config.num_speakers > 1:
        speaker = (
            voice.config.default_speaker_id if config.speaker_id is None else config.speaker_id
        )
        feed["sid"] = np.array([speaker], dtype=np.int64)
    return feed


def noiseless_inputs(voice: Any, text: str) -> dict[str, np.ndarray]:
    """What a Piper ``voice``'s graph takes to say ``text`` (all its sentences in one run) at
    the voice's own rate without sampling noise, so two graphs of it compare sample for
    sample."""
    from piper import SynthesisConfig

    ids: list[int] = []
    for phonemes in voice.phonemize(text):
        ids += voice.phonemes_to_ids(phonemes)
    return graph_feed(voice, ids, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))


def decoder_as_2d(model: onnx.ModelProto, prefix: str = DECODER_PREFIX) -> int:
    """Rewrite, in place, the 1-D convolutions of the nodes named ``prefix*`` as 2-D ones of
    height 1: their inputs from outside gain the axis, their outputs used outside lose it.
    Returns how many convolutions were rewritten (0: no such node, ``model`` unchanged);
    raises :class:`UnsupportedGraph` (``model`` unchanged) if a node there is neither a
    convolution nor element-wise with scalar constants, which a new axis could change."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    nodes = [node for node in graph.node if node.name.startswith(prefix)]
    convolutions = [node for node in nodes if node.op_type in _CONVOLUTIONS]
    if not convolutions:
        return 0
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    constants = {node.output[0]: node for node in graph.node if node.op_type == "Constant"}
    _check(nodes, initializers, constants)

    produced = {name for node in nodes for name in node.output}
    for tensor in {node.input[1] for node in convolutions}:
        weights = numpy_helper.to_array(initializers[tensor])
        initializers[tensor].CopyFrom(
            numpy_helper.from_array(weights[:, :, None, :], tensor)  # (out, in, 1, width)
        )
    for node in convolutions:
        for attribute in node.attribute:
            values = list(attribute.ints)
            if attribute.name == "pads":  # (begin, end) -> (top, begin, bottom, end)
                values = [0, values[0], 0, values[1]]
            elif attribute.name in _SPATIAL_ATTRIBUTES:
                values = [_SPATIAL_ATTRIBUTES[attribute.name], *values]
            else:
                continue
            del attribute.ints[:]
            attribute.ints.extend(values)

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    axes = f"{prefix}height_axis"
    graph.initializer.append(helper.make_tensor(axes, TensorProto.INT64, [1], [_HEIGHT_AXIS]))

    def axis_node(op: str, source: str, target: str) -> onnx.NodeProto:
        if opset >= 13:
            return helper.make_node(op, [source, axes], [target], name=f"{prefix}{op}/{source}")
        return helper.make_node(
            op, [source], [target], name=f"{prefix}{op}/{source}", axes=[_HEIGHT_AXIS]
        )

    entering = _entering(nodes, produced, set(initializers) | set(constants))
    leaving = _leaving(graph, nodes, produced)
    renamed = entering | leaving
    for node in nodes:
        node.input[:] = [f"{name}/2d" if name in renamed else name for name in node.input]
        node.output[:] = [f"{name}/2d" if name in leaving else name for name in node.output]
    for name in sorted(entering):  # just before its first user: the graph stays in order
        first = next(i for i, node in enumerate(graph.node) if f"{name}/2d" in node.input)
        graph.node.insert(first, axis_node("Unsqueeze", name, f"{name}/2d"))
    for name in sorted(leaving):
        after = next(i for i, node in enumerate(graph.node) if f"{name}/2d" in node.output)
        graph.node.insert(after + 1, axis_node("Squeeze", f"{name}/2d", name))

    shapes = [info for info in graph.value_info if info.name not in produced]
    del graph.value_info[:]
    graph.value_info.extend(shapes)
    return len(convolutions)


def split_at_decoder(
    model: onnx.ModelProto, prefix: str = DECODER_PREFIX
) -> tuple[onnx.ModelProto, onnx.ModelProto, str] | None:
    """The graph ``model`` as two: what comes before its decoder (the nodes named ``prefix*``),
    from the graph's inputs to the latent frames the decoder takes, and the decoder, from those
    frames to the audio; with the latent tensor's name. None when the decoder takes more than
    one tensor from outside it (a speaker embedding, say) or the graph has more than one
    output (alignments): those are not split."""
    from onnx.utils import Extractor

    graph = model.graph
    nodes = [node for node in graph.node if node.name.startswith(prefix)]
    produced = {name for node in nodes for name in node.output}
    constant = {tensor.name for tensor in graph.initializer}
    constant |= {node.output[0] for node in graph.node if node.op_type == "Constant"}
    entering = {
        name
        for node in nodes
        for name in node.input
        if name and name not in produced and name not in constant
    }
    if not nodes or len(entering) != 1 or len(graph.output) != 1:
        return None
    (latent,) = entering
    extractor = Extractor(model)
    inputs = [tensor.name for tensor in graph.input if tensor.name not in constant]
    front = extractor.extract_model(inputs, [latent])
    decoder = extractor.extract_model([latent], [graph.output[0].name])
    return front, decoder, latent


def _check(
    nodes: list[onnx.NodeProto],
    initializers: dict[str, onnx.TensorProto],
    constants: dict[str, onnx.NodeProto],
) -> None:
    from onnx import numpy_helper

    for node in nodes:
        if node.op_type in _CONVOLUTIONS:
            weights = initializers.get(node.input[1])
            if weights is None or len(weights.dims) != 3:
                raise UnsupportedGraph(f"{node.name}: weights that are not a constant 1-D kernel")
            if any(a.name in ("output_shape", "auto_pad") for a in node.attribute):
                raise UnsupportedGraph(f"{node.name}: an output shape or automatic padding")
            continue
        if node.op_type not in _ELEMENTWISE:
            raise UnsupportedGraph(f"{node.name}: a {node.op_type} node")
        for name in node.input:
            if name in initializers:
                size = numpy_helper.to_array(initializers[name]).size
            elif name in constants:
                size = numpy_helper.to_array(constants[name].attribute[0].t).size
            else:
                continue
            if size != 1:
                raise UnsupportedGraph(f"{node.name}: a constant of {size} values")


def _entering(nodes: list[onnx.NodeProto], produced: set[str], constant: set[str]) -> set[str]:
    """Tensors from outside the decoder that its nodes compute with (not constants)."""
    return {
        name
        for node in nodes
        for name in (node.input[:1] if node.op_type in _CONVOLUTIONS else node.input)
        if name and name not in produced and name not in constant
    }


def _leaving(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], produced: set[str]) -> set[str]:
    """The decoder's tensors that something outside it uses."""
    inside = {id(node) for node in nodes}
    used = {name for node in graph.node if id(node) not in inside for name in node.input}
    used |= {output.name for output in graph.output}
    return produced & used
