"""Hugging Face architectures as their exporter writes them, through rangeprof: a check of the
graphs users bring that no test model imitates (GPT-2's Conv1D, LLaMA's rotary embeddings,
RMSNorm and grouped-query attention, DeBERTa's relative attention, T5's position bias, Swin's
windows, LeViT, SegFormer, ConvNeXt's LayerNorm over channels, padding masks made from the
data).

``export FOLDER`` builds each architecture small and with seeded random weights
(``transformers``' ``from_config``, no download) and writes ``FOLDER/NAME.onnx`` with
``torch.onnx.export`` (opset 17); it needs torch and transformers, which rangeprof does not::

    python -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch==2.13.0 transformers onnx
    /tmp/torchenv/bin/python tests/hf_architectures.py export /tmp/hf

``check FOLDER`` (in rangeprof's environment) runs every model there as ``rangeprof.quantize``
does, on random calibration data (attention masks with the last tokens padded), and prints per
model the SQNR of our FP32 build and of our default x86 INT8 build against onnxruntime FP32 on a
held-out sample, and the INT8 build's regions; a model that fails prints its error::

    python tests/hf_architectures.py check /tmp/hf
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

PADDED = 4  # tokens masked out at the end of every sample
SMALL = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "vocab_size": 100,
}  # fmt: skip
# name: (config class, model class, config, "text" or "image")
ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2Model", {"n_embd": 64, "n_layer": 2, "n_head": 4,
             "vocab_size": 100, "n_positions": 64}, "text"),
    "distilbert": ("DistilBertConfig", "DistilBertModel", {"dim": 64, "n_layers": 2, "n_heads": 4,
                   "hidden_dim": 128, "vocab_size": 100}, "text"),
    "roberta": ("RobertaConfig", "RobertaModel", {**SMALL, "max_position_embeddings": 64}, "text"),
    "albert": ("AlbertConfig", "AlbertModel", {**SMALL, "embedding_size": 32}, "text"),
    "electra": ("ElectraConfig", "ElectraModel", {**SMALL, "embedding_size": 32}, "text"),
    "deberta": ("DebertaV2Config", "DebertaV2Model", {**SMALL, "max_position_embeddings": 64},
                "text"),
    "t5_encoder": ("T5Config", "T5EncoderModel", {"d_model": 64, "d_kv": 16, "d_ff": 128,
                   "num_layers": 2, "num_heads": 4, "vocab_size": 100}, "text"),
    "llama": ("LlamaConfig", "LlamaModel", {**SMALL, "num_key_value_heads": 2,
              "max_position_embeddings": 64}, "text"),
    "vit": ("ViTConfig", "ViTModel", {**SMALL, "image_size": 64, "patch_size": 8}, "image"),
    "convnext": ("ConvNextConfig", "ConvNextModel", {"hidden_sizes": [16, 32, 64, 128],
                 "depths": [1, 1, 1, 1]}, "image"),
    "resnet": ("ResNetConfig", "ResNetModel", {"hidden_sizes": [16, 32, 64, 128],
               "depths": [1, 1, 1, 1], "embedding_size": 16}, "image"),
    "swin": ("SwinConfig", "SwinModel", {"image_size": 64, "patch_size": 4, "embed_dim": 32,
             "depths": [1, 1], "num_heads": [2, 4], "window_size": 4}, "image"),
    "segformer": ("SegformerConfig", "SegformerModel", {"num_encoder_blocks": 2, "depths": [1, 1],
                  "sr_ratios": [2, 1], "hidden_sizes": [16, 32], "num_attention_heads": [1, 2],
                  "strides": [4, 2], "patch_sizes": [7, 3], "mlp_ratios": [2, 2]}, "image"),
    "levit": ("LevitConfig", "LevitModel", {"image_size": 64, "hidden_sizes": [32, 48, 64],
              "num_attention_heads": [1, 2, 2], "depths": [1, 1, 1], "key_dim": [8, 8, 8]},
              "image"),
}  # fmt: skip


def export(folder: Path) -> None:
    import torch
    import transformers

    class FirstOutput(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args):
            names = ("pixel_values",) if len(args) == 1 else ("input_ids", "attention_mask")
            return self.model(**dict(zip(names, args, strict=True)))[0]

    folder.mkdir(parents=True, exist_ok=True)
    for name, (config, model, settings, kind) in ARCHITECTURES.items():
        torch.manual_seed(0)
        built = getattr(transformers, model)(getattr(transformers, config)(**settings)).eval()
        if kind == "text":
            mask = torch.ones(1, 32, dtype=torch.long)
            args, names = (torch.randint(0, 100, (1, 32)), mask), ["input_ids", "attention_mask"]
        else:
            args, names = (torch.randn(1, 3, 64, 64),), ["pixel_values"]
        torch.onnx.export(FirstOutput(built), args, folder / f"{name}.onnx", input_names=names,
                          output_names=["out"], opset_version=17, dynamo=False)  # fmt: skip
        print(f"exported {name}", flush=True)


def _sqnr(ours: np.ndarray, reference: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    noise = ((ours - reference) ** 2).sum()
    return float("inf") if noise == 0 else float(10 * np.log10((reference**2).sum() / noise))


def _samples(inputs) -> tuple[dict, dict]:
    """17 random samples (the last held out), the attention masks' last tokens padded."""
    from rangeprof.profiler.profiling.data import open_data

    (whole,) = open_data("random", inputs, samples=17, batch_size=17).batches()
    if "attention_mask" in whole:
        whole["attention_mask"][:] = 1
        whole["attention_mask"][:, -PADDED:] = 0
    return {k: v[:16] for k, v in whole.items()}, {k: v[16:] for k, v in whole.items()}


def check_model(path: Path) -> str:
    import onnxruntime as ort
    import tvm
    from tvm import relax

    import rangeprof
    from rangeprof.profiler.compile.schedules import build
    from rangeprof.profiler.ir.importer import import_onnx
    from rangeprof.profiler.ir.onnx_load import load_model
    from rangeprof.profiler.profiling.data import model_inputs

    loaded = load_model(path)
    inputs = model_inputs(loaded.facts)
    calibration, probe = _samples(inputs)
    reference = ort.InferenceSession(str(path)).run(None, probe)[0]
    vm = relax.VirtualMachine(build(import_onnx(loaded).mod), tvm.cpu())
    fp32 = vm["main"](*[tvm.runtime.tensor(probe[i.name]) for i in inputs])
    fp32 = (fp32 if isinstance(fp32, tvm.runtime.Tensor) else fp32[0]).numpy()
    int8 = rangeprof.quantize(rangeprof.load(path), calibration, target="x86")
    regions = repr(int8).split(": ", 1)[1].rstrip(">")
    return (
        f"FP32 {_sqnr(fp32, reference):.1f} dB, INT8 {_sqnr(int8.run(probe)[0], reference):.1f}"
        f" dB ({regions})"
    )


def check(folder: Path) -> None:
    for path in sorted(folder.glob("*.onnx")):
        start = time.perf_counter()
        try:
            result = check_model(path)
        except Exception as err:  # every failure is the finding, whatever its kind
            result = f"FAILED {type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        print(f"{path.stem}: {result}, {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    {"export": export, "check": check}[sys.argv[1]](Path(sys.argv[2]))
