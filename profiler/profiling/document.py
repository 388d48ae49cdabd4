"""The profile document: what ``rangeprof profile`` writes and every later stage reads.

Schema: ``profiler/schemas/profile.schema.json`` (``SCHEMA_VERSION``). Per tensor it holds the
layer's identity (profileID, source node and tensor, kind, shape, dtype), whether the tensor depends
on the data (``static`` tensors — weights and weight transforms — are observed once), and the
statistics of :class:`~rangeprof.profiler.profiling.statistics.TensorStats` including the exact
moments and the exact-merge histogram encoding. The ``tensors`` section is deterministic: the same
data in any sharding gives the same bytes (:func:`tensors_bytes`).

Non-finite values: every entry counts its NaN and infinite values (``nan_count``, ``inf_count``;
they stay out of min, max, moments and histograms). Those a constant holds are no overflow: a
causal mask's ``-inf``. A static tensor (one computed from constants alone) holding some, and a
data-dependent one whose non-finite values its *non-finite inputs* explain, say ``masked: true``.
The inputs are structure (:mod:`~rangeprof.profiler.profiling.masks`: the static tensors holding
NaN or inf it reads, ``nonfinite_inputs``, and the constants they come from,
``nonfinite_origins``); explaining is a function of the counts: the tensor's fraction of
non-finite values is at most the sum of its inputs' (an add of a broadcast mask has exactly the
mask's fraction; one more overflowing value and it has more). Any other activation that holds
some while the data fed held none overflowed inside the model: its entry says ``overflow: true``
(:func:`nonfinite_summary` words what the CLI prints). With non-finite data (``allow_nonfinite``)
they propagate, and no entry is said to overflow.

Versions: 1.3 added ``masked``, ``nonfinite_inputs`` and ``nonfinite_origins``, and per-channel
ranges of every dense layer's input along the axis it sums over in every profile; 1.2 added
``graph_outputs`` (the graph outputs whose value an entry is) and ``overflow`` on tensor entries,
and the data checks' options; 1.1 added per-channel means (``per_channel.mean``, ``count`` and
exact ``sum``) of activations profiled with channel statistics; older profiles, which lack them,
still load."""

from __future__ import annotations

import copy
import functools
import json
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.statistics import TensorStats

if TYPE_CHECKING:  # the IR's modules import TVM: reading a profile needs neither
    from rangeprof.profiler.ir.onnx_load import ModelFacts
    from rangeprof.profiler.ir.tagging import LayerRecord

SCHEMA_VERSION = "1.3"
# a minor version only adds optional fields
READABLE_VERSIONS = ("1.0", "1.1", "1.2", SCHEMA_VERSION)


class ProfileError(RangeprofError):
    """A profile file is missing, malformed or of another schema version."""


def schema() -> dict:
    text = resources.files("rangeprof.profiler").joinpath("schemas/profile.schema.json").read_text()
    return json.loads(text)


def build_document(
    model: ModelFacts,
    layers: list[LayerRecord],
    fates: dict[str, str],
    stages: list[dict],
    stats: dict[str, TensorStats],
    static_ids: set[str],
    run: dict,
    transforms: tuple[str, ...] = (),
    graph_outputs: dict[str, str] | None = None,
    masks: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None,
) -> dict:
    """The profile document for one model, in layer order; ``stages`` are stage reports;
    ``transforms`` the passes that changed the model's weights before it was profiled;
    ``graph_outputs`` the profileID whose value each graph output is; ``masks`` the non-finite
    inputs and their origins of the tensors reading constant NaN or inf."""
    outputs: dict[str, list[str]] = {}
    for name, profile_id in (graph_outputs or {}).items():
        outputs.setdefault(profile_id, []).append(name)
    tensors = []
    for layer in layers:
        record = stats.get(layer.profile_id)
        if record is None:
            continue  # tuples and integer tensors have no range to record
        tensors.append(
            {
                "profile_id": layer.profile_id,
                "source_node": layer.source_node,
                "source_op": layer.source_op,
                "source_tensor": layer.source_tensor,
                "kind": layer.kind,
                "op": layer.op,
                "shape": layer.shape,
                "dtype": layer.dtype,
                "static": layer.profile_id in static_ids,
                **(
                    {"graph_outputs": outputs[layer.profile_id]}
                    if layer.profile_id in outputs
                    else {}
                ),
                **_mask_fields((masks or {}).get(layer.profile_id)),
                **record.to_json(),
            }
        )
    flag_nonfinite(tensors)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": model.name,
            "sha256": model.sha256,
            "opset": model.opset,
            "inputs": {k: list(v) for k, v in model.input_shapes.items()},
            **(
                {"bound_inputs": {k: v.tolist() for k, v in model.bound.items()}}
                if model.bound
                else {}
            ),
            **({"transforms": list(transforms)} if transforms else {}),
        },
        "run": run,
        "tensors": tensors,
        "lineage": {"fates": dict(sorted(fates.items())), "stages": stages},
    }


def _nonfinite(entry: dict) -> int:
    return entry["nan_count"] + entry["inf_count"]


def _mask_fields(sources: tuple[tuple[str, ...], tuple[str, ...]] | None) -> dict:
    inputs, origins = sources or ((), ())
    if not inputs:
        return {}
    return {"nonfinite_inputs": list(inputs), "nonfinite_origins": list(origins)}


def _fraction(entry: dict) -> Fraction:
    return Fraction(_nonfinite(entry), entry["count"]) if entry["count"] else Fraction(0)


def flag_nonfinite(tensors: list[dict]) -> None:
    """Sets ``masked`` on the entries whose NaN and inf come from constants and ``overflow`` on
    the other activations holding some when the data fed held none (see the module doc). A
    function of the counts alone (exact fractions): a merge of shards flags as one pass does.
    Entries are in program order, so a tensor's inputs are decided before it."""
    fed = any(_nonfinite(t) for t in tensors if t["kind"] == "input")
    by_id = {t["profile_id"]: t for t in tensors}
    for entry in tensors:
        entry.pop("overflow", None)
        entry.pop("masked", None)
        if not _nonfinite(entry):
            continue
        if entry["static"] or _explained(entry, by_id):
            entry["masked"] = True
        elif not fed and entry["kind"] == "activation":
            entry["overflow"] = True


def _explained(entry: dict, by_id: dict[str, dict]) -> bool:
    """Whether ``entry``'s share of non-finite values is at most that of its non-finite inputs
    (static ones, and masked ones it carries values of) together."""
    inputs = [by_id.get(i) for i in entry.get("nonfinite_inputs", ())]
    held = [e for e in inputs if e is not None and (e["static"] or e.get("masked"))]
    return bool(held) and _fraction(entry) <= sum(map(_fraction, held), Fraction(0))


def nonfinite_summary(doc: dict, limit: int = 5) -> list[str]:
    """One line each on NaN and infinite values in a profile: the values masks put there per
    constant they come from (counted, kept out of every range), tensors that overflowed inside
    the model (a warning), or, with non-finite data, the tensors holding some; with counts."""

    def listed(entries: list[dict]) -> str:
        parts = [f"{entry['profile_id']} ({_counts(entry)})" for entry in entries[:limit]]
        more = f", and {len(entries) - limit} more" if len(entries) > limit else ""
        return ", ".join(parts) + more

    lines = _masked_lines(doc, listed)
    overflowed = [t for t in doc["tensors"] if t.get("overflow")]
    if overflowed:
        lines.append(
            f"warning: {len(overflowed)} tensor(s) overflowed to NaN or inf inside the model: "
            + listed(overflowed)
        )
    data = [t for t in doc["tensors"] if t["kind"] == "input" and _nonfinite(t)]
    if data:
        holding = [t for t in doc["tensors"] if _nonfinite(t)]
        lines.append(
            f"non-finite data profiled: {len(holding)} tensor(s) hold NaN or inf: "
            + listed(holding)
        )
    return lines


def _counts(entry: dict) -> str:
    kinds = (("nan_count", "NaN"), ("inf_count", "inf"))
    return ", ".join(f"{entry[k]} {word}" for k, word in kinds if entry[k])


def _masked_lines(doc: dict, listed) -> list[str]:
    """Per constant that masks put NaN or inf from: the values in the data-dependent tensors
    that read them (static tensors computed from the constant hold them as it does)."""
    by_origin: dict[tuple[str, ...], list[dict]] = {}
    for entry in doc["tensors"]:
        if entry.get("masked") and not entry["static"]:
            by_origin.setdefault(tuple(entry.get("nonfinite_origins", ())), []).append(entry)
    lines = []
    for origins, entries in by_origin.items():
        total = {k: sum(e[k] for e in entries) for k in ("nan_count", "inf_count")}
        constants = ", ".join(origins) or "constants"
        lines.append(
            f"masked: {_counts(total)} values from constant {constants} (not an overflow: "
            f"counted, kept out of ranges) in {len(entries)} tensor(s): {listed(entries)}"
        )
    return lines


def _listed(arrays: dict) -> dict:
    return {k: v.tolist() for k, v in arrays.items()}


@functools.cache
def _validator():
    """The schema's validator, less the per-item check of histogram counts (:func:`validate`
    checks those arrays in numpy: item by item in Python they cost a second a small profile)."""
    import jsonschema

    fast = copy.deepcopy(schema())
    del fast["$defs"]["tensor"]["properties"]["histogram"]["oneOf"][1]["properties"]["counts"][
        "items"
    ]
    return jsonschema.validators.validator_for(fast)(fast)


def validate(doc: dict, source: str = "profile") -> dict:
    """``doc`` if it is a profile of a schema version this one reads, else a
    :class:`ProfileError`."""
    import jsonschema

    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version not in READABLE_VERSIONS:
        expected = " or ".join(repr(v) for v in READABLE_VERSIONS)
        raise ProfileError(f"{source}: schema_version {version!r}, expected {expected}")
    error = jsonschema.exceptions.best_match(_validator().iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "top level"
        raise ProfileError(f"{source}: invalid profile at {where}: {error.message}")
    for k, entry in enumerate(doc["tensors"]):
        counts = (entry.get("histogram") or {}).get("counts", [])
        # bool is a subclass of int, and numpy makes bools of JSON true / false.
        array = np.asarray(counts) if all(type(c) is int for c in counts) else None
        if array is None or (array.size and array.min() < 0):
            where = f"tensors/{k}/histogram/counts"
            raise ProfileError(f"{source}: invalid profile at {where}: not counts (integers >= 0)")
    return doc


def load_profile(path: str | Path) -> dict:
    """Reads and validates a profile JSON file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: not a profile JSON file ({err})") from None
    return validate(doc, str(path))


def _channel_stats(doc: dict) -> bool:
    return doc["run"]["options"].get("channel_stats", False)


def tensors_bytes(doc: dict) -> bytes:
    """The ``tensors`` section in canonical form (what shard merges must reproduce)."""
    return json.dumps(doc["tensors"], sort_keys=True, separators=(",", ":")).encode()


def merge_profiles(first: dict, second: dict) -> dict:
    """Profiles of two disjoint parts of a data set -> the profile of all of it (exact).

    Both must come from the same model, shapes and options; static tensors are identical in
    both and kept once.
    """
    if first["model"] != second["model"]:
        raise ProfileError("cannot merge profiles of different models or input shapes")
    if first["run"]["options"]["bins"] != second["run"]["options"]["bins"]:
        raise ProfileError("cannot merge profiles with different histogram bin counts")
    if _channel_stats(first) != _channel_stats(second):
        raise ProfileError("cannot merge profiles made with and without channel statistics")
    theirs = {t["profile_id"]: t for t in second["tensors"]}
    if set(theirs) != {t["profile_id"] for t in first["tensors"]}:
        raise ProfileError("cannot merge profiles with different tensors")
    tensors = []
    for entry in first["tensors"]:
        other = theirs[entry["profile_id"]]
        if entry["static"]:
            tensors.append(dict(entry))  # a copy: flagging below must not change ``first``
            continue
        merged = TensorStats.from_json(entry).merge(TensorStats.from_json(other))
        tensors.append({**entry, **merged.to_json()})
    flag_nonfinite(tensors)
    run = dict(first["run"])
    run["samples"] = first["run"]["samples"] + second["run"]["samples"]
    run["batches"] = first["run"]["batches"] + second["run"]["batches"]
    run["timings"] = {
        k: round(v + second["run"]["timings"].get(k, 0.0), 6)
        for k, v in first["run"]["timings"].items()
    }
    return {**first, "run": run, "tensors": tensors}
