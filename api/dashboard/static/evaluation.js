// Quantization error of one evaluation: the request it ran, every method's result (method all),
// per-layer isolated / accumulated SQNR, worst first, coloured against two thresholds, and the
// model drawn as its sequence of compiled bindings (BYOC regions and the FP32 operators between
// them), each coloured by its layer's error.
import {
  ACTIVE,
  api,
  BASE,
  biasCorrection,
  el,
  fmt,
  header,
  layerHref,
  numCell,
  pathId,
  poll,
  progressBar,
  requestDetails,
  SQNR_COLOURS,
  showError,
  sqnrClass,
  statusBadge,
} from "./dashboard.js";

const evaluationId = pathId("evaluations");
let evaluation;
let model;
let run;

// null SQNR is an exact match: better than any number.
function sqnr(db) {
  return db === null || db === undefined ? Infinity : db;
}

function worstFirst(layers) {
  return [...layers].sort(
    (x, y) => sqnr(x.isolated_sqnr_db) - sqnr(y.isolated_sqnr_db) || sqnr(x.accumulated_sqnr_db) - sqnr(y.accumulated_sqnr_db),
  );
}

function thresholds() {
  return [Number(document.getElementById("good").value), Number(document.getElementById("warn").value)];
}

function sqnrCell(db, column) {
  const [good, warn] = thresholds();
  return numCell(db, { class: `num sqnr ${sqnrClass(db, good, warn)}`, "data-column": column, title: db === null ? "exact" : undefined });
}

// The method asked for; with all, the best one the report holds.
function methodName() {
  const best = evaluation.report?.method;
  return evaluation.method === "all" && best ? `all (best: ${best})` : evaluation.method;
}

function showFacts() {
  const report = evaluation.report ?? {};
  const request = evaluation.request;
  const budget = request?.accuracy_budget;
  const facts = [
    ["status", statusBadge(evaluation.status)],
    ["progress", progressBar(evaluation.progress, evaluation.phase ?? undefined)],
    ["run", el("a", { href: `${BASE}/runs/${evaluation.run_id}` }, `run ${evaluation.run_id}`)],
    ["source", evaluation.source === "report" ? "uploaded report" : "computed by the service"],
    ["method / target", `${methodName()} / ${evaluation.target}`],
    ["weight bits", evaluation.weight_bits],
    ["FP32 fallback", request ? (request.fp32_fallback ? "yes" : "no") : "–"],
    ["bias correction", biasCorrection(request?.bias_correction)],
    ["accuracy budget", budget === null || budget === undefined ? "–" : `${fmt(budget)} point${budget === 1 ? "" : "s"}`],
    ["samples", report.samples ?? evaluation.samples ?? "–"],
    ["output SQNR", report.output_sqnr_db === undefined ? "–" : `${fmt(report.output_sqnr_db)} dB`],
    ["top-1 agreement", report.agreement === undefined ? "–" : `${fmt(report.agreement)} %`],
    ["top-1 FP32 / INT8", report.fp32_top1 === undefined ? "– (no labels)" : `${fmt(report.fp32_top1)} % / ${fmt(report.int8_top1)} %`],
    ["8-bit for the budget", report.kept_int8?.length ? report.kept_int8.join(", ") : "–"],
    ["int16 for the budget", report.kept_int16?.length ? report.kept_int16.join(", ") : "–"],
    ["kept FP32", report.kept_fp32?.length ? report.kept_fp32.join(", ") : "–"],
    ["plan (layer_modes)", report.plan?.length ? report.plan.join(" ") : "–"],
    ["error", evaluation.error ?? "–"],
    ["request", requestDetails(request)],
  ];
  document.getElementById("facts").replaceChildren(
    ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-fact": k }, v)]),
  );
}

// Method all: each method's result, the reported (best) one marked.
function showMethods() {
  const methods = evaluation.report?.methods ?? [];
  document.getElementById("methods-section").hidden = evaluation.method !== "all";
  const rows = methods.map((m) =>
    el(
      "tr",
      { "data-method": m.method, class: m.method === evaluation.report.method ? "best" : undefined },
      el("td", {}, m.method === evaluation.report.method ? `${m.method} (best)` : m.method),
      numCell(m.output_sqnr_db),
      numCell(m.agreement),
      numCell(m.int8_top1),
    ),
  );
  document.querySelector("#methods tbody").replaceChildren(...rows);
}

function showTable() {
  const layers = worstFirst(evaluation.report?.layers ?? []);
  const rows = layers.map((layer, i) =>
    el(
      "tr",
      { "data-profile-id": layer.profile_id },
      el("td", { class: "num" }, i + 1),
      el("td", { class: "mono" }, el("a", { href: layerHref(model.id, layer.profile_id, run.id) }, layer.profile_id)),
      el("td", { class: "mono" }, layer.pattern.split(".").at(-1)),
      el("td", {}, layer.mode),
      sqnrCell(layer.isolated_sqnr_db, "isolated"),
      sqnrCell(layer.accumulated_sqnr_db, "accumulated"),
      numCell(layer.isolated_rmse_per_scale),
      numCell(layer.accumulated_rmse_per_scale),
    ),
  );
  document.querySelector("#sqnr tbody").replaceChildren(...rows);
}

// The nodes of the graph: main's bindings at the BYOC partition stage (else the last stage),
// in program order, each named by its output: the latest initial layer it holds.
function graphNodes() {
  const stage = model.stages.find((s) => s.name === "partition") ?? model.stages.at(-1);
  const position = new Map(model.layers.map((l, i) => [l.profile_id, i])); // listed in order
  const op = new Map(model.layers.map((l) => [l.profile_id, l.op]));
  const evaluated = new Map((evaluation.report?.layers ?? []).map((l) => [l.profile_id, l]));
  const nodes = Object.entries(stage?.lineage ?? {})
    .filter(([key]) => key.startsWith("main/"))
    .map(([key, layers]) => {
      const output = layers.reduce((a, b) => ((position.get(b) ?? -1) > (position.get(a) ?? -1) ? b : a));
      return { key, layers, output, op: op.get(output), error: evaluated.get(output) };
    });
  return { stage: stage?.name, nodes };
}

function showGraph() {
  const { stage, nodes } = graphNodes();
  const metric = document.getElementById("graph-metric").value;
  const [good, warn] = thresholds();
  const [top, step, height, width] = [10, 44, 28, 520];
  const svg = el("svg", {
    id: "graph-svg",
    width: width + 380,
    height: top * 2 + Math.max(0, nodes.length * step - (step - height)),
    xmlns: "http://www.w3.org/2000/svg",
  });
  nodes.forEach((node, i) => {
    const y = top + i * step;
    const db = node.error?.[`${metric}_sqnr_db`];
    const level = node.error ? sqnrClass(db, good, warn) : "fp32";
    if (i) {
      svg.append(el("line", { x1: 20 + width / 2, y1: y - step + height, x2: 20 + width / 2, y2: y - 2, stroke: "#90a4ae" }));
      svg.append(el("path", { d: `M${16 + width / 2},${y - 7} l4,6 l4,-6 z`, fill: "#90a4ae" }));
    }
    const label = node.error ? `${fmt(db, 4)} dB${db === null ? " (exact)" : ""}` : "FP32";
    const group = el(
      "g",
      { class: "node", "data-profile-id": node.output, "data-level": level, onclick: () => location.assign(layerHref(model.id, node.output, run.id)) },
      el("title", {}, `${node.key}: ${node.layers.join(", ")}`),
      el("rect", { x: 20, y, width, height, rx: 5, fill: SQNR_COLOURS[level], "data-profile-id": node.output }),
      el("text", { x: 30, y: y + 18, fill: "#fff", "font-size": 12, "font-family": "monospace" }, `${node.output}  ${node.op ?? ""}`),
      el("text", { x: 12 + width, y: y + 18, fill: "#fff", "font-size": 12, "text-anchor": "end" }, label),
      el("text", { x: 30 + width, y: y + 18, fill: "#5f6b76", "font-size": 11 }, `${node.key} · ${node.layers.length} layer${node.layers.length > 1 ? "s" : ""}`),
    );
    svg.append(group);
  });
  document.getElementById("graph").replaceChildren(svg);
  document.getElementById("graph-note").textContent = nodes.length
    ? `${nodes.length} bindings of main after stage ${stage}; click one for its layer`
    : "the model has no stage lineage to draw";
}

function render() {
  document.getElementById("title").textContent = `${model.name}: quantization error (${methodName()}, ${evaluation.target})`;
  showFacts();
  if (evaluation.status === "done") {
    showMethods();
    showTable();
    showGraph();
  }
}

async function main() {
  header(["Models", `${BASE}/`], `evaluation ${evaluationId}`);
  evaluation = await api(`/api/evaluations/${evaluationId}`);
  run = await api(`/api/runs/${evaluation.run_id}`);
  model = await api(`/api/models/${run.model_id}`);
  header(
    ["Models", `${BASE}/`],
    [model.name, `${BASE}/models/${model.id}?run=${run.id}`],
    [`run ${run.id}`, `${BASE}/runs/${run.id}`],
    `evaluation ${evaluationId}`,
  );
  render();
  for (const id of ["good", "warn", "graph-metric"]) {
    document.getElementById(id).addEventListener("change", render);
  }
  if (ACTIVE.includes(evaluation.status)) {
    poll(async () => {
      evaluation = await api(`/api/evaluations/${evaluationId}`);
      render();
      return ACTIVE.includes(evaluation.status);
    }).catch(showError);
  }
}

main().catch(showError);
