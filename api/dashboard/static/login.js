// The login page: a token is checked against the API, then kept in local storage.
import { BASE, el, query, setToken, showError } from "./dashboard.js";

document.getElementById("nav").replaceChildren(el("nav", {}, el("a", { href: `${BASE}/` }, "rangeprof")));

document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const value = document.getElementById("token").value.trim();
  // Checked here rather than through api(): a refused token must stay on this page.
  const response = await fetch("/api/models", { headers: { Authorization: `Bearer ${value}` } });
  if (!response.ok) {
    const { detail } = await response.json().catch(() => ({ detail: response.statusText }));
    showError(new Error(`token refused: ${detail}`));
    return;
  }
  setToken(value);
  const next = query().get("next");
  // Only a path of this dashboard: an absolute URL in `next` must not send the user away.
  location.assign(next?.startsWith(`${BASE}/`) ? next : `${BASE}/`);
});
