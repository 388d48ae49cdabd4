"""The shared model zoo: every model imports and keeps 100% lineage through every stage."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rangeprof.profiler.ir.bindings import module_bindings, op_name
from rangeprof.profiler.ir.stages import STAGE_NAMES

from conftest import ZOO_SHAPES, zoo_model

pytestmark = pytest.mark.zoo


def _inspect(name):
    path = zoo_model(name)
    cmd = [sys.executable, "-m", "rangeprof", "inspect", str(path), "--json"]
    for inp, dims in ZOO_SHAPES[name].items():
        cmd += ["--input-shape", f"{inp}={'x'.join(map(str, dims))}"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("name", sorted(ZOO_SHAPES))
def test_full_lineage_and_stable_ids(name):
    first, second = _inspect(name), _inspect(name)
    assert [s["name"] for s in first["stages"]] == list(STAGE_NAMES)
    for stage in first["stages"]:
        assert stage["tracked"] == stage["bindings"] > 0, stage["name"]
    assert [layer["profile_id"] for layer in first["layers"]] == [
        layer["profile_id"] for layer in second["layers"]
    ]
    assert first == second


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "digits_cnn"])
def test_batch_norms_are_folded_into_convs(name):
    from rangeprof.profiler.ir.tracking import track_model

    tracked = track_model(zoo_model(name), ZOO_SHAPES[name])
    layers = tracked.imported.layers
    bn_nodes = {r.source_node for r in layers if r.source_op == "BatchNormalization"}
    assert bn_nodes
    folded = tracked.stage("fold_scale_axis")
    ops = {ref.key: op_name(ref.value) for ref in module_bindings(folded.mod)}
    leftovers = [k for k, op in ops.items() if op in ("relax.divide", "relax.subtract")]
    assert not leftovers, leftovers
    conv_lineage = [set(folded.report.lineage[k]) for k, op in ops.items() if "conv2d" in op]
    for node in bn_nodes:
        assert any(any(i.startswith(node) for i in lin) for lin in conv_lineage), node
    if name == "digits_cnn":
        assert "relax.multiply" not in ops.values()
        assert any("/Mul" in lin for lin in conv_lineage)
