// The models list and the upload form.
import { api, BASE, el, fmt, header, showError, when } from "./dashboard.js";

async function list() {
  const models = await api("/api/models");
  const rows = models.map((m) =>
    el(
      "tr",
      { "data-model-id": m.id },
      el("td", { class: "num" }, m.id),
      el("td", {}, el("a", { href: `${BASE}/models/${m.id}` }, m.name)),
      el("td", { class: "mono" }, m.inputs.map((i) => `${i.name} ${i.shape.join("×")} ${i.dtype}`).join(", ")),
      el("td", { class: "num" }, m.opset),
      el("td", { class: "num" }, `${fmt(m.size / 1024, 4)} KiB`),
      el("td", { class: "mono", title: m.sha256 }, m.sha256.slice(0, 12)),
      el("td", {}, when(m.created_at)),
    ),
  );
  document.querySelector("#models tbody").replaceChildren(...rows);
  document.getElementById("no-models").hidden = models.length > 0;
}

document.getElementById("upload").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  if (!form.get("input_shapes")) form.delete("input_shapes");
  const status = document.getElementById("upload-status");
  status.textContent = "loading and tracking the model…";
  showError(null, "upload-error");
  try {
    const model = await api("/api/models", { method: "POST", form });
    location.assign(`${BASE}/models/${model.id}`);
  } catch (err) {
    showError(err, "upload-error");
  } finally {
    status.textContent = "";
  }
});

async function main() {
  header();
  await list();
}

main().catch(showError);
