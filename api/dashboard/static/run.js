// A profiling run: live progress, downloads (profile, every export format), its INT8 builds
// (queued here, with FP32 fallback or an accuracy budget; live progress, cancel, the artifact,
// the request each runs) and its evaluations (queued here with data and labels, or uploaded as
// a report).
import {
  ACTIVE,
  api,
  applySchema,
  BASE,
  download,
  el,
  fmt,
  header,
  numCell,
  pathId,
  poll,
  POLL_MS,
  progressBar,
  requestDetails,
  showError,
  statusBadge,
  when,
} from "./dashboard.js";

const runId = pathId("runs");
const SUFFIX = {
  aimet: "encodings.json",
  ort: "calib.txt",
  "ort-json": "tensors.json",
  tensorrt: "trt.cache",
  qdq: "int8.onnx",
  "model-explorer": "model-explorer.zip",
};
let model;

async function loadRun() {
  const run = await api(`/api/runs/${runId}`);
  // Before the first render enables the downloads: their files are named after the model.
  model ??= (await api("/api/models")).find((m) => m.id === run.model_id);
  const samples = run.samples_total ? `${run.samples_done}/${run.samples_total} samples` : undefined;
  const data = run.data.kind === "random" ? "random" : `${run.data.name}${run.data.key ? `:${run.data.key}` : ""}`;
  const timings = run.timings ? Object.entries(run.timings).map(([k, v]) => `${k} ${fmt(v, 3)} s`).join(", ") : "–";
  const facts = [
    ["status", statusBadge(run.status)],
    ["progress", progressBar(run.progress, samples)],
    ["data", data],
    ["options", Object.entries(run.options).map(([k, v]) => `${k} ${v ?? "–"}`).join(", ")],
    ["created", when(run.created_at)],
    ["finished", when(run.finished_at)],
    ["timings", timings],
    ["error", run.error ?? "–"],
  ];
  document.getElementById("facts").replaceChildren(
    ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-fact": k }, v)]),
  );
  for (const button of document.querySelectorAll("#downloads button")) button.disabled = run.status !== "done";
  document.getElementById("evaluate").querySelector("button").disabled = run.status !== "done";
  document.getElementById("build").querySelector("button").disabled = run.status !== "done";
  return run;
}

async function loadEvaluations() {
  const evaluations = await api(`/api/runs/${runId}/evaluations`);
  exportEvaluations(evaluations);
  const rows = evaluations.map((e) =>
    el(
      "tr",
      { "data-evaluation-id": e.id, "data-status": e.status, "data-source": e.source },
      el("td", { class: "num" }, el("a", { href: `${BASE}/evaluations/${e.id}` }, e.id)),
      el("td", {}, e.source),
      el("td", {}, statusBadge(e.status)),
      el("td", {}, progressBar(e.progress, e.phase ?? undefined)),
      el("td", {}, e.method),
      el("td", {}, e.target),
      el("td", { class: "num" }, e.weight_bits),
      numCell(e.output_sqnr_db),
      numCell(e.agreement),
      numCell(e.int8_top1),
      el("td", { class: "muted" }, e.error ?? ""),
    ),
  );
  document.querySelector("#evaluations tbody").replaceChildren(...rows);
  return evaluations.some((e) => ACTIVE.includes(e.status));
}

function pollEvaluations() {
  poll(loadEvaluations).catch(showError);
}

// Builds. A done build's manifest never changes: each is fetched once, for its region count.
const manifests = new Map();
let buildsAsked = 0; // answers out of order must not overwrite a newer table
let buildsTimer;

// The form's filled-in fields: multipart has no null, so empty ones are left out (FormData
// already leaves out disabled fields and unticked boxes).
// A list field (exclude) goes as one form field per comma-separated item.
function filledForm(form) {
  const data = new FormData(form);
  for (const [key, value] of [...data.entries()]) {
    if (value === "" || (value instanceof File && !value.name)) data.delete(key);
  }
  const items = (data.get("exclude") ?? "").split(",").map((s) => s.trim()).filter(Boolean);
  data.delete("exclude");
  for (const item of items) data.append("exclude", item);
  return data;
}

// What is not INT8 besides the regions the plugin cannot quantize: by FP32 fallback, regions
// without qparams; by an accuracy budget, the most sensitive layers (int16, else FP32).
function fp32Cell(build) {
  const request = build.request;
  const manifest = manifests.get(build.id);
  const kept = manifest?.kept_fp32 ?? [];
  const wide = manifest?.kept_int16 ?? [];
  const raised = manifest?.kept_int8 ?? [];
  const parts = [];
  if (request.fp32_fallback) parts.push("fallback");
  if (request.bias_correction) {
    parts.push(request.bias_correction === "stored" ? "bias corrected (stored)" : "bias corrected");
  }
  if (request.accuracy_budget !== null) {
    const eight = raised.length ? `${raised.length} 8-bit, ` : "";
    const done = manifest ? `: ${eight}${wide.length} int16, ${kept.length} FP32` : "";
    parts.push(`budget ${fmt(request.accuracy_budget)} pts${done}`);
  }
  const title = [...raised, ...wide, ...kept].join(", ") || undefined;
  return el("td", { "data-column": "fp32", title }, parts.join(", ") || "–");
}

function buildSource(build) {
  if (build.qparams_id !== null) return `qparams ${build.qparams_id}`;
  return build.method === "percentile" ? `percentile ${fmt(build.percentile)}` : build.method;
}

// INT8 regions of a done build's manifest, out of all its regions (the rest int16 or FP32).
function regionsCell(manifest) {
  if (!manifest) return el("td", { class: "num", "data-column": "int8-regions", "data-value": "" }, "–");
  const total = manifest.regions.length;
  const int8 = manifest.regions.filter((r) => r.mode === "int8").length;
  const int16 = manifest.regions.filter((r) => r.mode === "int16").length;
  const wide = int16 ? `, ${int16} int16` : "";
  const fp32 = total - int8 - int16 ? `, ${total - int8 - int16} FP32` : "";
  const title = `${int8} of ${total} regions INT8${wide}${fp32}`;
  return el(
    "td",
    { class: "num", "data-column": "int8-regions", "data-value": int8, "data-regions": total, title },
    `${int8} of ${total}`,
  );
}

function artifactName(build) {
  return `${model.name}-${build.target}-build${build.id}.zip`;
}

function buildRow(build) {
  const active = ACTIVE.includes(build.status);
  const percent = Math.round(100 * build.progress);
  const manifest = manifests.get(build.id);
  const failed = (err) => showError(err, "build-error");
  const cancel = async () => {
    showError(null, "build-error");
    await api(`/api/builds/${build.id}/cancel`, { method: "POST" });
    await refreshBuilds();
  };
  const save = () => download(`/api/builds/${build.id}/artifact`, artifactName(build)).catch(failed);
  return el(
    "tr",
    { "data-build-id": build.id, "data-status": build.status, "data-phase": build.phase ?? "" },
    el("td", { class: "num" }, build.id),
    el("td", {}, build.target),
    el("td", {}, buildSource(build)),
    el("td", { class: "num" }, build.weight_bits),
    fp32Cell(build),
    el(
      "td",
      {},
      statusBadge(build.status),
      active ? el("button", { type: "button", class: "cancel", onclick: () => cancel().catch(failed) }, "cancel") : null,
    ),
    el("td", {}, progressBar(build.progress, active ? `${build.phase ?? build.status} ${percent}%` : undefined)),
    regionsCell(manifest),
    el(
      "td",
      {},
      build.status === "done"
        ? el("button", { type: "button", class: "artifact", title: `sha256 ${build.artifact_sha256}`, onclick: save }, "download zip")
        : "",
    ),
    el("td", { class: "muted" }, build.error ?? ""),
    el("td", {}, requestDetails(build.request)),
  );
}

// Draw the run's builds now and, while one is queued or running, again every second. Calls may
// overlap (a new build, a cancel): the newest draws and keeps the one timer.
async function refreshBuilds() {
  const asked = ++buildsAsked;
  const builds = await api(`/api/runs/${runId}/builds`);
  const unread = builds.filter((b) => b.status === "done" && !manifests.has(b.id));
  const read = await Promise.all(unread.map((b) => api(`/api/builds/${b.id}`)));
  for (const build of read) manifests.set(build.id, build.manifest);
  if (asked !== buildsAsked) return;
  document.querySelector("#builds tbody").replaceChildren(...builds.map(buildRow));
  document.getElementById("no-builds").hidden = builds.length > 0;
  clearTimeout(buildsTimer);
  if (builds.some((b) => ACTIVE.includes(b.status))) {
    buildsTimer = setTimeout(() => refreshBuilds().catch(showError), POLL_MS);
  }
}

// Stored qparams sets of the run, as a build's alternative to deriving them.
async function loadQParams() {
  const sets = await api(`/api/runs/${runId}/qparams`);
  const select = document.querySelector("#build select[name=qparams_id]");
  select.replaceChildren(
    select.options[0],
    ...sets.map((q) => {
      const o = q.options;
      return el("option", { value: q.id }, `set ${q.id}: ${o.method} ${o.scheme} ${o.dtype} ${o.granularity}`);
    }),
  );
}

// Method and percentile derive the qparams; a stored set replaces both. The evaluation data
// goes with an accuracy budget.
const BUDGET_DATA = ["data", "key", "labels", "labels_key", "samples"];

function buildFormChoices() {
  const form = document.getElementById("build");
  const stored = form.elements.qparams_id.value !== "";
  form.elements.method.disabled = stored;
  form.elements.percentile.disabled = stored || form.elements.method.value !== "percentile";
  const budget = form.elements.accuracy_budget.value !== "";
  for (const name of BUDGET_DATA) form.elements[name].disabled = !budget;
}

document.getElementById("build").addEventListener("change", buildFormChoices);
document.getElementById("build").addEventListener("input", buildFormChoices);
document.getElementById("build").addEventListener("submit", async (event) => {
  event.preventDefault();
  // A form (not JSON): an accuracy budget sends its evaluation data along.
  const form = filledForm(event.target);
  showError(null, "build-error");
  try {
    await api(`/api/runs/${runId}/builds`, { method: "POST", form });
    await refreshBuilds();
  } catch (err) {
    showError(err, "build-error");
  }
});

document.getElementById("download-profile").addEventListener("click", () =>
  download(`/api/runs/${runId}/profile`, `${model.name}.run${runId}.profile.json`).catch((err) =>
    showError(err, "download-error"),
  ),
);
// The done evaluations of the run, which the overlays and the report can show; the choice
// stays while the list is polled.
function exportEvaluations(evaluations) {
  const select = document.getElementById("export-evaluation");
  const chosen = select.value;
  const done = evaluations.filter((e) => e.status === "done");
  select.replaceChildren(
    el("option", { value: "" }, "none"),
    ...done.map((e) => el("option", { value: e.id }, `${e.id}: ${e.method} ${e.target}`)),
  );
  select.value = done.some((e) => String(e.id) === chosen) ? chosen : "";
}

// The chosen evaluation as a query parameter, and in the file's name.
function withEvaluation(params) {
  const evaluation = document.getElementById("export-evaluation").value;
  if (evaluation) params.set("evaluation", evaluation);
  return evaluation ? `.evaluation${evaluation}` : "";
}

// The overlays of a chosen evaluation are the evaluation's own (its figures added).
function exportUrl(format, q) {
  const evaluation = document.getElementById("export-evaluation").value;
  if (format === "model-explorer" && evaluation) return `/api/evaluations/${evaluation}/model-explorer`;
  return `/api/runs/${runId}/export?${q}`;
}

for (const button of document.querySelectorAll("#downloads button[data-format]")) {
  button.addEventListener("click", () => {
    const format = button.dataset.format;
    const method = document.getElementById("export-method").value;
    const q = new URLSearchParams({ format, method });
    const tag = format === "model-explorer" ? withEvaluation(q) : "";
    download(exportUrl(format, q), `${model.name}.run${runId}.${method}${tag}.${SUFFIX[format]}`).catch(
      (err) => showError(err, "download-error"),
    );
  });
}
document.getElementById("download-report").addEventListener("click", () => {
  const q = new URLSearchParams();
  const tag = withEvaluation(q);
  download(`/api/runs/${runId}/report?${q}`, `${model.name}.run${runId}${tag}.report.html`).catch((err) =>
    showError(err, "download-error"),
  );
});

document.getElementById("evaluate").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = filledForm(event.target);
  showError(null, "evaluate-error");
  try {
    await api(`/api/runs/${runId}/evaluations`, { method: "POST", form });
    event.target.reset();
    pollEvaluations();
  } catch (err) {
    showError(err, "evaluate-error");
  }
});

document.getElementById("report").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError(null, "evaluate-error");
  try {
    const file = new FormData(event.target).get("file");
    let report;
    try {
      report = JSON.parse(await file.text());
    } catch {
      throw new Error(`${file.name} is not JSON: expected the output of rangeprof evaluate --json`);
    }
    await api(`/api/runs/${runId}/evaluations/report`, { method: "POST", json: report });
    event.target.reset();
    pollEvaluations();
  } catch (err) {
    showError(err, "evaluate-error");
  }
});

async function main() {
  header(["Models", `${BASE}/`], `run ${runId}`);
  for (const [id, schema] of [["build", "BuildUpload"], ["evaluate", "EvaluationRequest"]]) {
    const form = document.getElementById(id);
    await applySchema(form, schema, form.querySelector(".options"));
  }
  const run = await loadRun();
  header(["Models", `${BASE}/`], [model.name, `${BASE}/models/${model.id}?run=${runId}`], `run ${runId}`);
  document.getElementById("title").textContent = `${model.name}: run ${runId}`;
  if (ACTIVE.includes(run.status)) {
    poll(async () => {
      const now = await loadRun();
      if (now.status === "done") loadQParams().catch(showError);
      return ACTIVE.includes(now.status);
    }).catch(showError);
  }
  buildFormChoices();
  if (run.status === "done") loadQParams().catch(showError);
  refreshBuilds().catch(showError);
  pollEvaluations();
}

main().catch(showError);
