// A model: its runs (live progress, new runs, comparison) and its layer table, searched,
// sorted and paged by the API. The table's state lives in the URL, so a view can be shared.
import {
  ACTIVE,
  api,
  BASE,
  calibrationName,
  el,
  header,
  layerHref,
  METHODS,
  numCell,
  pathId,
  poll,
  progressBar,
  query,
  showError,
  statusBadge,
  when,
  X86_POLICY,
} from "./dashboard.js";

const modelId = pathId("models");
// Scales by default as the x86 plugin quantizes: activations asymmetric uint8, weights ("policy")
// symmetric int8 whatever the activations' choice; "same" gives weights the activations' choice.
const DEFAULTS = {
  q: "",
  sort: "position",
  order: "asc",
  offset: 0,
  limit: 50,
  scheme: X86_POLICY.activations.scheme,
  dtype: X86_POLICY.activations.dtype,
  weights: "policy",
};
const state = {
  run: query().get("run"),
  q: query().get("q") ?? DEFAULTS.q,
  sort: query().get("sort") ?? DEFAULTS.sort,
  order: query().get("order") ?? DEFAULTS.order,
  offset: Number(query().get("offset") ?? DEFAULTS.offset),
  limit: Number(query().get("limit") ?? DEFAULTS.limit),
  scheme: query().get("scheme") ?? DEFAULTS.scheme,
  dtype: query().get("dtype") ?? DEFAULTS.dtype,
  weights: query().get("weights") ?? DEFAULTS.weights,
};
let total = 0;
let shown = 0; // requests answered out of order must not overwrite a newer table

// The view in the URL (what differs from the defaults), so that it can be shared.
function remember() {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(state)) {
    if (value !== null && value !== "" && value !== DEFAULTS[key]) q.set(key, value);
  }
  history.replaceState(null, "", q.size ? `${location.pathname}?${q}` : location.pathname);
}

function isDefaultView() {
  return ["scheme", "dtype", "weights"].every((key) => state[key] === DEFAULTS[key]);
}

// The scheme and dtype of a row's scales: the chosen ones, but the weights' own with "policy".
function rowCalibration(row) {
  if (row.kind === "weight" && state.weights === "policy") return X86_POLICY.weights;
  return { scheme: state.scheme, dtype: state.dtype };
}

function describeCalibration() {
  const activations = calibrationName(state);
  const weights = calibrationName(rowCalibration({ kind: "weight" }));
  const policy =
    activations === calibrationName(X86_POLICY.activations) && weights === calibrationName(X86_POLICY.weights);
  document.getElementById("calibration-note").textContent =
    `Scales for activations ${activations}, weights ${weights}: ` +
    (policy
      ? "the x86 policy (asymmetric uint8; a build scales weights per channel, per tensor here)."
      : "not the x86 policy (activations asym uint8, weights sym int8).");
}

// The page of layers. The API applies one scheme and dtype to every row: with weights kept
// symmetric int8 under another choice, their scales come from a second page of the same rows,
// asked once the first is drawn (its weights' scales pending meanwhile) and only if it holds
// weights. The table is aria-busy until its rows are final.
async function loadLayers() {
  const request = ++shown;
  const tableNode = document.getElementById("layers");
  tableNode.setAttribute("aria-busy", "true");
  try {
    const params = new URLSearchParams({
      sort: state.sort,
      order: state.order,
      offset: state.offset,
      limit: state.limit,
    });
    if (state.run) params.set("run", state.run);
    if (state.q) params.set("q", state.q);
    const ask = ({ scheme, dtype }) =>
      api(`/api/models/${modelId}/layers?${params}&${new URLSearchParams({ scheme, dtype })}`);
    const chosen = { scheme: state.scheme, dtype: state.dtype };
    const weights = rowCalibration({ kind: "weight" });
    const page = await ask(chosen);
    if (request !== shown) return;
    const differ = calibrationName(weights) !== calibrationName(chosen);
    // Weights with scales (profiled by the run) whose view is not the chosen one.
    const apart = (row) => differ && row.kind === "weight" && Object.keys(row.scales).length > 0;
    const pending = page.rows.some(apart);
    drawLayers(page, apart);
    if (pending) {
      const weightPage = await ask(weights);
      if (request !== shown) return;
      const weightScales = new Map(weightPage.rows.map((row) => [row.profile_id, row.scales]));
      fillScales(page.rows.filter(apart), weightScales);
    }
  } finally {
    if (request === shown) tableNode.removeAttribute("aria-busy");
  }
}

// Rows of `page`; rows for which `apart` holds take their scales from a second page, shown as
// pending ("…") until `fillScales` fills them.
function drawLayers(page, apart) {
  total = page.total;
  const view = isDefaultView();
  const rows = page.rows.map((row) => {
    const calibration = rowCalibration(row);
    const scales = apart(row) ? undefined : row.scales;
    const href = layerHref(modelId, row.profile_id, state.run, view ? undefined : calibration);
    const scaleCells = METHODS.map((m) =>
      scales
        ? numCell(scales[m], { "data-column": `scale-${m}` })
        : el("td", { class: "num muted", "data-column": `scale-${m}`, "data-value": "" }, "…"),
    );
    return el(
      "tr",
      { "data-profile-id": row.profile_id, "data-calibration": calibrationName(calibration) },
      el("td", { class: "num" }, row.position),
      el("td", { class: "mono" }, el("a", { href }, row.profile_id)),
      el("td", {}, row.kind),
      el("td", { class: "mono nowrap" }, calibrationName(calibration)),
      el("td", { class: "mono" }, row.op),
      el("td", { class: "mono" }, row.source_node ?? "–"),
      el("td", { class: "mono" }, row.shape ? row.shape.join("×") : "–"),
      numCell(row.min, { "data-column": "min" }),
      numCell(row.max, { "data-column": "max" }),
      ...scaleCells,
    );
  });
  document.querySelector("#layers tbody").replaceChildren(...rows);
  const first = total ? state.offset + 1 : 0;
  document.getElementById("range").textContent = `rows ${first}–${state.offset + rows.length} of ${total}`;
  document.getElementById("prev").disabled = state.offset === 0;
  document.getElementById("next").disabled = state.offset + state.limit >= total;
  for (const th of document.querySelectorAll("#layers th[data-sort]")) {
    th.classList.toggle("sorted-asc", th.dataset.sort === state.sort && state.order === "asc");
    th.classList.toggle("sorted-desc", th.dataset.sort === state.sort && state.order === "desc");
  }
  describeCalibration();
  remember();
}

// The pending scale cells of the drawn `rows`, filled in place from `weightScales`: a row drawn
// anew under the pointer would lose a click on its link.
function fillScales(rows, weightScales) {
  for (const row of rows) {
    const scales = weightScales.get(row.profile_id);
    const tr = document.querySelector(`#layers tr[data-profile-id="${CSS.escape(row.profile_id)}"]`);
    if (!scales || !tr) continue;
    for (const m of METHODS) {
      tr.querySelector(`[data-column="scale-${m}"]`).replaceWith(
        numCell(scales[m], { "data-column": `scale-${m}` }),
      );
    }
  }
}

function refreshLayers() {
  loadLayers().catch(showError);
}

function runOptions(run) {
  const o = run.options;
  return [`bins ${o.bins}`, o.samples && `samples ${o.samples}`, o.batch_size && `batch ${o.batch_size}`, `seed ${o.seed}`]
    .filter(Boolean)
    .join(", ");
}

async function loadRuns() {
  const runs = await api(`/api/models/${modelId}/runs`);
  const rows = runs.map((run) => {
    const progress = run.samples_total ? `${run.samples_done}/${run.samples_total} samples` : undefined;
    return el(
      "tr",
      { "data-run-id": run.id, "data-status": run.status },
      el("td", {}, el("input", { type: "checkbox", class: "pick", value: run.id, disabled: run.status !== "done", onchange: picked })),
      el("td", { class: "num" }, el("a", { href: `${BASE}/runs/${run.id}` }, run.id)),
      el("td", {}, statusBadge(run.status), ACTIVE.includes(run.status) ? cancelButton(run.id) : ""),
      el("td", {}, progressBar(run.progress, progress)),
      el("td", { class: "mono" }, run.data.kind === "random" ? "random" : `${run.data.name}${run.data.key ? `:${run.data.key}` : ""}`),
      el("td", {}, runOptions(run)),
      el("td", {}, when(run.created_at)),
      el("td", { class: "muted" }, run.error ?? ""),
    );
  });
  document.querySelector("#runs tbody").replaceChildren(...rows);
  const done = runs.filter((r) => r.status === "done");
  const select = document.getElementById("run");
  // Until one is chosen (in the URL or the menu), the newest done run.
  const wanted = state.run ?? String(done.at(-1)?.id ?? "");
  select.replaceChildren(
    el("option", { value: "" }, "none (layers only)"),
    ...done.map((r) => el("option", { value: r.id }, `run ${r.id}`)),
  );
  select.value = done.some((r) => String(r.id) === wanted) ? wanted : "";
  if (select.value !== state.run) {
    state.run = select.value;
    refreshLayers();
  }
  return runs.some((r) => ACTIVE.includes(r.status));
}

// A queued or running run can be cancelled: it ends "cancelled", its process stopped.
function cancelButton(runId) {
  const cancel = async () => {
    await api(`/api/runs/${runId}/cancel`, { method: "POST" });
    await loadRuns();
  };
  return el("button", { type: "button", class: "cancel", onclick: () => cancel().catch(showError) }, "cancel");
}

function picked() {
  const checked = [...document.querySelectorAll("#runs .pick:checked")];
  document.getElementById("compare").disabled = checked.length !== 2;
}

document.getElementById("compare").addEventListener("click", () => {
  const [a, b] = [...document.querySelectorAll("#runs .pick:checked")].map((box) => box.value);
  location.assign(`${BASE}/compare?a=${a}&b=${b}`);
});

document.getElementById("new-run").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  for (const [key, value] of [...form.entries()]) {
    if (value === "" || (value instanceof File && !value.name)) form.delete(key);
  }
  showError(null, "run-error");
  try {
    await api(`/api/models/${modelId}/runs`, { method: "POST", form });
    event.target.reset();
    poll(loadRuns).catch(showError);
  } catch (err) {
    showError(err, "run-error");
  }
});

document.getElementById("run").addEventListener("change", (event) => {
  state.run = event.target.value;
  refreshLayers();
});

let typing;
const search = document.getElementById("search");
search.value = state.q;
search.addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => {
    state.q = search.value.trim();
    state.offset = 0;
    refreshLayers();
  }, 250);
});

for (const key of ["scheme", "dtype", "weights", "limit"]) {
  const select = document.getElementById(key);
  select.value = String(state[key]);
  select.addEventListener("change", () => {
    state[key] = key === "limit" ? Number(select.value) : select.value;
    state.offset = 0;
    refreshLayers();
  });
}

for (const th of document.querySelectorAll("#layers th[data-sort]")) {
  th.addEventListener("click", () => {
    const again = state.sort === th.dataset.sort;
    state.order = again && state.order === "asc" ? "desc" : "asc";
    state.sort = th.dataset.sort;
    state.offset = 0;
    refreshLayers();
  });
}

document.getElementById("prev").addEventListener("click", () => {
  state.offset = Math.max(0, state.offset - state.limit);
  refreshLayers();
});
document.getElementById("next").addEventListener("click", () => {
  if (state.offset + state.limit < total) state.offset += state.limit;
  refreshLayers();
});

async function main() {
  header(["Models", `${BASE}/`], `model ${modelId}`);
  const model = (await api("/api/models")).find((m) => m.id === modelId);
  if (!model) throw new Error(`model ${modelId} not found`);
  header(["Models", `${BASE}/`], model.name);
  document.getElementById("title").textContent = model.name;
  document.getElementById("facts").replaceChildren(
    ...[
      ["sha256", model.sha256],
      ["opset", model.opset],
      ["inputs", model.inputs.map((i) => `${i.name} ${i.shape.join("×")} ${i.dtype}`).join(", ")],
      ["uploaded", when(model.created_at)],
    ].flatMap(([k, v]) => [el("dt", {}, k), el("dd", { class: "mono" }, v)]),
  );
  const before = state.run;
  const active = await loadRuns();
  if (state.run === before) refreshLayers(); // else loadRuns did, for the run it chose
  if (active) poll(loadRuns).catch(showError);
}

main().catch(showError);
