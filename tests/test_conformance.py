"""The ONNX backend test suite through rangeprof (see ``tests/conformance.py``), without the
``*_expanded`` node cases (``python tests/conformance.py`` runs those too).

Fails on a CRASH or WRONG case that ``conformance_expected.json`` does not list, and on a listed
case that no longer fails that way (the file only shrinks); prints the counts per class.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from conformance import (
    CLEAN,
    CRASH,
    EXPECTED,
    PASS,
    WRONG,
    generate_cases,
    run_cases,
    summarize,
)

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-backend")
    cases = generate_cases(root, expanded=False)
    return {o.key: o for o in run_cases(cases, root / "work", jobs=os.cpu_count() or 1)}


def expected_failures() -> dict[str, dict]:
    entries = json.loads(EXPECTED.read_text())
    for key, entry in entries.items():
        assert entry.get("status") in (CRASH, WRONG), f"{key}: status must be CRASH or WRONG"
        assert entry.get("reason", "").strip(), f"{key}: every expected failure needs a reason"
    return entries


def test_every_case_passes_or_is_refused_cleanly(outcomes, capsys):
    counts = summarize(list(outcomes.values()))
    with capsys.disabled():
        total = sum(counts.values())
        print(
            f"\nONNX backend conformance ({total} cases): "
            + ", ".join(f"{status} {count}" for status, count in counts.items())
        )
    expected = expected_failures()
    unexpected = [
        f"{o.status} {key}: {o.detail}"
        for key, o in sorted(outcomes.items())
        if o.status in (CRASH, WRONG) and expected.get(key, {}).get("status") != o.status
    ]
    stale = [
        f"{key}: listed as {entry['status']}, now {outcomes[key].status}"
        for key, entry in sorted(expected.items())
        if key in outcomes and outcomes[key].status != entry["status"]
    ]
    assert not unexpected, "\n".join(unexpected)
    assert not stale, "remove from conformance_expected.json:\n" + "\n".join(stale)


def test_most_cases_pass(outcomes):
    """Well over 70 % of the cases pass (78.0 % of these 1608 when last counted)."""
    passed = sum(o.status == PASS for o in outcomes.values())
    assert passed / len(outcomes) > 0.76, f"{passed} of {len(outcomes)} cases pass"


def test_clean_refusals_are_one_line(outcomes):
    """What the CLI would print for a refused case: one line, naming the problem."""
    bad = [
        k for k, o in outcomes.items() if o.status == CLEAN and (not o.detail or "\n" in o.detail)
    ]
    assert not bad, bad[:10]


# What TVM's own messages carry and ours never do: Relax / TIR script (``R.const``,
# ``T.float32``, bindings ``lv3``), C++ checks, Python type errors.
_TVM_TEXT = re.compile(
    r"\b[RT]\.\w|\blv\d*\b|Check failed|\brelax\.|tirx|object has no attribute|<class "
)


def test_refusals_are_in_our_words(outcomes):
    """No refused case is refused by TVM's converter failing (a :class:`ConverterFailure`, whose
    message quotes TVM) or in words of TVM's: every refusal names what is not supported."""
    raw = [
        f"{key}: {o.detail}"
        for key, o in sorted(outcomes.items())
        if o.status == CLEAN and (o.error == "ConverterFailure" or _TVM_TEXT.search(o.detail))
    ]
    assert not raw, "\n".join(raw)
