"""The web dashboard (``/dashboard``) in headless Chromium, driven by Playwright, against a real
server (uvicorn on a loopback port, SQLite, the in-process worker) holding a real profile of
digits_cnn and a real evaluation: log in, open every page, click layer -> histogram -> lineage,
toggle the log scale, and compare what is drawn with what the API returns. Screenshots are
written to ``test-results/dashboard/``.

Also the API the dashboard reads (the paged layer table, evaluations), on SQLite and PostgreSQL,
with a synthetic 1000-layer model written straight to the database.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from sqlalchemy import select

from api.db import Database
from api.documents import store_profile
from api.limits import Limits
from api.models import Layer, Model, Run, Token, utcnow
from profiler.calibration import CalibrationOptions, qparams_for

import onnx_builders as mb
from conftest import zoo_model
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


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


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
    wait_until(
        lambda: live.owner.get(path).json()["status"] in ("done", "failed"), "evaluation runs"
    )
    evaluation = live.owner.get(path).json()
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
            common = {"model_id": model.id, "data_kind": "random", "bins": 256, "seed": 0}
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
    value (``data-value``) and colour class."""
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
    served = _layer_page(live, model_id, run=run_id)
    expect(page.locator("#range")).to_have_text(f"rows 1–{served['total']} of {served['total']}")
    expect(page.locator("#run")).to_have_value(str(run_id))  # the newest done run
    _same_rows(table(page, "#layers"), served)
    assert all(served["rows"][i]["scales"] for i in (1, 5, 13))  # conv, relu outputs have scales
    tab.shot("model")

    page.fill("#search", "RELU")
    served = _layer_page(live, model_id, run=run_id, q="relu")
    assert served["total"] == 4
    expect(page.locator("#range")).to_have_text("rows 1–4 of 4")
    _same_rows(table(page, "#layers"), served)
    page.click("#layers th[data-sort=max]")
    page.click("#layers th[data-sort=max]")
    expect(page.locator("#layers th[data-sort=max]")).to_have_class("num sorted-desc")
    _same_rows(
        table(page, "#layers"),
        _layer_page(live, model_id, run=run_id, q="relu", sort="max", order="desc"),
    )
    assert "sort=max" in page.url and "order=desc" in page.url  # the view can be shared

    page.fill("#search", "")
    page.select_option("#limit", "25")
    total = _layer_page(live, model_id)["total"]
    expect(page.locator("#range")).to_have_text(f"rows 1–25 of {total}")
    page.click("#next")
    expect(page.locator("#range")).to_have_text(f"rows 26–{min(50, total)} of {total}")
    served = _layer_page(live, model_id, run=run_id, sort="max", order="desc", offset=25, limit=25)
    _same_rows(table(page, "#layers"), served)


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
    served = live.owner.get(f"/api/runs/{run_id}/tensor", params={"profile_id": "/Relu_1"}).json()
    tensor, qparams = served["entry"], served["qparams"]
    histogram = tensor["histogram"]
    assert tensor["min"] == 0 and tensor["max"] > 0  # a ReLU output

    chart = _chart(page, "histogram")
    assert [point["y"] for point in chart["data"]] == histogram["counts"]
    width = 2.0 ** histogram["exponent"]
    assert chart["data"][0]["x"] == (histogram["offset"] + 0.5) * width
    nonzero = sum(1 for count in histogram["counts"] if count)
    assert chart["yScale"] == "linear" and chart["drawn"] == nonzero and chart["coloured"] > 100
    # The upper clip limit of every method; the negative ones of a symmetric range clip nothing
    # here and are only listed.
    lines = sorted(tuple(line) for line in chart["lines"])
    assert lines == sorted((m, qparams[m]["range"][1]) for m in METHODS)
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
    page.select_option("#scheme", "asym")  # asymmetric: the range starts at the minimum, 0
    page.wait_for_function(
        "document.querySelector('#thresholds tr[data-method=max] [data-column=lo]')"
        ".dataset.value === '0'"
    )
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
    wait_for_chart(page, "histogram")
    conv = live.owner.get(f"/api/runs/{run_id}/tensor", params={"profile_id": "/c2/Conv"}).json()
    counts = [point["y"] for point in _chart(page, "histogram")["data"]]
    assert counts == conv["entry"]["histogram"]["counts"]
    tab.shot("layer-lineage-click")


def test_weight_layer_shows_its_per_channel_ranges(tab, live, digits):
    page, model_id, run_id = tab.page, digits.model["id"], digits.run["id"]
    page.goto(f"/dashboard/models/{model_id}/layer?pid=weight%3Ac2.weight&run={run_id}")
    wait_for_chart(page, "per-channel")
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
    # Long enough (seconds, even on a fast machine) for 1 s page polls to catch it part done.
    page.fill("#new-run input[name=random]", "20000")
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


def test_a_thousand_layer_model_is_paged_by_the_server(tab, live, synthetic):
    page = tab.page
    started = time.monotonic()
    page.goto(f"/dashboard/models/{synthetic.model_id}")
    expect(page.locator("#range")).to_have_text(f"rows 1–50 of {SYNTHETIC_LAYERS}")
    loaded = time.monotonic() - started
    assert page.locator("#layers tbody tr").count() == 50
    served = _layer_page(live, synthetic.model_id, run=synthetic.run_id)
    _same_rows(table(page, "#layers"), served)
    page.click("#next")
    expect(page.locator("#range")).to_have_text(f"rows 51–100 of {SYNTHETIC_LAYERS}")
    assert page.locator("#layers tbody tr").count() == 50
    page.click("#layers th[data-sort=min]")
    page.click("#layers th[data-sort=min]")  # descending: the unprofiled layers come last
    served = _layer_page(live, synthetic.model_id, run=synthetic.run_id, sort="min", order="desc")
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
        for method in METHODS:
            expected = qparams_for(tensor, CalibrationOptions(method=method)).scale
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
        (post(target="aarch64", key="x"), 422, "body target: Input should be 'x86' or 'npu'"),
        (post(key="y"), 400, "eval.npz"),  # int labels are no float input
        (post(data=b"PK-not-a-zip", key="x"), 400, "eval.npz"),
        (post(key="x", labels_key="nope"), 400, "eval.npz: no array 'nope'"),
        (post(key="x", labels_key="y2"), 400, "labels must be a 1-D integer array"),
        (post(key="x", labels=npz_bytes(y=np.arange(3))), 400, "3 labels for 6 samples"),
        (post(key="x", labels=npz_bytes(a=np.arange(6), b=np.arange(6))), 400, "labels_key"),
        (post(key="x", samples="0"), 422, "samples"),
        (post(key="x", weight_bits="6"), 422, "weight_bits"),
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
