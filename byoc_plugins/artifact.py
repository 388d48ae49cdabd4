"""The deployable artifact of ``rangeprof build``: a shared library and its manifest.

``DIR/model.so`` is the compiled program (loadable by the TVM runtime of the target:
``relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())``, docs/deploy.md) and
``DIR/manifest.json`` says what is in it: the model (name, sha256), the arguments of ``main`` in
order (``inputs``: name → shape and dtype, the batch it was built for; value inputs bound at
load time are no arguments), the target and its quantization policy, the
calibration the qparams came from, every region with its profileIDs, its input / output qparams
its mode (``int8``, ``int16`` for a layer an accuracy budget widened, or ``fp32`` with the
reason) and what the target made of it (the npu's
tile plan), the library's sha256 and the timings. A 4-bit weight-only build also writes the
same model as ONNX beside them (:mod:`.int4_export`), listed in ``exports``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from .evaluate import region_mode
from .int4_export import write_int4_exports
from .manifest import Manifest
from .quantized import QuantizedModel

LIBRARY = "model.so"
MANIFEST = "manifest.json"


def build_artifact(
    qm: QuantizedModel,
    out_dir: Path,
    kept_fp32: frozenset[str] = frozenset(),
    kept_int16: frozenset[str] = frozenset(),
    kept_int8: frozenset[str] = frozenset(),
):
    """Compiles ``qm`` for its plugin's target into ``out_dir``; returns the manifest."""
    start = time.perf_counter()
    modes = {r.name: region_mode(r, kept_fp32, kept_int16, kept_int8) for r in qm.regions}
    mod, _ = qm.lower(modes)
    executable = qm.plugin.compile(mod)
    compiled = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY
    qm.plugin.export(executable, library)
    loaded = qm.imported.loaded
    # The model, then what ``main`` takes: what a deployment reads first.
    model, *rest = qm.manifest(modes).items()
    inputs = {
        name: {"shape": list(loaded.input_shapes[name]), "dtype": loaded.input_dtypes[name]}
        | ({"index": loaded.index_uses[name].to_json()} if name in loaded.index_uses else {})
        for name in loaded.program_inputs
    }
    manifest = dict([model, ("inputs", inputs), *rest])
    details = qm.plugin.describe(mod) if qm.plugin.describe else {}
    for region in manifest["regions"]:
        region["mode"] = modes[region["name"]]
        core = f"{region['name']}_{region['mode']}"
        if core in details:
            region["target"] = details[core]
    manifest.update(
        library=LIBRARY,
        library_sha256=hashlib.sha256(library.read_bytes()).hexdigest(),
        kept_fp32=sorted(kept_fp32),
        kept_int16=sorted(kept_int16 - kept_fp32),
        kept_int8=sorted(kept_int8 - kept_int16 - kept_fp32),
    )
    if qm.weight_only is not None:
        exports, kept = write_int4_exports(qm, out_dir, modes)
        manifest.update(exports=exports, **({"exports_fp32": kept} if kept else {}))
    manifest["timings"] = {
        "compile_s": round(compiled - start, 3),
        "export_s": round(time.perf_counter() - compiled, 3),
    }
    (out_dir / MANIFEST).write_text(Manifest.model_validate(manifest).dumps())
    return manifest
