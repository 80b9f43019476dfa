// Keel console: live updates from the journal's Server-Sent Events, and confirmations. The pages work without it.
"use strict";

function liveStatus(text) {
  document.querySelectorAll("[data-live-status]").forEach((el) => { el.textContent = text; });
}

let drawn = 0;  // the latest redraw asked for: an older answer arriving late must not overwrite a newer one

async function swap(target, url) {
  const mine = ++drawn;
  const response = await fetch(url, { headers: { Accept: "text/html" }, credentials: "same-origin" });
  if (response.status === 401 || response.redirected) { liveStatus("Signed out: reload to sign in."); return; }
  if (!response.ok) { return; }
  const html = await response.text();
  if (mine !== drawn) { return; }
  // What the person opened stays open across a redraw (the same call keeps the same id).
  const open = Array.from(target.querySelectorAll("details[open][id]"), (el) => el.id);
  target.innerHTML = html;
  open.forEach((id) => {
    const again = document.getElementById(id);
    if (again && target.contains(again)) { again.open = true; }
  });
}

function follow(url, onEvent) {
  const source = new EventSource(url);
  let pending = false;
  const redraw = () => {
    if (pending) { return; }
    pending = true;
    setTimeout(async () => { pending = false; await onEvent(); }, 150);
  };
  // On (re)connecting, redraw once: whatever changed while the page loaded or the stream was down shows at once.
  source.onopen = () => { liveStatus("Live: updates as they happen."); redraw(); };
  source.onerror = () => liveStatus("Live updates interrupted: reconnecting…");
  ["changed", "transition", "rejected", "suppressed", "created", "operator"].forEach((kind) => {
    source.addEventListener(kind, redraw);
  });
  return source;
}

document.addEventListener("DOMContentLoaded", () => {
  const rows = document.querySelector("[data-live-list]");
  if (rows) {
    follow(rows.dataset.liveList, () => swap(rows, rows.dataset.rows));
    const every = Number(rows.dataset.every);  // ages and timeouts move on while nothing else does
    if (every > 0) { setInterval(() => swap(rows, rows.dataset.rows), every * 1000); }
  }
  const panel = document.querySelector("[data-live-agent]");
  if (panel) {
    follow(panel.dataset.liveAgent, () => swap(panel, panel.dataset.panel));
  }
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) { event.preventDefault(); }
    });
  });
});
