"""Load, import, tag and run the tracked stages: what ``rangeprof inspect`` shows.

The JSON document (``TrackedModel.to_json``) is the lineage document of ``docs/formats.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rangeprof.profiler.ir.importer import ImportedModel, import_onnx
from rangeprof.profiler.ir.lineage import verify_lineage
from rangeprof.profiler.ir.onnx_load import LoadedModel, load_model
from rangeprof.profiler.ir.stages import Patterns, Stage, run_stages


@dataclass
class TrackedModel:
    imported: ImportedModel
    stages: list[Stage]

    @property
    def all_ids(self) -> set[str]:
        return {layer.profile_id for layer in self.imported.layers}

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def problems(self) -> list[str]:
        """Lineage defects (bindings without lineage, IDs lost without a fate)."""
        return verify_lineage([s.report for s in self.stages], self.all_ids)

    def to_json(self) -> dict:
        loaded = self.imported.loaded
        return {
            "model": {
                "name": loaded.name,
                "sha256": loaded.sha256,
                "opset": loaded.opset,
                "inputs": {k: list(v) for k, v in loaded.input_shapes.items()},
            },
            "layers": [layer.to_json() for layer in self.imported.layers],
            "stages": [s.report.to_json() for s in self.stages],
        }


def track(
    loaded: LoadedModel, patterns: Patterns | None = None, equalize: bool = False
) -> TrackedModel:
    """Import, tag and run every tracked stage (``partition`` with a plugin's ``patterns``, when
    given; ``equalize`` when asked); a lineage defect is our bug and raises."""
    imported = import_onnx(loaded)
    ids = {layer.profile_id for layer in imported.layers}
    stages = run_stages(imported.mod, ids, imported.fates, patterns, equalize)
    tracked = TrackedModel(imported, stages)
    problems = tracked.problems()
    if problems:
        raise RuntimeError(f"lineage check failed for {loaded.name}: " + "; ".join(problems[:5]))
    return tracked


def track_model(
    path: str | Path,
    input_shapes: dict | None = None,
    patterns: Patterns | None = None,
    equalize: bool = False,
) -> TrackedModel:
    """The whole identity pipeline for one ONNX file (see :func:`track`)."""
    return track(load_model(path, input_shapes), patterns, equalize)
