"""Audio models built with onnx.helper, for the schedule tests and the latency benchmarks.

:func:`log_mel` is a speech model's front end as exporters write it when the STFT has to be
an ONNX operator: the real and imaginary parts of a windowed DFT as two strided ``Conv`` of one
input channel (kernel ``n_fft``, stride ``hop``, ``n_fft / 2 + 1`` bins each), the power
spectrum, a mel filterbank ``MatMul`` and a ``Log``. :func:`conv1d_encoder` is the convolution
stack a speech model runs on such features (Jasper / QuartzNet style: conv1d and ReLU, one of
them striding over time). ``python benchmarks/audio_models.py DIR`` writes them into ``DIR``
(``log_mel.onnx``, ``power_spectrum.onnx``, ``conv1d_encoder.onnx``) for the latency benchmarks::

    python benchmarks/audio_models.py /tmp/audio
    TVM_NUM_THREADS=1 python benchmarks/fp32_latency.py --models /tmp/audio/log_mel.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _dft_basis(n_fft: int) -> tuple[np.ndarray, np.ndarray]:
    """Hann-windowed cos / -sin bases, ``[n_fft / 2 + 1, 1, n_fft]`` each (Conv weights)."""
    bins = n_fft // 2 + 1
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    phase = 2 * np.pi * np.outer(np.arange(bins), np.arange(n_fft)) / n_fft
    return (np.cos(phase) * window)[:, None], (-np.sin(phase) * window)[:, None]


def _mel_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> np.ndarray:
    """Triangular filters evenly spaced on the mel scale, ``[n_fft / 2 + 1, n_mels]``."""
    mel = np.linspace(0, 2595 * np.log10(1 + sample_rate / 2 / 700), n_mels + 2)
    edges = 700 * (10 ** (mel / 2595) - 1)
    freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (centre - lower)
    falling = (upper - freqs) / (upper - centre)
    return np.maximum(0, np.minimum(rising, falling)).T


def _model(nodes, inits, name: str, x_shape, y_shape) -> onnx.ModelProto:
    """A checked opset-17 model with input ``x``, output ``y`` and float32 initializers."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _power_nodes(n_fft: int, hop: int, out: str) -> tuple[list, dict]:
    """``x`` → ``out``: the power spectrum ``re² + im²``, frames centred (``n_fft / 2`` zeros
    on each side)."""
    real, imag = _dft_basis(n_fft)
    conv = {"pads": [n_fft // 2] * 2, "strides": [hop], "kernel_shape": [n_fft]}
    nodes = [
        helper.make_node("Conv", ["x", "real"], ["re"], **conv),
        helper.make_node("Conv", ["x", "imag"], ["im"], **conv),
        helper.make_node("Mul", ["re", "re"], ["re2"]),
        helper.make_node("Mul", ["im", "im"], ["im2"]),
        helper.make_node("Add", ["re2", "im2"], [out]),
    ]
    return nodes, {"real": real, "imag": imag}


def power_spectrum(
    batch: int = 1, samples: int = 16000, n_fft: int = 512, hop: int = 160
) -> onnx.ModelProto:
    """``x[batch, 1, samples]`` audio → ``y[batch, n_fft / 2 + 1, frames]`` STFT power."""
    nodes, inits = _power_nodes(n_fft, hop, "y")
    y_shape = (batch, n_fft // 2 + 1, samples // hop + 1)
    return _model(nodes, inits, "power_spectrum", (batch, 1, samples), y_shape)


def log_mel(
    batch: int = 1,
    samples: int = 16000,
    n_fft: int = 512,
    hop: int = 160,
    n_mels: int = 80,
    sample_rate: int = 16000,
) -> onnx.ModelProto:
    """``x[batch, 1, samples]`` audio → ``y[batch, frames, n_mels]`` log-mel features."""
    nodes, inits = _power_nodes(n_fft, hop, "power")
    inits["mel"] = _mel_filterbank(n_fft, n_mels, sample_rate)
    inits["floor"] = np.float32(1e-10)  # log of silence
    nodes += [
        helper.make_node("Transpose", ["power"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "mel"], ["mels"]),
        helper.make_node("Clip", ["mels", "floor"], ["clamped"]),
        helper.make_node("Log", ["clamped"], ["y"]),
    ]
    y_shape = (batch, samples // hop + 1, n_mels)
    return _model(nodes, inits, "log_mel", (batch, 1, samples), y_shape)


def conv1d_encoder(
    batch: int = 1, mels: int = 80, frames: int = 101, widths=(128, 128, 64), seed: int = 0
) -> onnx.ModelProto:
    """``x[batch, mels, frames]`` → three ``Conv`` (kernel 3, padding 1, the second of stride 2)
    each with bias and ``Relu`` (nodes ``conv{i}``, ``relu{i}``), seeded random weights."""
    rng = np.random.default_rng(seed)
    nodes, inits, source, channels, length = [], {}, "x", mels, frames
    for i, width in enumerate(widths):
        stride = 2 if i == 1 else 1
        inits[f"w{i}"] = rng.normal(size=(width, channels, 3)) / np.sqrt(3 * channels)
        inits[f"b{i}"] = rng.normal(size=width) * 0.1
        out = "y" if i == len(widths) - 1 else f"h{i}"
        nodes += [
            helper.make_node(
                "Conv", [source, f"w{i}", f"b{i}"], [f"c{i}"], f"conv{i}", pads=[1, 1],
                strides=[stride], kernel_shape=[3],
            ),
            helper.make_node("Relu", [f"c{i}"], [out], f"relu{i}"),
        ]  # fmt: skip
        source, channels, length = out, width, (length - 1) // stride + 1
    return _model(nodes, inits, "conv1d_encoder", (batch, mels, frames), (batch, channels, length))


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    for build in (log_mel, power_spectrum, conv1d_encoder):
        onnx.save(build(), folder / f"{build.__name__}.onnx")
