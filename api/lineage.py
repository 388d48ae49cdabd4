"""A layer's lineage, read from the model's stage reports (``rangeprof inspect --json``): at each
stage, the bindings that carry it (a conv that absorbed a batch norm, a fused kernel, the
bindings inside a BYOC region function) with every initial layer each one holds, or the fate
that says where it went (folded into a binding, eliminated, an alias)."""

from __future__ import annotations

from .schemas import LineageBinding, LineageOut, LineageStage


def layer_lineage(model_id: int, stages: list[dict], profile_id: str) -> LineageOut:
    return LineageOut(
        model_id=model_id,
        profile_id=profile_id,
        stages=[
            LineageStage(
                name=stage["name"],
                bindings=[
                    LineageBinding(key=key, function=key.split("/", 1)[0], layers=layers)
                    for key, layers in stage["lineage"].items()
                    if profile_id in layers
                ],
                fate=stage["fates"].get(profile_id),
            )
            for stage in stages
        ],
    )
