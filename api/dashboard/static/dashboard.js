// What every dashboard page shares: the token, API calls, DOM building, formatting, polling.
// Pages are ES modules importing these; nothing here touches the page until called.

const TOKEN_KEY = "rangeprof.token";
export const BASE = "/dashboard";

export function token() {
  return localStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  localStorage.setItem(TOKEN_KEY, value);
}

function toLogin() {
  const next = location.pathname + location.search;
  location.replace(`${BASE}/login?next=${encodeURIComponent(next)}`);
}

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

// A call to the REST API with the stored bearer token. A 401 (no token, a revoked one) goes to
// the login page; any other refusal throws the API's one-line `detail`.
export async function api(path, { method = "GET", json, form, raw = false } = {}) {
  const headers = { Authorization: `Bearer ${token()}` };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form; // FormData: the browser sets the multipart boundary
  }
  const response = await fetch(path, { method, headers, body });
  if (response.status === 401) {
    localStorage.removeItem(TOKEN_KEY);
    toLogin();
    throw new ApiError(401, "not logged in");
  }
  if (!response.ok) {
    let detail = `${response.status} ${response.statusText}`;
    try {
      detail = (await response.json()).detail ?? detail;
    } catch {
      // not JSON: keep the status line
    }
    throw new ApiError(response.status, detail);
  }
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

// el("a", {href, class: "x", onclick}, "text", child): a DOM node. Text always goes in as
// text, never as HTML: profileIDs and file names come from uploads.
export function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "rect", "text", "line", "g", "title", "path"].includes(tag);
  const node = svg
    ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.setAttribute("class", value);
    else if (name in node && !svg) node[name] = value;
    else node.setAttribute(name, value);
  }
  node.append(...children.flat().filter((c) => c !== null && c !== undefined));
  return node;
}

// The page's header: the way back (crumbs: [label, href] or a plain label) and logging out.
// Pages call it first; it sends visitors without a token to the login page.
export function header(...crumbs) {
  if (!token()) {
    toLogin();
    throw new ApiError(401, "not logged in");
  }
  const trail = [["rangeprof", `${BASE}/`], ...crumbs].flatMap((crumb, i) => {
    const part = Array.isArray(crumb) ? el("a", { href: crumb[1] }, crumb[0]) : el("span", {}, crumb);
    return i ? [el("span", { class: "sep" }, "›"), part] : [part];
  });
  const logout = el(
    "button",
    {
      id: "logout",
      type: "button",
      onclick: () => {
        localStorage.removeItem(TOKEN_KEY);
        location.assign(`${BASE}/login`);
      },
    },
    "Log out",
  );
  document.getElementById("nav").replaceChildren(el("nav", {}, ...trail), logout);
}

export function showError(err, where = "error") {
  if (err?.status === 401) return; // on the way to the login page
  const box = document.getElementById(where);
  box.textContent = err ? String(err.message ?? err) : "";
  box.hidden = !err;
  if (err && where === "error") console.error(err);
}

// Numbers as people read them: 6 significant digits, exponents for the very small or large.
export function fmt(value, digits = 6) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (value === 0 || Number.isInteger(value)) return String(value);
  const magnitude = Math.abs(value);
  if (magnitude < 1e-4 || magnitude >= 1e6) return value.toExponential(digits - 1);
  return String(Number(value.toPrecision(digits)));
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

export function query() {
  return new URLSearchParams(location.search);
}

// The id after `segment` in the page's path: /dashboard/models/3/layer -> pathId("models") = 3.
export function pathId(segment) {
  const parts = location.pathname.split("/");
  return Number(parts[parts.indexOf(segment) + 1]);
}

// A layer's page; `calibration` ({scheme, dtype}) is a chosen view, absent for the target's
// policy (which the layer page picks by the layer's kind).
export function layerHref(modelId, profileId, runId, calibration) {
  const q = new URLSearchParams({ pid: profileId });
  if (runId) q.set("run", runId);
  if (calibration) {
    q.set("scheme", calibration.scheme);
    q.set("dtype", calibration.dtype);
  }
  return `${BASE}/models/${modelId}/layer?${q}`;
}

// The x86 plugin's quantization policy (rangeprof.byoc.x86 PLUGIN.policy), the dashboard's
// default view of suggested scales: asymmetric uint8 activations, symmetric int8 weights (per
// output channel in a build, from the folded constants; per tensor in these views).
export const X86_POLICY = {
  activations: { scheme: "asym", dtype: "uint8" },
  weights: { scheme: "sym", dtype: "int8" },
};

// "asym uint8"
export function calibrationName({ scheme, dtype }) {
  return `${scheme} ${dtype}`;
}

export function statusBadge(status) {
  return el("span", { class: `status ${status}` }, status);
}

export function progressBar(fraction, label) {
  const percent = Math.round(100 * (fraction ?? 0));
  return el(
    "div",
    { class: "progress", role: "progressbar", "aria-valuenow": percent, title: label ?? `${percent}%` },
    el("div", { class: "bar", style: `width: ${percent}%` }),
    el("span", {}, label ?? `${percent}%`),
  );
}

// A job's request (the workflow's, as its process runs it), folded away until asked for.
export function requestDetails(request) {
  if (!request) return "–";
  return el(
    "details",
    { class: "request" },
    el("summary", {}, "request"),
    el("pre", { class: "mono" }, JSON.stringify(request, null, 1)),
  );
}

// How a job's request corrects biases: "stored" (the profile's channel means), a calibration
// data spec (measured on it), or none.
export function biasCorrection(spec) {
  if (!spec) return "–";
  return spec === "stored" ? "from the profile's channel means" : "measured on the run's calibration data";
}

export const ACTIVE = ["queued", "running"];
export const METHODS = ["max", "percentile", "entropy", "mse"];

// How often a page asks again while a job runs: a build of a small model goes through its
// phases within a second or two, which a slower poll shows as nothing but "running".
export const POLL_MS = 250;

// Call `refresh` now and every `ms` while it returns true (something is still running).
export async function poll(refresh, ms = POLL_MS) {
  while (await refresh()) {
    await new Promise((resolve) => setTimeout(resolve, ms));
  }
}

// Save an API response as a file: links cannot send the bearer token, so the page fetches the
// file and hands it to the browser as a download.
export async function download(path, filename) {
  const response = await api(path, { raw: true });
  const url = URL.createObjectURL(await response.blob());
  const link = el("a", { href: url, download: filename, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// SQNR in dB against two thresholds: "good" at or above `good`, "warn" at or above `warn`,
// else "bad". null is an exact match (no error at all).
export function sqnrClass(db, good, warn) {
  if (db === null || db === undefined) return "good";
  if (db >= good) return "good";
  return db >= warn ? "warn" : "bad";
}

export const SQNR_COLOURS = { good: "#2e7d32", warn: "#f9a825", bad: "#c62828", fp32: "#9e9e9e" };

// A table cell showing a number as people read it; `data-value` keeps the exact value the API
// sent (tests compare it, and a copy of the page loses nothing).
export function numCell(value, attrs = {}) {
  const exact = value === null || value === undefined ? "" : String(value);
  return el("td", { class: "num", "data-value": exact, ...attrs }, fmt(value));
}

// The REST API's OpenAPI document, read once: forms take their choices and defaults from the
// option declarations it is generated from, so they cannot drift from the CLI and Python API.
let openapi;

function choicesOf(property) {
  const variants = property.anyOf ?? [property];
  return variants.flatMap((v) => v.enum ?? (v.const !== undefined ? [v.const] : []));
}

// A control for an option the page does not lay out itself: a select of its choices (an
// optional one with an empty first choice), a checkbox, a number, or text (a list: comma-separated).
function control(field, property) {
  const choices = choicesOf(property);
  const optional = (property.anyOf ?? []).some((v) => v.type === "null");
  const type = property.type ?? property.anyOf?.find((v) => v.type !== "null")?.type;
  const text = field.replaceAll("_", " ");
  if (choices.length) {
    const empty = optional ? [el("option", { value: "" }, "none")] : [];
    return el("label", {}, `${text} `, el("select", { name: field }, ...empty));
  }
  if (type === "boolean") return el("label", {}, el("input", { name: field, type: "checkbox", value: "true" }), ` ${text}`);
  if (type === "integer" || type === "number") {
    return el("label", {}, `${text} `, el("input", { name: field, type: "number", step: type === "integer" ? "1" : "any" }));
  }
  return el("label", {}, `${text} `, el("input", { name: field, size: "16", placeholder: type === "array" ? "comma-separated" : "" }));
}

// The options of `form` from the schema `name` of the OpenAPI document: a control for each
// property the page has no field of is added to `container`, then every field named like a
// property gets its choices, its default (as its default state, so that reset() returns to it),
// its bounds and the property's description as its tooltip. Upload fields are the page's own.
export async function applySchema(form, name, container) {
  openapi ??= await (await fetch("/openapi.json")).json();
  const properties = openapi.components.schemas[name].properties;
  for (const [field, property] of Object.entries(properties)) {
    const upload = property.format === "binary" || property.contentMediaType !== undefined;
    if (!form.elements[field] && !upload) container.append(control(field, property));
  }
  for (const [field, property] of Object.entries(properties)) {
    const input = form.elements[field];
    if (!input || input instanceof RadioNodeList || input.type === "file") continue;
    const label = input.closest("label");
    if (label && property.description) label.title = property.description;
    const value = property.default;
    if (input.tagName === "SELECT") {
      const empty = [...input.options].filter((o) => o.value === "");
      const options = choicesOf(property).map((c) => el("option", { value: String(c) }, String(c)));
      input.replaceChildren(...empty, ...options);
      const chosen = value === undefined || value === null ? "" : String(value);
      for (const option of input.options) option.defaultSelected = option.value === chosen;
      input.value = chosen;
    } else if (input.type === "checkbox") {
      input.defaultChecked = input.checked = value === true;
    } else if (input.type === "number") {
      if (property.minimum !== undefined) input.min = property.minimum;
      if (property.maximum !== undefined) input.max = property.maximum;
      if (typeof value === "number") input.defaultValue = input.value = value;
    }
  }
}
