// Drift from run a to run b, per layer, largest first (from GET /api/runs/{a}/compare/{b}).
import { api, BASE, el, fmt, header, layerHref, numCell, query, showError } from "./dashboard.js";

const a = Number(query().get("a"));
const b = Number(query().get("b"));

// Largest drift first: histogram distance, then the size of the range change; unknowns last.
function drift(t) {
  return [t.histogram_distance ?? -1, Math.abs(t.range_change ?? -1)];
}

function range(r) {
  return `[${fmt(r.min, 4)}, ${fmt(r.max, 4)}]`;
}

async function main() {
  header(["Models", `${BASE}/`], `run ${a} → run ${b}`);
  const [report, runA] = await Promise.all([api(`/api/runs/${a}/compare/${b}`), api(`/api/runs/${a}`)]);
  document.getElementById("title").textContent = `Drift from run ${a} to run ${b}`;
  const tensors = [...report.tensors].sort((x, y) => {
    const [dx, rx] = drift(x);
    const [dy, ry] = drift(y);
    return dy - dx || ry - rx;
  });
  const rows = tensors.map((t, i) =>
    el(
      "tr",
      { "data-profile-id": t.profile_id },
      el("td", { class: "num" }, i + 1),
      el("td", { class: "mono" }, el("a", { href: layerHref(runA.model_id, t.profile_id, b) }, t.profile_id)),
      el("td", {}, t.kind),
      el("td", { class: "num" }, range(t.a)),
      el("td", { class: "num" }, range(t.b)),
      numCell(t.min_shift),
      numCell(t.max_shift),
      numCell(t.range_change, { "data-column": "range_change" }),
      el(
        "td",
        { "data-column": "histogram_distance", "data-value": t.histogram_distance ?? "" },
        el("span", { class: "meter", style: `width:${Math.round(120 * (t.histogram_distance ?? 0))}px` }),
        fmt(t.histogram_distance, 4),
      ),
    ),
  );
  document.querySelector("#drift tbody").replaceChildren(...rows);
  const only = [
    report.only_in_a.length && `only in run ${a}: ${report.only_in_a.join(", ")}`,
    report.only_in_b.length && `only in run ${b}: ${report.only_in_b.join(", ")}`,
  ].filter(Boolean);
  document.getElementById("only").textContent = only.join("; ");
}

main().catch(showError);
