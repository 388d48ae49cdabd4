// One layer of a model, at a shareable URL (?pid=PROFILE_ID&run=RUN): its statistics, the
// histogram with every calibration method's clipping range drawn on it (linear or log counts),
// per-channel ranges, and its lineage through the compiler stages.
// Chart.js's UMD build, imported for its side effect (it sets globalThis.Chart): the module
// then cannot run before it, whatever order the browser loads the page's scripts in.
import "./vendor/chart.umd.min.js";
import {
  api,
  BASE,
  calibrationName,
  el,
  fmt,
  header,
  layerHref,
  METHODS,
  numCell,
  pathId,
  query,
  showError,
  X86_POLICY,
} from "./dashboard.js";

const modelId = pathId("models");
const profileId = query().get("pid");
const COLOURS = { max: "#d32f2f", percentile: "#7b1fa2", entropy: "#1976d2", mse: "#2e7d32" };
let runId = query().get("run");
// Thresholds by default as the x86 policy quantizes the layer: a weight symmetric int8, anything
// else asymmetric uint8 (the same rule as the model page's table, which knows only the kind). A
// scheme or dtype in the URL is a chosen view; until the layer's kind is known, an activation's.
const pinned = { scheme: query().get("scheme"), dtype: query().get("dtype") };
let policy = X86_POLICY.activations;
const DEFAULT_PERCENTILE = "99.99";
let histogram; // the Chart.js charts, kept to update in place
let perChannel;

// Vertical lines at each method's clip range, labelled, drawn over the bars.
const thresholdLines = {
  id: "thresholds",
  afterDatasetsDraw(chart, _args, options) {
    const { ctx, chartArea, scales } = chart;
    ctx.save();
    ctx.font = "11px system-ui, sans-serif";
    options.lines.forEach((line, i) => {
      const x = scales.x.getPixelForValue(line.value);
      if (x < chartArea.left - 1 || x > chartArea.right + 1) return;
      ctx.strokeStyle = line.colour;
      ctx.fillStyle = line.colour;
      ctx.lineWidth = 1.5;
      ctx.setLineDash([5, 3]);
      ctx.beginPath();
      ctx.moveTo(x, chartArea.top);
      ctx.lineTo(x, chartArea.bottom);
      ctx.stroke();
      // Methods often agree: stagger the labels so that coinciding lines stay readable.
      ctx.textAlign = line.value < 0 ? "left" : "right";
      ctx.fillText(line.label, x + (line.value < 0 ? 3 : -3), chartArea.top + 12 + 13 * (i % 8));
    });
    ctx.restore();
  },
};

function histogramPoints(h) {
  const width = 2 ** h.exponent;
  return h.counts.map((count, k) => ({ x: (h.offset + k + 0.5) * width, y: count }));
}

function lines(qparams) {
  return METHODS.flatMap((m, i) => {
    const [lo, hi] = qparams[m].range;
    return [
      { method: m, value: lo, colour: COLOURS[m], label: `${m} ${fmt(lo, 4)}`, order: i },
      { method: m, value: hi, colour: COLOURS[m], label: `${m} ${fmt(hi, 4)}`, order: i },
    ];
  });
}

function drawHistogram(entry, qparams) {
  const h = entry.histogram;
  const note = document.getElementById("histogram-note");
  if (!h) {
    note.textContent = "no histogram: the run was profiled with bins 0";
    histogram?.destroy();
    histogram = undefined;
    return;
  }
  // The axis holds the data and the clipping limits on the data's sides: a symmetric range's
  // negative limit for a tensor without negative values (a ReLU output) would squeeze the
  // histogram into half the chart; the table lists it.
  const marks = lines(qparams).filter((m) => (m.value < 0 ? entry.min < 0 : m.value > 0 ? entry.max > 0 : true));
  const values = [h.lo, h.hi, ...marks.map((m) => m.value)];
  const points = histogramPoints(h);
  note.textContent = `${h.counts.length} bins of width 2^${h.exponent} (${fmt(2 ** h.exponent)}), ${entry.count} values`;
  const log = document.getElementById("log-scale").checked;
  const config = {
    type: "bar",
    data: {
      datasets: [
        {
          label: "values",
          data: points,
          backgroundColor: "#5b8def",
          barPercentage: 1,
          categoryPercentage: 1,
        },
      ],
    },
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      scales: {
        x: { type: "linear", min: Math.min(...values), max: Math.max(...values), title: { display: true, text: "value" } },
        y: { type: log ? "logarithmic" : "linear", title: { display: true, text: "count" } },
      },
      plugins: {
        legend: { display: false },
        thresholds: { lines: marks },
        tooltip: {
          callbacks: {
            title: (items) => {
              const x = items[0].raw.x;
              const half = 2 ** (h.exponent - 1);
              return `[${fmt(x - half)}, ${fmt(x + half)})`;
            },
          },
        },
      },
    },
    plugins: [thresholdLines],
  };
  histogram?.destroy();
  histogram = new Chart(document.getElementById("histogram"), config);
}

function drawPerChannel(entry) {
  const section = document.getElementById("per-channel-section");
  const channels = entry.per_channel;
  section.hidden = !channels;
  perChannel?.destroy();
  perChannel = undefined;
  if (!channels) return;
  document.getElementById("per-channel-note").textContent =
    `${channels.min.length} channels along axis ${channels.axis}: each bar spans the channel's min to max`;
  perChannel = new Chart(document.getElementById("per-channel"), {
    type: "bar",
    data: {
      labels: channels.min.map((_, c) => c),
      datasets: [
        {
          label: "range",
          data: channels.min.map((lo, c) => (lo === null ? null : [lo, channels.max[c]])),
          backgroundColor: "#ff9800",
          barPercentage: 0.9,
          categoryPercentage: 1,
        },
      ],
    },
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      scales: { x: { title: { display: true, text: "channel" } }, y: { title: { display: true, text: "value" } } },
      plugins: { legend: { display: false } },
    },
  });
}

function showFacts(entry) {
  const facts = [
    ["kind", entry.kind],
    ["op", entry.op],
    ["source node", entry.source_node ? `${entry.source_node} (${entry.source_op})` : "–"],
    ["source tensor", entry.source_tensor ?? "–"],
    ["shape", entry.shape ? `${entry.shape.join("×")} ${entry.dtype}` : entry.dtype],
    ["static", entry.static ? "yes (depends on no input)" : "no"],
    ["min", entry.min],
    ["max", entry.max],
    ["mean", entry.mean],
    ["std", entry.std],
    ["count", entry.count],
    ["NaN / inf", `${entry.nan_count} / ${entry.inf_count}`],
  ];
  document.getElementById("facts").replaceChildren(
    ...facts.flatMap(([name, value]) => [
      el("dt", {}, name),
      el("dd", { "data-fact": name, "data-value": typeof value === "number" ? value : "" }, fmt(value)),
    ]),
  );
}

function showThresholds(qparams) {
  const rows = METHODS.map((m) => {
    const q = qparams[m];
    return el(
      "tr",
      { "data-method": m },
      el("td", {}, el("span", { class: "swatch", style: `background:${COLOURS[m]}` }), m),
      numCell(q.range[0], { "data-column": "lo" }),
      numCell(q.range[1], { "data-column": "hi" }),
      numCell(q.scale, { "data-column": "scale" }),
      numCell(q.zero_point, { "data-column": "zero_point" }),
      el("td", { class: "muted" }, q.note ?? (q.method !== m ? `fell back to ${q.method}` : "")),
    );
  });
  document.querySelector("#thresholds tbody").replaceChildren(...rows);
}

function view() {
  return { scheme: pinned.scheme ?? policy.scheme, dtype: pinned.dtype ?? policy.dtype };
}

function showView() {
  const shown = view();
  document.getElementById("scheme").value = shown.scheme;
  document.getElementById("dtype").value = shown.dtype;
  const name = calibrationName(shown);
  const kind = policy === X86_POLICY.weights ? "a weight" : "an activation";
  document.getElementById("calibration-note").textContent =
    name === calibrationName(policy)
      ? `${name}: the x86 policy for ${kind}` +
        (policy === X86_POLICY.weights ? " (a build scales weights per output channel; per tensor here)." : ".")
      : `${name}: not the x86 policy for ${kind} (${calibrationName(policy)}).`;
}

// The page's view in its URL: the run and what differs from the layer's policy.
function remember() {
  const q = new URLSearchParams({ pid: profileId });
  if (runId) q.set("run", runId);
  if (pinned.scheme !== null || pinned.dtype !== null) {
    const shown = view();
    q.set("scheme", shown.scheme);
    q.set("dtype", shown.dtype);
  }
  const percentile = document.getElementById("percentile").value;
  if (percentile !== DEFAULT_PERCENTILE) q.set("percentile", percentile);
  history.replaceState(null, "", `${location.pathname}?${q}`);
  for (const link of document.querySelectorAll("#lineage a[data-layer]")) {
    link.href = layerHref(modelId, link.dataset.layer, runId, chosenView());
  }
}

// Links to other layers keep a chosen view; the policy is chosen per layer.
function chosenView() {
  return pinned.scheme !== null || pinned.dtype !== null ? view() : undefined;
}

let asked = 0; // answers out of order must not overwrite a newer view

async function loadTensor() {
  if (!runId) {
    document.getElementById("histogram-note").textContent = "no done run of this model yet";
    return;
  }
  const request = ++asked;
  const params = new URLSearchParams({
    profile_id: profileId,
    ...view(),
    percentile: document.getElementById("percentile").value,
  });
  const tensor = await api(`/api/runs/${runId}/tensor?${params}`);
  if (request !== asked) return;
  const kindPolicy = tensor.entry.kind === "weight" ? X86_POLICY.weights : X86_POLICY.activations;
  if (kindPolicy !== policy) {
    policy = kindPolicy;
    showView();
    if (pinned.scheme === null || pinned.dtype === null) return loadTensor(); // the policy's view
  }
  showFacts(tensor.entry);
  showThresholds(tensor.qparams);
  drawHistogram(tensor.entry, tensor.qparams);
  drawPerChannel(tensor.entry);
}

function fateText(fate) {
  const [kind, rest] = [fate.slice(0, fate.indexOf(":")), fate.slice(fate.indexOf(":") + 1)];
  if (kind === "folded_into") return [`folded into ${rest}`];
  if (kind === "aliases") {
    return ["alias of ", el("a", { href: layerHref(modelId, rest, runId, chosenView()), "data-layer": rest }, rest)];
  }
  if (kind === "eliminated") return [`eliminated (${rest})`];
  return [fate];
}

function bindingLabel(binding) {
  if (binding.function !== "main") return `${binding.key} — inside ${binding.function}`;
  return binding.key;
}

async function loadLineage() {
  const lineage = await api(`/api/models/${modelId}/lineage?${new URLSearchParams({ profile_id: profileId })}`);
  const rows = lineage.stages.flatMap((stage) => {
    const stageCell = () => el("td", { rowspan: Math.max(1, stage.bindings.length) }, stage.name);
    if (!stage.bindings.length) {
      return [
        el(
          "tr",
          { "data-stage": stage.name },
          stageCell(),
          el("td", { class: "muted" }, "–"),
          el("td", {}),
          el("td", {}, ...(stage.fate ? fateText(stage.fate) : ["carried by no binding"])),
        ),
      ];
    }
    return stage.bindings.map((binding, i) =>
      el(
        "tr",
        { "data-stage": stage.name, "data-binding": binding.key },
        i === 0 ? stageCell() : null,
        el("td", { class: "mono" }, bindingLabel(binding)),
        el(
          "td",
          { class: "mono" },
          ...binding.layers.flatMap((id, k) => [
            k ? ", " : null,
            id === profileId
              ? el("strong", {}, id)
              : el("a", { href: layerHref(modelId, id, runId, chosenView()), "data-layer": id }, id),
          ]),
        ),
        el("td", {}, binding.layers.length > 1 ? `holds ${binding.layers.length} initial layers` : ""),
      ),
    );
  });
  document.querySelector("#lineage tbody").replaceChildren(...rows);
}

async function main() {
  header(["Models", `${BASE}/`], [`model ${modelId}`, `${BASE}/models/${modelId}`], profileId);
  document.getElementById("title").textContent = profileId;
  document.title = `${profileId} · rangeprof`;
  const [models, runs] = await Promise.all([api("/api/models"), api(`/api/models/${modelId}/runs`)]);
  const model = models.find((m) => m.id === modelId);
  const back = `${BASE}/models/${modelId}${runId ? `?run=${runId}` : ""}`;
  header(["Models", `${BASE}/`], [model?.name ?? `model ${modelId}`, back], profileId);
  const done = runs.filter((r) => r.status === "done");
  runId = runId ?? (done.at(-1)?.id ? String(done.at(-1).id) : null);
  const select = document.getElementById("run");
  select.replaceChildren(...done.map((r) => el("option", { value: r.id }, `run ${r.id}`)));
  select.value = runId ?? "";
  select.addEventListener("change", () => {
    runId = select.value;
    remember();
    loadTensor().catch(showError);
  });
  for (const id of ["scheme", "dtype"]) {
    document.getElementById(id).addEventListener("change", () => {
      const chosen = { scheme: document.getElementById("scheme").value, dtype: document.getElementById("dtype").value };
      const same = calibrationName(chosen) === calibrationName(policy);
      Object.assign(pinned, same ? { scheme: null, dtype: null } : chosen);
      showView();
      remember();
      loadTensor().catch(showError);
    });
  }
  document.getElementById("percentile").addEventListener("change", () => {
    remember();
    loadTensor().catch(showError);
  });
  document.getElementById("log-scale").addEventListener("change", (event) => {
    if (!histogram) return;
    histogram.options.scales.y.type = event.target.checked ? "logarithmic" : "linear";
    histogram.update();
  });
  document.getElementById("percentile").value = query().get("percentile") ?? DEFAULT_PERCENTILE;
  showView();
  await Promise.all([loadTensor(), loadLineage()]);
}

main().catch(showError);
