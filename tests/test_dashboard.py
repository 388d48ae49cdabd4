"""The web dashboard (``/dashboard``) in headless Chromium, driven by Playwright, against a real
server (uvicorn on a loopback port, SQLite, the in-process worker) holding a real profile of
digits_cnn and a real evaluation: log in, open every page, click layer -> histogram -> lineage,
toggle the log scale, build an INT8 artifact from the run page and download it, cancel a queued
build, build with FP32 fallback and an accuracy budget, evaluate every method, check that
suggested scales default to the x86 policy, and compare what is drawn (jobs' requests included)
with what the API returns. Screenshots are written to ``test-results/dashboard/``.

Also the API the dashboard reads (the paged layer table, evaluations), on SQLite and PostgreSQL,
with a synthetic 1000-layer model written straight to the database.
"""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from sqlalchemy import select

from rangeprof.byoc.x86 import PLUGIN as X86
from rangeprof.profiler.calibrate.methods import CalibrationOptions, qparams_for
from rangeprof.service.db import Database
from rangeprof.service.documents import store_profile
from rangeprof.service.limits import Limits
from rangeprof.service.models import Layer, Model, Run, Token, utcnow
from rangeprof.workflows.requests import ProfileRequest

import onnx_builders as mb
from conftest import poll_until, zoo_model
from profile_builders import entry
from service_fixtures import (
    BACKENDS,
    DIGITS,
    Live,
    live_service,
    npz_bytes,
    row_counts,
    start_run,
    stored_files,
    upload_model,
    wait_for_run,
    write_calib,
)

REPO = Path(__file__).resolve().parents[1]
SHOTS = REPO / "test-results" / "dashboard"
CHROMIUM = Path("/usr/bin/chromium")
# Headless flags that work on the test machines (no network beyond loopback, root, no GPU).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
METHODS = ("max", "percentile", "entropy", "mse")
SYNTHETIC_LAYERS = 1000
UNPROFILED = 10  # the synthetic model's last layers, absent from its run


# What the dashboard shows, as the API reports it


def base_url(live: Live) -> str:
    return str(live.owner.base_url).rstrip("/")


def token(api) -> str:
    return api.headers["Authorization"].split()[1]


def sqnr_class(db: float | None, good: float = 30, warn: float = 20) -> str:
    """The colour class the evaluation page gives an SQNR (null: exact)."""
    if db is None or db >= good:
        return "good"
    return "warn" if db >= warn else "bad"


def worst_first(layers: list[dict]) -> list[dict]:
    def key(value):
        return float("inf") if value is None else value

    return sorted(layers, key=lambda e: (key(e["isolated_sqnr_db"]), key(e["accumulated_sqnr_db"])))


# Fixtures


@dataclass
class Digits:
    model: dict
    run: dict
    evaluation_id: int  # queued when the run is done; tests wait for it as they need it


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_service("sqlite", tmp_path_factory.mktemp("dashboard"), Limits()) as service:
        yield service


@pytest.fixture(scope="module")
def digits(live, tmp_path_factory) -> Digits:
    folder = tmp_path_factory.mktemp("digits")
    model = upload_model(live.owner, zoo_model("digits_cnn")).json()
    run = wait_for_run(live.owner, start_run(live.owner, model["id"], write_calib(folder))["id"])
    assert run["status"] == "done", run["error"]
    arrays = np.load(DIGITS)
    data = npz_bytes(test=arrays["test"][:64], test_labels=arrays["test_labels"][:64])
    response = live.owner.post(
        f"/api/runs/{run['id']}/evaluations",
        files={"data": ("digits.npz", data)},
        data={
            "key": "test",
            "labels_key": "test_labels",
            "method": "mse",
            "target": "x86",
            "weight_bits": "7",
        },
    )
    assert response.status_code == 202, response.text
    return Digits(model, run, response.json()["id"])


def finished_evaluation(live: Live, evaluation_id: int) -> dict:
    path = f"/api/evaluations/{evaluation_id}"

    def ended() -> dict | None:
        evaluation = live.owner.get(path).json()
        return evaluation if evaluation["status"] in ("done", "failed") else None

    evaluation = poll_until(ended, 120, 0.2, "the evaluation ends")
    assert evaluation["status"] == "done", evaluation["error"]
    return evaluation


@dataclass
class Synthetic:
    model_id: int
    run_id: int
    failed_run_id: int
    profile: dict


def add_synthetic_model(url: str, owner: str = "owner") -> Synthetic:
    """A model of SYNTHETIC_LAYERS layers and a done run profiling all but the last UNPROFILED
    of them, written to the database directly (tracking a real model that large takes minutes);
    a failed run beside it (a queued one would be taken by the worker)."""
    rng = np.random.default_rng(7)
    ops = ("relax.nn.conv2d", "relax.nn.relu", "relax.add", "relax.matmul")
    entries = []
    for i in range(SYNTHETIC_LAYERS):
        weight = i % 5 == 4
        name = f"weight:block{i}.w" if weight else f"/block{i}/{ops[i % 4].split('.')[-1]}"
        values = rng.normal(0.1 * (i % 13), 1 + i % 7, size=(4, 16))
        doc = entry(values, kind="weight" if weight else "activation", bins=256, name=name)
        op = "constant" if weight else ops[i % 4]
        entries.append({**doc, "op": op, "source_op": None if weight else "Op", "static": weight})
    entries[3]["profile_id"] = entries[3]["source_node"] = "/odd_name%/Relu"  # LIKE wildcards
    profile = {
        "schema_version": "1.0",
        "model": {"name": "synthetic", "sha256": "1" * 64, "inputs": {"x": [1, 4]}},
        "run": {"samples": 8},
        "tensors": entries[:-UNPROFILED],
        "lineage": {"fates": {}, "stages": []},
    }
    db = Database(url)
    try:
        with db.session() as session:
            owner_id = session.scalar(select(Token.id).where(Token.name == owner))
            model = Model(
                owner_id=owner_id,
                name="synthetic",
                sha256="1" * 64,
                size=1,
                opset=17,
                input_shapes={},
                inputs=[{"name": "x", "shape": [1, 4], "dtype": "float32"}],
                stages=[],
                layers=[
                    Layer(
                        position=i,
                        **{k: e[k] for k in ("profile_id", "kind", "op", "source_node")},
                        source_op=e["source_op"],
                        source_tensor=e["source_tensor"],
                        shape=e["shape"],
                        dtype="float32",
                    )
                    for i, e in enumerate(entries)
                ],
            )
            session.add(model)
            session.flush()
            request = ProfileRequest(model="synthetic.onnx", data="random", samples=8, bins=256)
            common = {"model_id": model.id, "request": request}
            run = Run(**common, status="done", progress=1.0, finished_at=utcnow())
            failed = Run(**common, status="failed", error="no data")
            session.add_all([run, failed])
            session.flush()
            store_profile(session, run, profile)
            return Synthetic(model.id, run.id, failed.id, profile)
    finally:
        db.dispose()


@pytest.fixture(scope="module")
def synthetic(live) -> Synthetic:
    return add_synthetic_model(live.url)


@pytest.fixture(scope="module")
def browser() -> Browser:
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package chromium; .ci/run installs it)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield browser
        browser.close()


class Tab:
    """A browser page with the owner's token stored (as the login page stores it), collecting
    the page's script errors. Playwright's ``wait_for_function`` evaluates strings, which the
    dashboard's content security policy forbids: these pages bypass it (the policy has a test
    of its own)."""

    def __init__(self, browser: Browser, live: Live, api=None):
        self.context = browser.new_context(
            base_url=base_url(live),
            viewport={"width": 1400, "height": 1000},
            accept_downloads=True,
            bypass_csp=True,
        )
        stored = json.dumps(token(api or live.owner))
        self.context.add_init_script(f"localStorage.setItem('rangeprof.token', {stored})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda err: self.errors.append(str(err)))

    def shot(self, name: str) -> None:
        self.page.screenshot(path=SHOTS / f"{name}.png", full_page=True)


@pytest.fixture
def tab(browser, live):
    tab = Tab(browser, live)
    yield tab
    tab.context.close()
    assert tab.errors == [], "script errors on the page"


def wait_for_chart(page: Page, canvas: str) -> None:
    """Until the chart on ``canvas`` exists; the page may not have loaded Chart.js yet (the URL
    changes as soon as navigation starts)."""
    page.wait_for_function(
        "id => typeof Chart !== 'undefined' && Chart.getChart(id) !== undefined", arg=canvas
    )


def table(page: Page, selector: str) -> list[dict]:
    """Rows of a dashboard table: the row's data attributes and each ``data-column`` cell's exact
    value (``data-value``) and colour class, once the table is no longer busy (the layer table
    is while it fetches its weights' own scales)."""
    page.wait_for_selector(f"{selector}:not([aria-busy=true])", state="attached")
    return page.eval_on_selector_all(
        f"{selector} tbody tr",
        """rows => rows.map(row => ({
            ...row.dataset,
            cells: Object.fromEntries([...row.querySelectorAll('[data-column]')].map(
                cell => [cell.dataset.column, [cell.dataset.value, cell.className]])),
        }))""",
    )


def number(text: str) -> float | None:
    return None if text == "" else float(text)


def wait_for_value(page: Page, selector: str, value: float, timeout: float = 30_000) -> None:
    """Until the cell at ``selector`` holds ``value`` exactly (its ``data-value``)."""
    page.wait_for_function(
        """([selector, value]) => {
            const cell = document.querySelector(selector);
            const shown = cell?.dataset.value;
            return shown !== undefined && shown !== '' && Number(shown) === value;
        }""",
        arg=[selector, value],
        timeout=timeout,
    )


# The browser


def test_login_takes_a_token_and_a_token_sees_only_its_models(browser, live, digits):
    context = browser.new_context(base_url=base_url(live))
    page = context.new_page()
    page.goto("/dashboard/")
    expect(page).to_have_url(f"{base_url(live)}/dashboard/login?next=%2Fdashboard%2F")
    page.fill("#token", "rp_forged")
    page.click("#login button")
    expect(page.locator("#error")).to_contain_text("token refused: invalid bearer token")
    page.fill("#token", token(live.owner))
    page.click("#login button")
    expect(page).to_have_url(f"{base_url(live)}/dashboard/")
    row = page.locator(f"#models tr[data-model-id='{digits.model['id']}']")
    expect(row).to_contain_text("digits_cnn")
    expect(row).to_contain_text("image 1×1×8×8 float32")
    page.screenshot(path=SHOTS / "models.png", full_page=True)
    page.click("#logout")
    expect(page).to_have_url(f"{base_url(live)}/dashboard/login")
    assert page.evaluate("localStorage.getItem('rangeprof.token')") is None
    page.fill("#token", token(live.stranger))
    page.click("#login button")
    expect(page.locator("#no-models")).to_be_visible()
    assert page.locator("#models tbody tr").count() == 0
    page.goto(f"/dashboard/models/{digits.model['id']}")  # someone else's: the API says 404
    expect(page.locator("#error")).to_contain_text(f"model {digits.model['id']} not found")
    context.close()


def test_pages_run_under_their_content_security_policy(browser, live, digits):
    """With the policy enforced, every page draws its tables and charts and the browser reports
    no violation (a blocked script or style would)."""
    context = browser.new_context(base_url=base_url(live))
    stored = json.dumps(token(live.owner))
    context.add_init_script(f"localStorage.setItem('rangeprof.token', {stored})")
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if "Content Security" in m.text else None)
    page.on("pageerror", lambda err: problems.append(str(err)))
    response = page.goto(f"/dashboard/models/{digits.model['id']}")
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    expect(page.locator("#layers tbody tr").first).to_be_visible()
    page.goto(f"/dashboard/runs/{digits.run['id']}")
    expect(page.locator("#evaluations tbody tr").first).to_be_visible()
    model, run = digits.model["id"], digits.run["id"]
    page.goto(f"/dashboard/models/{model}/layer?pid=weight%3Ac2.weight&run={run}")
    expect(page.locator("#histogram")).to_be_visible()
    page.goto(f"/dashboard/evaluations/{digits.evaluation_id}")
    expect(page.locator(".swatch").first).to_be_visible()
    context.close()
    assert problems == []


def test_a_running_run_is_cancelled_from_the_model_page(tab, live):
    model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]  # a model of its own
    run = start_run(live.owner, model, random=str(Limits().max_samples))["id"]
    page = tab.page
    page.goto(f"/dashboard/models/{model}")
    row = page.locator(f"#runs tr[data-run-id='{run}']")
    row.locator("button.cancel").click()
    expect(row).to_have_attribute("data-status", "cancelled")
    expect(row.locator(".status")).to_have_text("cancelled")
    expect(row).to_contain_text("cancelled by its owner")
    assert live.owner.get(f"/api/runs/{run}").json()["status"] == "cancelled"
    assert row.locator("button.cancel").count() == 0


def test_upload_form_adds_a_model_or_shows_the_refusal(tab, live, tmp_path):
    page = tab.page
    page.goto("/dashboard/")
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model")
    page.set_input_files("#upload input[name=file]", str(bad))
    page.click("#upload button")
    expect(page.locator("#upload-error")).to_contain_text("broken.onnx")
    path = mb.save(mb.conv_bias(), tmp_path, "conv.onnx")
    page.set_input_files("#upload input[name=file]", str(path))
    page.click("#upload button")
    expect(page.locator("#title")).to_have_text("conv")
    model_id = max(m["id"] for m in live.owner.get("/api/models").json())
    assert page.url == f"{base_url(live)}/dashboard/models/{model_id}"  # no run: nothing to add
    layers = live.owner.get(f"/api/models/{model_id}").json()["layers"]
    expect(page.locator("#range")).to_have_text(f"rows 1–{len(layers)} of {len(layers)}")
    assert [row["profileId"] for row in table(page, "#layers")] == [
        layer["profile_id"] for layer in layers
    ]


def _layer_page(live: Live, model_id: int, **params) -> dict:
    response = live.owner.get(f"/api/models/{model_id}/layers", params=params)
    assert response.status_code == 200, response.text
    return response.json()


X86_ACTIVATIONS = {"scheme": "asym", "dtype": "uint8"}  # rangeprof.byoc.x86 PLUGIN.policy
X86_WEIGHTS = {"scheme": "sym", "dtype": "int8"}


def _policy_page(live: Live, model_id: int, **params) -> dict:
    """The layer table as the dashboard shows it by default (the x86 policy): the API's page for
    asymmetric uint8, with the weights' scales of its page for symmetric int8."""
    page = _layer_page(live, model_id, **params, **X86_ACTIVATIONS)
    weights = _layer_page(live, model_id, **params, **X86_WEIGHTS)["rows"]
    assert [row["profile_id"] for row in weights] == [row["profile_id"] for row in page["rows"]]
    for row, weight in zip(page["rows"], weights, strict=True):
        if row["kind"] == "weight":
            row["scales"] = weight["scales"]
    return page


def _same_rows(shown: list[dict], served: dict) -> None:
    assert [row["profileId"] for row in shown] == [row["profile_id"] for row in served["rows"]]
    for row, expected in zip(shown, served["rows"], strict=True):
        assert number(row["cells"]["min"][0]) == expected["min"]
        assert number(row["cells"]["max"][0]) == expected["max"]
        for method in METHODS:
            assert number(row["cells"][f"scale-{method}"][0]) == expected["scales"].get(method)


def test_model_page_layer_table_searches_sorts_and_pages_as_the_api(tab, live, digits):
    page, model_id, run_id = tab.page, digits.model["id"], digits.run["id"]
    page.goto(f"/dashboard/models/{model_id}")
    served = _policy_page(live, model_id, run=run_id)
    expect(page.locator("#range")).to_have_text(f"rows 1–{served['total']} of {served['total']}")
    expect(page.locator("#run")).to_have_value(str(run_id))  # the newest done run
    _same_rows(table(page, "#layers"), served)
    assert all(served["rows"][i]["scales"] for i in (1, 5, 13))  # conv, relu outputs have scales
    tab.shot("model")

    page.fill("#search", "RELU")
    served = _policy_page(live, model_id, run=run_id, q="relu")
    assert served["total"] == 4
    expect(page.locator("#range")).to_have_text("rows 1–4 of 4")
    _same_rows(table(page, "#layers"), served)
    page.click("#layers th[data-sort=max]")
    page.click("#layers th[data-sort=max]")
    expect(page.locator("#layers th[data-sort=max]")).to_have_class("num sorted-desc")
    _same_rows(
        table(page, "#layers"),
        _policy_page(live, model_id, run=run_id, q="relu", sort="max", order="desc"),
    )
    assert "sort=max" in page.url and "order=desc" in page.url  # the view can be shared

    page.fill("#search", "")
    page.select_option("#limit", "25")
    total = _layer_page(live, model_id)["total"]
    expect(page.locator("#range")).to_have_text(f"rows 1–25 of {total}")
    page.click("#next")
    expect(page.locator("#range")).to_have_text(f"rows 26–{min(50, total)} of {total}")
    served = _policy_page(live, model_id, run=run_id, sort="max", order="desc", offset=25, limit=25)
    _same_rows(table(page, "#layers"), served)


def _by_id(page: dict) -> dict[str, dict]:
    return {row["profile_id"]: row for row in page["rows"]}


def test_model_page_scales_default_to_the_x86_policy(tab, live, digits):
    """By default the layer table suggests scales as the x86 plugin quantizes (activations
    asymmetric uint8, weights symmetric int8); another choice is the user's, kept in the URL."""
    policy = X86.policy
    assert (policy.activation_scheme, policy.activation_dtype) == ("asym", "uint8")
    assert X86_ACTIVATIONS == {"scheme": "asym", "dtype": "uint8"}
    page, model_id, run_id = tab.page, digits.model["id"], digits.run["id"]
    activation, weight = "/Relu_1", "weight:c2.weight"

    def served(**params) -> dict[str, dict]:
        return _by_id(_layer_page(live, model_id, run=run_id, **params))

    def cell(profile_id: str, method: str) -> str:
        return f"#layers tr[data-profile-id='{profile_id}'] [data-column=scale-{method}]"

    def shown() -> dict[str, dict]:
        return {row["profileId"]: row for row in table(page, "#layers")}

    def scales(row: dict) -> dict[str, float | None]:
        return {m: number(row["cells"][f"scale-{m}"][0]) for m in METHODS}

    asym_u8, sym_i8 = served(**X86_ACTIVATIONS), served(**X86_WEIGHTS)
    sym_u8 = served(scheme="sym", dtype="uint8")
    # The API's own default is the target's (x86) grid for each row's kind, as the page shows.
    default = served()
    assert default[activation] == asym_u8[activation] and default[weight] == sym_i8[weight]
    # The views differ where it is checked: a ReLU output (min 0) on the uint8 grid's 255 steps
    # or the symmetric 127; a weight's symmetric scale or its asymmetric one.
    for method in METHODS:
        assert asym_u8[activation]["scales"][method] != sym_u8[activation]["scales"][method]
        assert asym_u8[weight]["scales"][method] != sym_i8[weight]["scales"][method]

    page.goto(f"/dashboard/models/{model_id}?run={run_id}")
    for choice, value, label in (
        ("#scheme", "asym", "asym (x86 policy)"),
        ("#dtype", "uint8", "uint8 (x86 policy)"),
        ("#weights", "policy", "sym int8 (x86 policy)"),
    ):
        expect(page.locator(choice)).to_have_value(value)
        expect(page.locator(f"{choice} option:checked")).to_have_text(label)
    wait_for_value(page, cell(activation, "mse"), asym_u8[activation]["scales"]["mse"])
    rows = shown()
    assert scales(rows[activation]) == asym_u8[activation]["scales"]
    assert scales(rows[weight]) == sym_i8[weight]["scales"]  # weights stay symmetric int8
    assert (rows[activation]["calibration"], rows[weight]["calibration"]) == (
        "asym uint8",
        "sym int8",
    )
    expect(page.locator("#calibration-note")).to_contain_text("the x86 policy (asymmetric uint8")
    assert "scheme" not in page.url and "dtype" not in page.url and "weights" not in page.url
    tab.shot("model-x86-policy")

    page.select_option("#scheme", "sym")
    wait_for_value(page, cell(activation, "mse"), sym_u8[activation]["scales"]["mse"])
    rows = shown()
    assert scales(rows[activation]) == sym_u8[activation]["scales"]
    assert scales(rows[weight]) == sym_i8[weight]["scales"]
    assert rows[activation]["calibration"] == "sym uint8"
    expect(page.locator("#calibration-note")).to_contain_text("not the x86 policy")
    assert "scheme=sym" in page.url and "dtype" not in page.url

    # Weights as the activations: the API's scales for asym uint8 in every row.
    page.select_option("#scheme", "asym")
    page.select_option("#weights", "same")
    wait_for_value(page, cell(weight, "max"), asym_u8[weight]["scales"]["max"])
    rows = shown()
    assert scales(rows[weight]) == asym_u8[weight]["scales"]
    assert rows[weight]["calibration"] == "asym uint8"
    assert "weights=same" in page.url and "scheme" not in page.url
    link = page.get_attribute(f"#layers tr[data-profile-id='{weight}'] a", "href")
    assert "scheme=asym&dtype=uint8" in link  # a chosen view goes to the layer page along
    page.reload()  # the URL holds the view
    expect(page.locator("#weights")).to_have_value("same")
    wait_for_value(page, cell(weight, "max"), asym_u8[weight]["scales"]["max"])

    page.select_option("#weights", "policy")
    wait_for_value(page, cell(weight, "max"), sym_i8[weight]["scales"]["max"])
    link = page.get_attribute(f"#layers tr[data-profile-id='{weight}'] a", "href")
    assert link == f"/dashboard/models/{model_id}/layer?pid=weight%3Ac2.weight&run={run_id}"
    assert "weights" not in page.url


def _chart(page: Page, canvas: str) -> dict:
    """What the Chart.js chart on ``canvas`` holds and draws: its data, the drawn bars, the y
    scale, the threshold lines, and how many canvas pixels have the bars' colour."""
    return page.evaluate(
        """canvas => {
            const chart = Chart.getChart(canvas);
            const bars = chart.getDatasetMeta(0).data;
            const pixels = chart.ctx.getImageData(0, 0, chart.canvas.width, chart.canvas.height);
            let coloured = 0;
            for (let i = 0; i < pixels.data.length; i += 4) {
                const [r, g, b] = pixels.data.slice(i, i + 3);  // the bars' #5b8def
                const near = (value, target) => Math.abs(value - target) < 12;
                if (near(r, 91) && near(g, 141) && near(b, 239)) coloured++;
            }
            return {
                data: chart.data.datasets[0].data,
                drawn: bars.filter(bar => Math.abs(bar.height ?? 0) > 0).length,
                yScale: chart.scales.y.type,
                lines: chart.options.plugins.thresholds.lines.map(l => [l.method, l.value]),
                coloured,
            };
        }""",
        canvas,
    )


def test_layer_page_histogram_thresholds_log_scale_and_lineage(tab, live, digits):
    page, model_id, run_id = tab.page, digits.model["id"], digits.run["id"]
    page.goto(f"/dashboard/models/{model_id}")
    page.click("#layers a:text-is('/Relu_1')")
    expect(page).to_have_url(
        f"{base_url(live)}/dashboard/models/{model_id}/layer?pid=%2FRelu_1&run={run_id}"
    )
    wait_for_chart(page, "histogram")
    # An activation: by default the x86 policy's asymmetric uint8 qparams.
    expect(page.locator("#scheme")).to_have_value("asym")
    expect(page.locator("#dtype")).to_have_value("uint8")
    expect(page.locator("#calibration-note")).to_have_text(
        "asym uint8: the x86 policy for an activation."
    )
    served = _tensor(live, run_id, "/Relu_1", **X86_ACTIVATIONS)
    tensor, qparams = served["entry"], served["qparams"]
    assert all(qparams[m]["zero_point"] == 0 and qparams[m]["dtype"] == "uint8" for m in METHODS)
    histogram = tensor["histogram"]
    assert tensor["min"] == 0 and tensor["max"] > 0  # a ReLU output

    chart = _chart(page, "histogram")
    assert [point["y"] for point in chart["data"]] == histogram["counts"]
    width = 2.0 ** histogram["exponent"]
    assert chart["data"][0]["x"] == (histogram["offset"] + 0.5) * width
    nonzero = sum(1 for count in histogram["counts"] if count)
    assert chart["yScale"] == "linear" and chart["drawn"] == nonzero and chart["coloured"] > 100
    # Both clip limits of every method: the asymmetric range starts at the minimum, 0.
    lines = sorted(tuple(line) for line in chart["lines"])
    assert lines == sorted((m, qparams[m]["range"][k]) for m in METHODS for k in (0, 1))
    assert all(qparams[m]["range"][0] == 0 for m in METHODS)
    rows = {row["method"]: row["cells"] for row in table(page, "#thresholds")}
    for method in METHODS:
        expected = qparams[method]
        assert number(rows[method]["lo"][0]) == expected["range"][0]
        assert number(rows[method]["hi"][0]) == expected["range"][1]
        assert number(rows[method]["scale"][0]) == expected["scale"]
        assert number(rows[method]["zero_point"][0]) == expected["zero_point"]
    for fact in ("min", "max", "mean", "std", "count"):
        shown = page.get_attribute(f"#facts dd[data-fact='{fact}']", "data-value")
        assert float(shown) == tensor[fact]
    tab.shot("layer-linear")

    page.check("#log-scale")
    chart = _chart(page, "histogram")
    assert chart["yScale"] == "logarithmic" and chart["drawn"] == nonzero
    tab.shot("layer-log")
    page.select_option("#scheme", "sym")  # symmetric: the range is ±max, z = 128 for uint8
    sym = _tensor(live, run_id, "/Relu_1", scheme="sym", dtype="uint8")["qparams"]
    assert sym["max"]["range"][0] == -sym["max"]["range"][1] < 0
    wait_for_value(page, "#thresholds tr[data-method=max] [data-column=lo]", sym["max"]["range"][0])
    rows = {row["method"]: row["cells"] for row in table(page, "#thresholds")}
    for method in METHODS:
        assert number(rows[method]["scale"][0]) == sym[method]["scale"]
        assert number(rows[method]["zero_point"][0]) == sym[method]["zero_point"] == 128
    expect(page.locator("#calibration-note")).to_have_text(
        "sym uint8: not the x86 policy for an activation (asym uint8)."
    )
    assert "scheme=sym&dtype=uint8" in page.url  # the chosen view is shareable
    assert _chart(page, "histogram")["yScale"] == "logarithmic"  # the toggle holds

    lineage = live.owner.get(
        f"/api/models/{model_id}/lineage", params={"profile_id": "/Relu_1"}
    ).json()
    shown = table(page, "#lineage")
    expected = [
        (stage["name"], binding["key"])
        for stage in lineage["stages"]
        for binding in stage["bindings"]
    ]
    assert [(row["stage"], row["binding"]) for row in shown] == expected
    fused = next(s for s in lineage["stages"] if s["name"] == "fuse_ops")["bindings"][0]
    assert {"/Relu_1", "/c2/Conv"} <= set(fused["layers"])  # conv, batch norm and relu: one kernel
    links = page.locator("#lineage tr[data-stage=fuse_ops] a[data-layer]")
    assert sorted(links.all_inner_texts()) == sorted(set(fused["layers"]) - {"/Relu_1"})
    page.click("#lineage tr[data-stage=fuse_ops] a[data-layer='/c2/Conv']")
    expect(page.locator("#title")).to_have_text("/c2/Conv")
    assert "scheme=sym&dtype=uint8" in page.url  # the chosen view goes along
    expect(page.locator("#scheme")).to_have_value("sym")
    wait_for_chart(page, "histogram")
    conv = live.owner.get(f"/api/runs/{run_id}/tensor", params={"profile_id": "/c2/Conv"}).json()
    counts = [point["y"] for point in _chart(page, "histogram")["data"]]
    assert counts == conv["entry"]["histogram"]["counts"]
    tab.shot("layer-lineage-click")


def _tensor(live: Live, run_id: int, profile_id: str, **params) -> dict:
    response = live.owner.get(
        f"/api/runs/{run_id}/tensor", params={"profile_id": profile_id, **params}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_weight_layer_shows_its_per_channel_ranges(tab, live, digits):
    page, model_id, run_id = tab.page, digits.model["id"], digits.run["id"]
    page.goto(f"/dashboard/models/{model_id}/layer?pid=weight%3Ac2.weight&run={run_id}")
    wait_for_chart(page, "per-channel")
    # A weight: by default the x86 policy's symmetric int8 qparams, not the activations' uint8.
    expect(page.locator("#scheme")).to_have_value("sym")
    expect(page.locator("#dtype")).to_have_value("int8")
    note = page.locator("#calibration-note")
    expect(note).to_contain_text("sym int8: the x86 policy for a weight")
    sym = _tensor(live, run_id, "weight:c2.weight", **X86_WEIGHTS)["qparams"]
    asym = _tensor(live, run_id, "weight:c2.weight", **X86_ACTIVATIONS)["qparams"]
    assert sym["max"]["scale"] != asym["max"]["scale"]
    rows = {row["method"]: row["cells"] for row in table(page, "#thresholds")}
    for method in METHODS:
        assert number(rows[method]["scale"][0]) == sym[method]["scale"]
        assert number(rows[method]["zero_point"][0]) == sym[method]["zero_point"] == 0
    assert "scheme" not in page.url  # the policy is no choice: the URL stays as it was
    served = live.owner.get(f"/api/runs/{run_id}/tensor", params={"profile_id": "weight:c2.weight"})
    channels = served.json()["entry"]["per_channel"]
    ranges = page.evaluate("Chart.getChart('per-channel').data.datasets[0].data")
    assert ranges == [list(pair) for pair in zip(channels["min"], channels["max"], strict=True)]
    assert len(ranges) == 32
    drawn = page.evaluate(
        "Chart.getChart('per-channel').getDatasetMeta(0).data.filter(b => b.height > 0).length"
    )
    assert drawn == 32
    expect(page.locator("#per-channel-note")).to_contain_text("32 channels along axis 0")
    tab.shot("layer-weight")


def test_run_progress_is_live_and_two_runs_compare(tab, live, digits):
    page, model_id = tab.page, digits.model["id"]
    page.goto(f"/dashboard/models/{model_id}")
    page.evaluate("window.sameDocument = true")  # gone if the page reloads
    # Long enough for 1 s page polls (progress is written every 0.5 s) to catch it part done:
    # over 10 s on a Zen 3 core, seconds even on a fast machine.
    page.fill("#new-run input[name=random]", "5000")
    page.click("#new-run button")
    rows = page.locator("#runs tbody tr")
    expect(rows).to_have_count(2)
    new = page.locator("#runs tbody tr").last
    run_id = int(new.get_attribute("data-run-id"))
    # Seen while it runs, part done, then done: the page polls; nobody reloads it.
    page.wait_for_function(
        """id => {
            const row = document.querySelector(`#runs tr[data-run-id="${id}"]`);
            const bar = row.querySelector('[role=progressbar]');
            const done = Number(bar.getAttribute('aria-valuenow'));
            return row.dataset.status === 'running' && done > 0 && done < 100;
        }""",
        arg=run_id,
        timeout=120_000,
    )
    tab.shot("model-run-in-progress")
    expect(page.locator(f"#runs tr[data-run-id='{run_id}']")).to_have_attribute(
        "data-status", "done", timeout=120_000
    )
    expect(page.locator(f"#runs tr[data-run-id='{run_id}'] [role=progressbar]")).to_have_attribute(
        "aria-valuenow", "100"
    )
    assert page.evaluate("window.sameDocument") is True

    page.check(f"#runs tr[data-run-id='{digits.run['id']}'] .pick")
    page.check(f"#runs tr[data-run-id='{run_id}'] .pick")
    page.click("#compare")
    expect(page).to_have_url(f"{base_url(live)}/dashboard/compare?a={digits.run['id']}&b={run_id}")
    page.wait_for_selector("#drift tbody tr")
    drift = live.owner.get(f"/api/runs/{digits.run['id']}/compare/{run_id}").json()["tensors"]
    shown = table(page, "#drift")
    distances = [number(row["cells"]["histogram_distance"][0]) for row in shown]
    assert distances == sorted((t["histogram_distance"] for t in drift), reverse=True)
    by_id = {t["profile_id"]: t for t in drift}
    for row in shown:
        expected = by_id[row["profileId"]]
        assert number(row["cells"]["histogram_distance"][0]) == expected["histogram_distance"]
        assert number(row["cells"]["range_change"][0]) == expected["range_change"]
    assert shown[0]["profileId"] == "input:image"  # random data is farthest from the digits
    tab.shot("compare")


def test_run_page_downloads_the_profile_and_every_export(tab, live, digits, tmp_path):
    page, run_id = tab.page, digits.run["id"]
    page.goto(f"/dashboard/runs/{run_id}")
    expect(page.locator("#facts [data-fact=status]")).to_have_text("done")
    with page.expect_download() as download:
        page.click("#download-profile")
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.name == f"digits_cnn.run{run_id}.profile.json"
    assert json.loads(saved.read_text()) == live.owner.get(f"/api/runs/{run_id}/profile").json()
    page.select_option("#export-method", "mse")
    for fmt in ("aimet", "ort", "ort-json", "tensorrt"):
        with page.expect_download() as download:
            page.click(f"#downloads button[data-format='{fmt}']")
        saved = tmp_path / download.value.suggested_filename
        download.value.save_as(saved)
        params = {"format": fmt, "method": "mse"}
        assert saved.read_text() == live.owner.get(f"/api/runs/{run_id}/export", params=params).text
    tab.shot("run")


def test_run_page_downloads_the_qdq_model_the_overlays_and_the_report(tab, live, digits, tmp_path):
    page, run_id = tab.page, digits.run["id"]
    finished_evaluation(live, digits.evaluation_id)
    page.goto(f"/dashboard/runs/{run_id}")
    expect(page.locator("#facts [data-fact=status]")).to_have_text("done")

    def save(selector: str) -> Path:
        with page.expect_download() as download:
            page.click(selector)
        saved = tmp_path / download.value.suggested_filename
        download.value.save_as(saved)
        return saved

    page.select_option("#export-method", "mse")
    export = f"/api/runs/{run_id}/export"
    qdq = save("#downloads button[data-format='qdq']")
    assert qdq.name == f"digits_cnn.run{run_id}.mse.int8.onnx"
    served = live.owner.get(export, params={"format": "qdq", "method": "mse"}).content
    assert qdq.read_bytes() == served and onnx.load_model_from_string(served).graph.node

    # With the run's evaluation chosen, the overlays and the report show it.
    option = page.locator(f"#export-evaluation option[value='{digits.evaluation_id}']")
    expect(option).to_have_count(1)
    page.select_option("#export-evaluation", str(digits.evaluation_id))
    overlays = save("#downloads button[data-format='model-explorer']")
    assert overlays.name.endswith(f"evaluation{digits.evaluation_id}.model-explorer.zip")
    evaluated = live.owner.get(f"/api/evaluations/{digits.evaluation_id}/model-explorer")
    assert overlays.read_bytes() == evaluated.content
    with zipfile.ZipFile(overlays) as archive:
        assert "isolated_sqnr.json" in archive.namelist()
    report = save("#download-report")
    assert report.name == f"digits_cnn.run{run_id}.evaluation{digits.evaluation_id}.report.html"
    served = live.owner.get(
        f"/api/runs/{run_id}/report", params={"evaluation": digits.evaluation_id}
    ).text
    assert report.read_text() == served and 'id="evaluation-summary"' in served


def test_evaluation_page_lists_layers_worst_first_and_colours_the_graph(tab, live, digits):
    page = tab.page
    evaluation = finished_evaluation(live, digits.evaluation_id)
    report = evaluation["report"]
    assert report["layers"] == worst_first(report["layers"])  # the API's order, worst first
    page.goto(f"/dashboard/evaluations/{digits.evaluation_id}")
    page.wait_for_selector("#sqnr tbody tr")
    expect(page.locator("#facts [data-fact='output SQNR']")).to_have_text(
        f"{report['output_sqnr_db']} dB"
    )
    shown = table(page, "#sqnr")
    assert [row["profileId"] for row in shown] == [e["profile_id"] for e in report["layers"]]
    for row, expected in zip(shown, report["layers"], strict=True):
        for column in ("isolated", "accumulated"):
            value, classes = row["cells"][column]
            assert number(value) == expected[f"{column}_sqnr_db"]
            assert sqnr_class(expected[f"{column}_sqnr_db"]) in classes.split()

    model = live.owner.get(f"/api/models/{digits.model['id']}").json()
    partition = next(s for s in model["stages"] if s["name"] == "partition")
    main_bindings = [key for key in partition["lineage"] if key.startswith("main/")]
    nodes = page.eval_on_selector_all(
        "#graph g.node", "nodes => nodes.map(n => [n.dataset.profileId, n.dataset.level])"
    )
    assert len(nodes) == len(main_bindings)
    errors = {e["profile_id"]: e for e in report["layers"]}
    assert {pid for pid, level in nodes if level != "fp32"} == set(errors)  # every region drawn
    for pid, level in nodes:
        assert level == (
            "fp32" if pid not in errors else sqnr_class(errors[pid]["isolated_sqnr_db"])
        )
    tab.shot("evaluation")

    # Stricter thresholds: the colours follow, in the table and the graph.
    worst = report["layers"][0]["isolated_sqnr_db"]
    page.fill("#good", str(worst + 1))
    page.dispatch_event("#good", "change")
    first = table(page, "#sqnr")[0]["cells"]["isolated"][1].split()
    assert sqnr_class(worst, worst + 1) == "warn" and "warn" in first
    level = page.get_attribute(
        f"#graph g.node[data-profile-id='{report['layers'][0]['profile_id']}']", "data-level"
    )
    assert level == "warn"
    page.select_option("#graph-metric", "accumulated")
    for pid, level in page.eval_on_selector_all(
        "#graph g.node", "nodes => nodes.map(n => [n.dataset.profileId, n.dataset.level])"
    ):
        if pid in errors:
            assert level == sqnr_class(errors[pid]["accumulated_sqnr_db"], worst + 1)
    tab.shot("evaluation-strict")


def test_run_page_queues_evaluations_and_takes_reports(tab, live, digits, tmp_path):
    page, run_id = tab.page, digits.run["id"]
    evaluation = finished_evaluation(live, digits.evaluation_id)
    report = evaluation["report"]
    assert evaluation["weight_bits"] == report["weight_bits"] == 7  # the worker's plugin's
    page.goto(f"/dashboard/runs/{run_id}")
    row = page.locator(f"#evaluations tr[data-evaluation-id='{digits.evaluation_id}']")
    expect(row).to_have_attribute("data-status", "done")
    expect(row.locator("td").nth(6)).to_have_text("7")
    data = tmp_path / "eval.npz"
    np.savez(data, test=np.load(DIGITS)["test"][:8])
    page.set_input_files("#evaluate input[name=data]", str(data))
    page.fill("#evaluate input[name=key]", "test")
    page.fill("#evaluate input[name=labels_key]", "labels")
    page.click("#evaluate button")
    expect(page.locator("#evaluate-error")).to_contain_text("eval.npz: no array 'labels'")

    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    before = page.locator("#evaluations tbody tr").count()
    page.set_input_files("#report input[name=file]", str(path))
    page.click("#report button")
    expect(page.locator("#evaluations tbody tr")).to_have_count(before + 1)
    uploaded = page.locator("#evaluations tbody tr").last
    expect(uploaded).to_have_attribute("data-source", "report")
    expect(uploaded).to_have_attribute("data-status", "done")
    stored = live.owner.get(f"/api/evaluations/{uploaded.get_attribute('data-evaluation-id')}")
    assert stored.json()["report"] == report and stored.json()["weight_bits"] == 7
    tab.shot("run-evaluations")


def _evaluation_data(folder: Path) -> Path:
    """32 digits and their labels, one .npz."""
    arrays = np.load(DIGITS)
    path = folder / "eval.npz"
    np.savez(path, test=arrays["test"][:32], test_labels=arrays["test_labels"][:32])
    return path


def _shown_request(page: Page, where: str) -> dict:
    """The request a page shows, unfolded."""
    page.locator(f"{where} details.request summary").click()
    return json.loads(page.locator(f"{where} details.request pre").text_content())


def test_run_page_evaluates_every_method_and_the_page_shows_them(tab, live, digits, tmp_path):
    page, run_id = tab.page, digits.run["id"]
    page.goto(f"/dashboard/runs/{run_id}")
    expect(page.locator("#facts [data-fact=status]")).to_have_text("done")
    form = page.locator("#evaluate")
    form.locator("[name=data]").set_input_files(str(_evaluation_data(tmp_path)))
    form.locator("[name=key]").fill("test")
    form.locator("[name=labels_key]").fill("test_labels")
    form.locator("[name=method]").select_option("all")
    form.locator("[name=fp32_fallback]").check()
    form.locator("[name=accuracy_budget]").fill("1")
    before = {e["id"] for e in live.owner.get(f"/api/runs/{run_id}/evaluations").json()}
    form.locator("button").click()
    poll_until(
        lambda: (
            {e["id"] for e in live.owner.get(f"/api/runs/{run_id}/evaluations").json()} - before
        ),
        30,
        0.2,
        "the evaluation is queued",
    )
    (evaluation_id,) = {
        e["id"] for e in live.owner.get(f"/api/runs/{run_id}/evaluations").json()
    } - before
    evaluation = finished_evaluation(live, evaluation_id)
    request, report = evaluation["request"], evaluation["report"]
    assert (request["method"], request["fp32_fallback"], request["accuracy_budget"]) == (
        "all",
        True,
        1,
    )

    page.goto(f"/dashboard/evaluations/{evaluation_id}")
    page.wait_for_selector("#sqnr tbody tr")
    expect(page.locator("#facts [data-fact='method / target']")).to_have_text(
        f"all (best: {report['method']}) / x86"
    )
    expect(page.locator("#facts [data-fact='FP32 fallback']")).to_have_text("yes")
    expect(page.locator("#facts [data-fact='accuracy budget']")).to_have_text("1 point")
    rows = table(page, "#methods")
    assert [row["method"] for row in rows] == [m["method"] for m in report["methods"]]
    best = page.locator(f"#methods tr[data-method='{report['method']}']")
    expect(best).to_have_class("best")
    expect(best.locator("td").first).to_have_text(f"{report['method']} (best)")
    assert _shown_request(page, "#facts") == request
    tab.shot("evaluation-every-method")


def _builds(live: Live, run_id: int) -> dict[int, dict]:
    return {b["id"]: b for b in live.owner.get(f"/api/runs/{run_id}/builds").json()}


def _new_build(live: Live, run_id: int, before: set[int]) -> int:
    (build_id,) = poll_until(
        lambda: set(_builds(live, run_id)) - before, 30, 0.2, "the build is queued"
    )
    return build_id


# Each row's status, phase and progress, sampled as the page redraws them (every poll replaces
# the rows, so a sampler sees what a person would).
SAMPLE_BUILDS = """() => {
    window.sameDocument = true;
    window.seen = [];
    setInterval(() => {
        for (const row of document.querySelectorAll('#builds tbody tr')) {
            const bar = row.querySelector('[role=progressbar]');
            window.seen.push([row.dataset.buildId, row.dataset.status, row.dataset.phase,
                              Number(bar.getAttribute('aria-valuenow'))]);
        }
    }, 50);
}"""


def test_run_page_builds_an_artifact_and_cancels_a_queued_build(tab, live, digits, tmp_path):
    page, run_id = tab.page, digits.run["id"]
    page.goto(f"/dashboard/runs/{run_id}")
    expect(page.locator("#facts [data-fact=status]")).to_have_text("done")
    form = page.locator("#build")
    percentile = form.locator("[name=percentile]")
    expect(percentile).to_be_disabled()  # only for method percentile
    form.locator("[name=target]").select_option("x86")
    form.locator("[name=method]").select_option("percentile")
    expect(percentile).to_be_enabled()
    # A percentile no other test builds with: a compile from the build cache would be over
    # between two of the page's polls.
    percentile.fill("99.97")
    form.locator("[name=weight_bits]").select_option("7")
    page.evaluate(SAMPLE_BUILDS)
    before = set(_builds(live, run_id))
    form.locator("button[type=submit]").click()
    build_id = _new_build(live, run_id, before)
    queued = live.owner.get(f"/api/builds/{build_id}").json()
    request = (queued["target"], queued["method"], queued["percentile"])
    assert request == ("x86", "percentile", 99.97)
    assert queued["weight_bits"] == 7 and queued["qparams_id"] is None

    # Live: the page polls the build from queued through its phases to done; nobody reloads.
    row = page.locator(f"#builds tr[data-build-id='{build_id}']")
    expect(row).to_have_attribute("data-status", "done", timeout=300_000)
    expect(row.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "100")
    assert page.evaluate("window.sameDocument") is True
    # The sampler ticks every 50 ms: the row can be done a tick before it records so.
    page.wait_for_function(
        "id => window.seen.some(s => s[0] === id && s[1] === 'done')", arg=str(build_id)
    )
    seen = [s for s in page.evaluate("window.seen") if s[0] == str(build_id)]
    # Running, first without a phase (the job process starting), then in the build's phases.
    phases = {phase for _, status, phase, _ in seen if status == "running"} - {""}
    assert phases and phases <= {"quantizing", "compiling", "packing"}, seen
    assert seen[-1][1:] == ["done", "", 100]
    build = live.owner.get(f"/api/builds/{build_id}").json()
    assert build["status"] == "done", build["error"]
    regions = build["manifest"]["regions"]
    int8 = sum(1 for region in regions if region["mode"] == "int8")
    assert int8 > 0
    count = row.locator("[data-column=int8-regions]")
    expect(count).to_have_attribute("data-value", str(int8))
    expect(count).to_have_attribute("data-regions", str(len(regions)))
    expect(count).to_have_text(f"{int8} of {len(regions)}")
    assert row.locator("button.cancel").count() == 0
    tab.shot("run-builds")

    # The artifact, fetched with the token: the zip the API serves, its manifest the API's.
    with page.expect_download() as download:
        row.locator("button.artifact").click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.name == f"digits_cnn-x86-build{build_id}.zip"
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == build["artifact_sha256"]
    with zipfile.ZipFile(saved) as archive:
        assert sorted(archive.namelist()) == ["manifest.json", "model.so"]
        manifest = json.loads(archive.read("manifest.json"))
        assert archive.read("model.so")[:4] == b"\x7fELF"
    assert manifest["regions"] == regions and manifest == build["manifest"]
    assert manifest["target"] == "x86" and "±63" in manifest["policy"]["weights"]

    # A queued build is cancelled. Two long runs of another model hold the worker's two slots
    # (it takes runs before builds), so the build stays queued until it is cancelled.
    other = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
    busy = [start_run(live.owner, other, random=str(Limits().max_samples))["id"] for _ in range(2)]
    try:
        form.locator("[name=target]").select_option("npu")
        form.locator("[name=method]").select_option("mse")
        expect(percentile).to_be_disabled()
        before = set(_builds(live, run_id))
        form.locator("button[type=submit]").click()
        queued_id = _new_build(live, run_id, before)
        row = page.locator(f"#builds tr[data-build-id='{queued_id}']")
        expect(row).to_have_attribute("data-status", "queued")
        expect(row.locator("[role=progressbar]")).to_have_text("queued 0%")
        assert row.locator("button.artifact").count() == 0
        row.locator("button.cancel").click()
        expect(row).to_have_attribute("data-status", "cancelled")
        expect(row).to_contain_text("cancelled by its owner")
        assert row.locator("button.cancel").count() == 0
        cancelled = live.owner.get(f"/api/builds/{queued_id}").json()
        assert (cancelled["status"], cancelled["started_at"]) == ("cancelled", None)
        assert cancelled["target"] == "npu" and cancelled["method"] == "mse"
        expect(page.locator("#build-error")).to_be_hidden()
        tab.shot("run-builds-cancelled")
    finally:
        for run in busy:
            live.owner.post(f"/api/runs/{run}/cancel")


def test_run_page_builds_with_an_accuracy_budget_and_shows_the_request(tab, live, digits, tmp_path):
    """A badly clipped calibration (percentile 50) and a budget of 0 points: the build widens
    its most sensitive layers (int16, else FP32), and its row says how many and shows its
    request."""
    page, run_id = tab.page, digits.run["id"]
    page.goto(f"/dashboard/runs/{run_id}")
    expect(page.locator("#facts [data-fact=status]")).to_have_text("done")
    form = page.locator("#build")
    data = form.locator("[name=data]")
    expect(data).to_be_disabled()  # evaluation data goes with a budget
    form.locator("[name=method]").select_option("percentile")
    form.locator("[name=percentile]").fill("50")
    form.locator("[name=fp32_fallback]").check()
    form.locator("[name=accuracy_budget]").fill("0")
    expect(data).to_be_enabled()
    form.locator("button[type=submit]").click()  # no data yet: the API refuses
    expect(page.locator("#build-error")).to_contain_text("'accuracy_budget' needs 'data'")
    data.set_input_files(str(_evaluation_data(tmp_path)))
    # Stored bias correction reads channel means this run's profile does not hold.
    form.locator("[name=bias_correction]").select_option("stored")
    form.locator("[name=key]").fill("test")
    form.locator("button[type=submit]").click()
    expect(page.locator("#build-error")).to_contain_text("profiled with 'channel_stats'")
    form.locator("[name=bias_correction]").select_option("")
    form.locator("[name=key]").fill("test")
    form.locator("[name=labels_key]").fill("test_labels")
    form.locator("[name=samples]").fill("32")
    before = set(_builds(live, run_id))
    form.locator("button[type=submit]").click()
    build_id = _new_build(live, run_id, before)
    expect(page.locator("#build-error")).to_be_hidden()
    request = live.owner.get(f"/api/builds/{build_id}").json()["request"]
    assert (request["method"], request["percentile"]) == ("percentile", 50)
    assert (request["fp32_fallback"], request["accuracy_budget"]) == (True, 0)
    assert (request["data"], request["labels"]) == ("eval.npz:test", "eval.npz:test_labels")

    row = page.locator(f"#builds tr[data-build-id='{build_id}']")
    expect(row).to_have_attribute("data-status", "done", timeout=300_000)
    build = live.owner.get(f"/api/builds/{build_id}").json()
    manifest = build["manifest"]
    kept, wide, regions = manifest["kept_fp32"], manifest["kept_int16"], manifest["regions"]
    assert kept or wide
    expect(row.locator("[data-column=fp32]")).to_have_text(
        f"fallback, budget 0 pts: {len(wide)} int16, {len(kept)} FP32"
    )
    expect(row.locator("[data-column=int8-regions]")).to_have_text(
        f"{len(regions) - len(kept) - len(wide)} of {len(regions)}"
    )
    assert _shown_request(page, f"#builds tr[data-build-id='{build_id}']") == request
    tab.shot("run-build-budget")


def test_a_thousand_layer_model_is_paged_by_the_server(tab, live, synthetic):
    page = tab.page
    started = time.monotonic()
    page.goto(f"/dashboard/models/{synthetic.model_id}")
    expect(page.locator("#range")).to_have_text(f"rows 1–50 of {SYNTHETIC_LAYERS}")
    loaded = time.monotonic() - started
    assert page.locator("#layers tbody tr").count() == 50
    served = _policy_page(live, synthetic.model_id, run=synthetic.run_id)
    _same_rows(table(page, "#layers"), served)
    page.click("#next")
    expect(page.locator("#range")).to_have_text(f"rows 51–100 of {SYNTHETIC_LAYERS}")
    assert page.locator("#layers tbody tr").count() == 50
    page.click("#layers th[data-sort=min]")
    page.click("#layers th[data-sort=min]")  # descending: the unprofiled layers come last
    served = _policy_page(live, synthetic.model_id, run=synthetic.run_id, sort="min", order="desc")
    # Both clicks show rows 1–50: wait for the descending page itself, not the range.
    first = page.locator("#layers tbody tr").first
    expect(first).to_have_attribute("data-profile-id", served["rows"][0]["profile_id"])
    _same_rows(table(page, "#layers"), served)
    page.fill("#search", "block99")
    expect(page.locator("#range")).to_have_text("rows 1–11 of 11")  # block99, block990..999
    tab.shot("model-1000-layers")
    print(f"1000-layer model page: first 50 rows shown {loaded:.2f} s after navigation")


# The API behind the dashboard, on both backends


@pytest.fixture(scope="module", params=BACKENDS)
def backend_live(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"api-{request.param}")
    with live_service(request.param, folder, Limits(max_data_bytes=100_000)) as service:
        yield service, add_synthetic_model(service.url)


def test_layer_table_api_searches_sorts_and_pages(backend_live):
    live, synthetic = backend_live
    path = f"/api/models/{synthetic.model_id}/layers"

    def page(**params) -> dict:
        response = live.owner.get(path, params={"run": synthetic.run_id, **params})
        assert response.status_code == 200, response.text
        return response.json()

    first = page(limit=100)
    assert (first["total"], len(first["rows"])) == (SYNTHETIC_LAYERS, 100)
    assert [row["position"] for row in first["rows"]] == list(range(100))
    profiled = {e["profile_id"]: e for e in synthetic.profile["tensors"]}
    for row in first["rows"][:40]:
        tensor = profiled[row["profile_id"]]
        assert (row["min"], row["max"]) == (tensor["min"], tensor["max"])
        static = tensor["kind"] == "weight" or tensor["static"]  # the x86 policy's grids
        grid = X86_WEIGHTS if static else X86_ACTIVATIONS
        for method in METHODS:
            expected = qparams_for(tensor, CalibrationOptions(method=method, **grid)).scale
            assert row["scales"][method] == expected
    asym = page(limit=3, scheme="asym", dtype="uint8")["rows"][1]
    options = CalibrationOptions(method="mse", scheme="asym", dtype="uint8")
    assert asym["scales"]["mse"] == qparams_for(profiled[asym["profile_id"]], options).scale

    last = page(offset=SYNTHETIC_LAYERS - UNPROFILED - 1, limit=50)["rows"]
    assert len(last) == UNPROFILED + 1 and last[1]["min"] is None and last[1]["scales"] == {}
    for order in ("asc", "desc"):
        rows = page(sort="min", order=order, limit=100, offset=SYNTHETIC_LAYERS - 100)["rows"]
        values = [row["min"] for row in rows]
        assert values[-UNPROFILED:] == [None] * UNPROFILED  # unprofiled layers last either way
        known = values[:-UNPROFILED]
        assert known == sorted(known, reverse=order == "desc")
    # Ties (and a collation-free column: PostgreSQL's text order is the locale's) by position.
    weights_first = page(sort="kind", order="desc", limit=3)["rows"]
    assert [row["position"] for row in weights_first] == [4, 9, 14]

    assert page(q="BLOCK99")["total"] == 11
    odd = page(q="e%/r")  # % is a character here, not a LIKE wildcard
    assert [row["profile_id"] for row in odd["rows"]] == ["/odd_name%/Relu"]
    assert page(q="_name%")["total"] == 1 and page(q="k1_")["total"] == 0
    weights = page(q="weight:", sort="max", order="desc", limit=20)
    assert weights["total"] == SYNTHETIC_LAYERS // 5
    assert all(row["kind"] == "weight" for row in weights["rows"])
    maxima = [row["max"] for row in weights["rows"]]
    assert maxima == sorted(maxima, reverse=True)
    no_run = live.owner.get(path, params={"limit": 2}).json()
    assert no_run["run_id"] is None and no_run["rows"][0]["min"] is None

    refusals = [
        (live.stranger, {}, 404, "model"),
        (live.owner, {"run": synthetic.failed_run_id}, 409, "is failed: no data"),
        (live.owner, {"run": 999_999}, 404, "run 999999 not found"),
        (live.owner, {"sort": "scale"}, 422, "sort"),
        (live.owner, {"limit": 501}, 422, "limit"),
        (live.owner, {"scheme": "weird"}, 422, "query scheme: Input should be 'sym' or 'asym'"),
    ]
    for api, params, code, detail in refusals:
        response = api.get(path, params=params)
        assert response.status_code == code and detail in response.json()["detail"], params
    tensor = f"/api/runs/{synthetic.run_id}/tensor"
    missing = live.owner.get(tensor, params={"profile_id": "/nope"})
    assert missing.status_code == 404 and "'/nope'" in missing.json()["detail"]
    lineage = live.owner.get(
        f"/api/models/{synthetic.model_id}/lineage", params={"profile_id": "x"}
    )
    assert lineage.status_code == 404


def _report(synthetic: Synthetic) -> dict:
    ids = [e["profile_id"] for e in synthetic.profile["tensors"] if e["kind"] == "activation"][:3]
    return {
        "method": "mse",
        "target": "x86",
        "samples": 8,
        "agreement": 100.0,
        "output_sqnr_db": 31.5,
        "layers": [
            {
                "profile_id": pid,
                "region": f"region{i}",
                "pattern": "rangeprof_x86.conv2d_bias_relu",
                "mode": "int8",
                "isolated_sqnr_db": 20.0 + i,
                "accumulated_sqnr_db": None if i == 2 else 19.0 + i,
                "isolated_rmse_per_scale": 0.5,
                "accumulated_rmse_per_scale": 0.6,
            }
            for i, pid in enumerate(ids)
        ],
        "kept_fp32": [],
        "methods": [{"method": "mse", "output_sqnr_db": 31.5, "agreement": 100.0}],
    }


def test_evaluation_api_refuses_bad_input_and_leaves_nothing_behind(backend_live):
    live, synthetic = backend_live
    path = f"/api/runs/{synthetic.run_id}/evaluations"
    rows, files = row_counts(live.url), stored_files(live.storage)
    good = npz_bytes(x=np.ones((6, 4), np.float32), y=np.arange(6), y2=np.ones((6, 2), np.int64))

    def post(data=good, api=live.owner, run=synthetic.run_id, labels=None, **form):
        files = {"data": ("eval.npz", data)}
        if labels is not None:
            files["labels"] = ("labels.npz", labels)
        return api.post(f"/api/runs/{run}/evaluations", files=files, data=form)

    refusals = [
        (post(method="median", key="x"), 422, "body method"),
        (post(target="gpu", key="x"), 422, "body target: Input should be 'x86', 'aarch64' or"),
        (post(key="y"), 422, "eval.npz"),  # int labels are no float input: what it holds
        (post(data=b"PK-not-a-zip", key="x"), 400, "eval.npz"),
        (post(key="x", labels_key="nope"), 400, "eval.npz: no array 'nope'"),
        (post(key="x", labels_key="y2"), 400, "labels must be a 1-D integer array"),
        (post(key="x", labels=npz_bytes(y=np.arange(3))), 400, "3 labels for 6 samples"),
        (post(key="x", labels=npz_bytes(a=np.arange(6), b=np.arange(6))), 400, "labels_key"),
        (post(key="x", samples="0"), 422, "samples"),
        (post(key="x", weight_bits="6"), 422, "weight_bits"),
        (post(key="x", accuracy_budget="-1"), 422, "accuracy_budget"),
        (post(key="x", fp32_fallback="maybe"), 422, "fp32_fallback"),
        (post(key="x", run=synthetic.failed_run_id), 409, "is failed: no data"),
        (post(key="x", api=live.stranger), 404, f"run {synthetic.run_id} not found"),
        (post(data=b"x" * 250_000, key="x"), 413, "larger than the limit"),
    ]
    for response, code, detail in refusals:
        assert response.status_code == code, response.text
        assert detail in response.json()["detail"]
    report_path = f"{path}/report"
    bad_report = {**_report(synthetic)}
    bad_report["layers"] = [{**bad_report["layers"][0], "profile_id": "/elsewhere"}]
    response = live.owner.post(report_path, json=bad_report)
    assert response.status_code == 400 and "'/elsewhere' is not a profileID" in response.text
    response = live.owner.post(report_path, json={"method": "mse"})
    assert response.status_code == 422 and "body target" in response.json()["detail"]
    response = live.owner.post(report_path, json={**_report(synthetic), "target": "gpu"})
    assert response.status_code == 422 and "body target" in response.json()["detail"]
    assert row_counts(live.url) == rows
    assert stored_files(live.storage) == files


def test_an_uploaded_report_is_stored_listed_and_deleted_with_its_model(backend_live):
    live, synthetic = backend_live
    report = _report(synthetic)
    response = live.owner.post(f"/api/runs/{synthetic.run_id}/evaluations/report", json=report)
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["report"] == report and created["source"] == "report"
    assert (created["status"], created["data"], created["percentile"]) == ("done", None, None)
    assert created["weight_bits"] == 8  # a report that does not say: 8-bit weights
    assert live.owner.get(f"/api/evaluations/{created['id']}").json() == created
    listed = live.owner.get(f"/api/runs/{synthetic.run_id}/evaluations").json()
    summary = next(e for e in listed if e["id"] == created["id"])
    assert "report" not in summary and summary["output_sqnr_db"] == 31.5
    assert live.stranger.get(f"/api/evaluations/{created['id']}").status_code == 404
    assert live.stranger.get(f"/api/runs/{synthetic.run_id}/evaluations").status_code == 404
    evaluations = row_counts(live.url)["evaluation"]
    assert live.owner.delete(f"/api/models/{synthetic.model_id}").status_code == 204
    assert row_counts(live.url)["evaluation"] == evaluations - 1
    assert live.owner.get(f"/api/evaluations/{created['id']}").status_code == 404
