// A profiling run: live progress, downloads (profile, every export format) and its
// evaluations (queued here with data and labels, or uploaded as a report).
import {
  ACTIVE,
  api,
  BASE,
  download,
  el,
  fmt,
  header,
  numCell,
  pathId,
  poll,
  progressBar,
  showError,
  statusBadge,
  when,
} from "./dashboard.js";

const runId = pathId("runs");
const SUFFIX = { aimet: "encodings.json", ort: "calib.txt", "ort-json": "tensors.json", tensorrt: "trt.cache" };
let model;

async function loadRun() {
  const run = await api(`/api/runs/${runId}`);
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
  return run;
}

async function loadEvaluations() {
  const evaluations = await api(`/api/runs/${runId}/evaluations`);
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

document.getElementById("download-profile").addEventListener("click", () =>
  download(`/api/runs/${runId}/profile`, `${model.name}.run${runId}.profile.json`).catch((err) =>
    showError(err, "download-error"),
  ),
);
for (const button of document.querySelectorAll("#downloads button[data-format]")) {
  button.addEventListener("click", () => {
    const format = button.dataset.format;
    const method = document.getElementById("export-method").value;
    const q = new URLSearchParams({ format, method });
    download(`/api/runs/${runId}/export?${q}`, `${model.name}.run${runId}.${method}.${SUFFIX[format]}`).catch(
      (err) => showError(err, "download-error"),
    );
  });
}

document.getElementById("evaluate").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  for (const [key, value] of [...form.entries()]) {
    if (value === "" || (value instanceof File && !value.name)) form.delete(key);
  }
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
  const run = await loadRun();
  model = (await api("/api/models")).find((m) => m.id === run.model_id);
  header(["Models", `${BASE}/`], [model.name, `${BASE}/models/${model.id}?run=${runId}`], `run ${runId}`);
  document.getElementById("title").textContent = `${model.name}: run ${runId}`;
  if (ACTIVE.includes(run.status)) {
    poll(async () => ACTIVE.includes((await loadRun()).status)).catch(showError);
  }
  pollEvaluations();
}

main().catch(showError);
