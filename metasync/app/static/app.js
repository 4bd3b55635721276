// The metasync service's page: plain JavaScript, no framework, no build step.
//
// It polls the REST API of docs/api.md (folders and events every POLL_MS; the open
// tab's data when what it shows changed) and renders with DOM calls only -- never
// innerHTML with data, since paths and messages come from other devices.
// Where the page is (folder, tab, history version and folder) lives in the URL's
// hash, so reloading or sharing a link keeps it: #/FOLDER/TAB?version=N&path=DIR.
"use strict";

const POLL_MS = 1500;
const EVENTS_KEPT = 100;
const LIST_SHOWN = 200;

const S = {
  folders: [],
  system: null,
  lastEvent: 0,
  events: [],
  route: { id: null, tab: "overview", version: null, path: "" },
  activity: { key: null, items: [] },
  conflicts: { key: null, items: [] },
  history: { key: null, entries: [], latest: null },
  // Folder id -> {key, n}: how many conflict copies its folder holds now (GET .../conflicts,
  // asked again when the folder's version or its conflict field changes).
  conflictCounts: {},
  signedOut: false,
  // What each panel was last drawn from: a panel is redrawn only when that changes,
  // so a poll never replaces a button under the pointer or an open comparison.
  drawn: {
    activity: null, conflicts: null, history: null, events: null, folders: null, doomed: null,
    backends: null,
  },
};

function draw(panel, key, fn) {
  if (S.drawn[panel] === key) return;
  S.drawn[panel] = key;
  fn();
}

// ------------------------------------------------------------------ helpers

const $ = (id) => document.getElementById(id);

/** h("a", {href: x, class: "y"}, "text", child...) -> an element; null/false children skipped. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function show(el, visible) { el.hidden = !visible; }

function cookie(name) {
  for (const part of document.cookie.split(";")) {
    const [k, ...v] = part.trim().split("=");
    if (k === name) return decodeURIComponent(v.join("="));
  }
  return "";
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 1 : 0)) + " " + units[i];
}

function ago(t) {
  if (!t) return "never";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 5) return "just now";
  if (s < 60) return Math.floor(s) + " s ago";
  if (s < 3600) return Math.floor(s / 60) + " min ago";
  if (s < 86400) return Math.floor(s / 3600) + " h ago";
  return new Date(t * 1000).toLocaleString();
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : ""; }

function timeEl(t) {
  return h("time", { datetime: t ? new Date(t * 1000).toISOString() : null, title: when(t), "data-t": t || null }, ago(t));
}

/** Bring every "… ago" on the page up to date, without redrawing what holds it. */
function refreshTimes() {
  for (const el of document.querySelectorAll("time[data-t]")) {
    const text = ago(Number(el.dataset.t));
    if (el.textContent !== text) el.textContent = text;
  }
}

const STATE_TEXT = {
  starting: "Starting", idle: "Up to date", syncing: "Syncing", paused: "Paused",
  offline: "Offline", error: "Error", stopped: "Stopped",
};

// ------------------------------------------------------------------ the API

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

/** One call of docs/api.md; state-changing ones carry the CSRF cookie's value. */
async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") {
    headers["Content-Type"] = "application/json";
    // Named for the port: a browser shares 127.0.0.1's cookies among all its ports.
    headers["X-CSRF-Token"] = cookie(`metasync-csrf-${location.port}`);
  }
  let response;
  try {
    response = await fetch(path, {
      method, headers, credentials: "same-origin", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (exc) {
    throw new ApiError(0, "the service does not answer (is `metasync service` running?)");
  }
  let data = null;
  try { data = await response.json(); } catch (exc) { data = null; }
  if (response.status === 401) setSignedOut(true);
  if (!response.ok) {
    throw new ApiError(response.status, (data && data.error) || `${response.status} ${response.statusText}`);
  }
  return data;
}

const folderUrl = (id, rest) => `/rest/folders/${encodeURIComponent(id)}${rest || ""}`;

function fileUrl(id, path, version) {
  const q = new URLSearchParams({ path });
  if (version !== null && version !== undefined) q.set("version", String(version));
  return folderUrl(id, "/file?" + q.toString());
}

function setSignedOut(out) {
  S.signedOut = out;
  show($("signed-out"), out);
  show($("layout"), !out);
}

function setConnected(ok, why) {
  const el = $("connection");
  const text = ok ? "connected" : "disconnected: " + why;
  if (el.textContent === text) return;  // a live region: said again only when it changes
  el.dataset.connected = ok ? "true" : "false";
  el.textContent = text;
}

// ------------------------------------------------------------------ routing

function parseRoute() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [where, query] = raw.split("?");
  const [id, tab] = (where || "").split("/").map((x) => decodeURIComponent(x || ""));
  const q = new URLSearchParams(query || "");
  const version = q.get("version");
  S.route = {
    id: id || null,
    tab: ["overview", "activity", "conflicts", "history"].includes(tab) ? tab : "overview",
    // A version number, or a commit id (hex) for a commit this device never had as master.
    version: !version ? null : /^\d+$/.test(version) ? Number(version)
      : /^[0-9a-f]{4,64}$/i.test(version) ? version : null,
    path: q.get("path") || "",
  };
}

function routeHash(id, tab, version, path) {
  let out = "#/" + encodeURIComponent(id) + "/" + (tab || "overview");
  const q = new URLSearchParams();
  if (version !== null && version !== undefined) q.set("version", String(version));
  if (path) q.set("path", path);
  const qs = q.toString();
  return qs ? out + "?" + qs : out;
}

function go(tab, version, path) {
  const f = current();
  if (f) location.hash = routeHash(f.id, tab, version, path);
}

function current() {
  if (!S.folders.length) return null;
  return S.folders.find((f) => f.id === S.route.id) || S.folders[0];
}

// ------------------------------------------------------------------ rendering

function render() {
  if (S.signedOut) return;
  renderSystem();
  renderFolderList();
  const f = current();
  show($("no-folders"), !f);
  show($("folder"), !!f);
  if (f) renderFolder(f);
  // The notifications are a live region: redrawn only when they change.
  draw("events", `${S.events.length ? S.events[S.events.length - 1].id : 0}:${S.events.length}:${S.folders.map((x) => x.label).join("/")}`,
    renderEvents);
  refreshTimes();
}

function renderSystem() {
  const s = S.system;
  $("system").textContent = s ? `version ${s.version} · ${s.folders} folder${s.folders === 1 ? "" : "s"}` : "";
}

function renderFolderList() {
  const sel = current();
  // Redrawn only when it changes, so a poll never replaces a link being clicked.
  const key = JSON.stringify([sel && sel.id, S.route.tab,
    S.folders.map((f) => [f.id, f.label, f.path, f.state, f.last_sync, conflictsOf(f)])]);
  if (S.drawn.folders === key) return;
  S.drawn.folders = key;
  const items = S.folders.map((f) => h("li", { "data-folder-id": f.id },
    h("a", { href: routeHash(f.id, S.route.tab), "aria-current": sel && sel.id === f.id ? "page" : null },
      h("span", { class: "label" }, f.label || f.path),
      h("span", { class: "state", "data-state": f.state }, STATE_TEXT[f.state] || f.state),
      conflictsOf(f)
        ? h("span", { class: "count bad", "data-role": "conflicts" }, `${conflictsOf(f)} conflict${conflictsOf(f) === 1 ? "" : "s"}`)
        : null,
      h("span", { class: "muted small" }, "synced ", timeEl(f.last_sync)))));
  $("folders").replaceChildren(...items);
}

function renderFolder(f) {
  const folder = $("folder");
  folder.dataset.folderId = f.id;
  folder.dataset.state = f.state;
  $("folder-label").textContent = f.label || f.path;
  $("folder-path").textContent = f.path;
  const state = $("folder-state");
  state.textContent = STATE_TEXT[f.state] || f.state;
  state.dataset.state = f.state;
  const reason = $("folder-reason");
  reason.textContent = f.reason || "";
  show(reason, !!f.reason);

  const p = f.progress;
  show($("folder-progress"), f.state === "syncing" && !!p);
  if (p) {
    $("folder-progress-bar").max = Math.max(1, p.total);
    $("folder-progress-bar").value = p.done;
    $("folder-progress-text").textContent = `${bytes(p.done)} of ${bytes(p.total)}`;
  }
  $("folder-last-sync").replaceChildren(timeEl(f.last_sync));
  $("folder-version").textContent = f.version || "—";
  $("folder-pending").textContent = String(f.pending_changes || 0);
  $("folder-unpushed").textContent = f.unpushed ? "yes: waiting for the backends" : "no";

  const paused = f.state === "paused";
  const doomed = f.would_delete || [];
  $("action-pause").disabled = paused || f.state === "stopped";
  $("action-resume").disabled = !paused;
  $("action-resume").textContent = paused && doomed.length
    ? `Resume and delete ${doomed.length} file${doomed.length === 1 ? "" : "s"}` : "Resume";
  $("action-sync").disabled = paused || f.state === "stopped";

  show($("would-delete"), paused && doomed.length > 0);
  if (doomed.length && S.drawn.doomed !== JSON.stringify(doomed)) {
    // Redrawn only when it changes: a poll keeps the list where it was scrolled.
    S.drawn.doomed = JSON.stringify(doomed);
    $("would-delete-title").textContent =
      `Paused before deleting ${doomed.length} file${doomed.length === 1 ? "" : "s"}`;
    const shown = doomed.slice(0, LIST_SHOWN).map((p) => h("li", { "data-path": p }, p));
    if (doomed.length > LIST_SHOWN) shown.push(h("li", { class: "muted" }, `and ${doomed.length - LIST_SHOWN} more`));
    $("would-delete-list").replaceChildren(...shown);
  }

  const n = conflictsOf(f);
  $("conflict-count").textContent = n ? String(n) : "";
  for (const tab of document.querySelectorAll("#tabs [role=tab]")) {
    const on = tab.dataset.tab === S.route.tab;
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
    show($("panel-" + tab.dataset.tab), on);
  }
  draw("backends", JSON.stringify(f.backends || []), () => renderBackends(f));
}

function conflictsOf(f) {
  const known = S.conflictCounts[f.id];
  return known ? known.n : (f.conflicts || []).length;
}

function conflictKey(f) { return `${f.version}:${JSON.stringify(f.conflicts || [])}`; }

/** Count each folder's conflicts whenever what could change them changed. */
async function refreshConflictCounts() {
  for (const f of S.folders) {
    const key = conflictKey(f);
    if (S.conflictCounts[f.id] && S.conflictCounts[f.id].key === key) continue;
    const items = await api("GET", folderUrl(f.id, "/conflicts"));
    S.conflictCounts[f.id] = { key, n: items.length };
    if (current() && current().id === f.id) S.conflicts = { key: `${f.id}:${key}`, items };
  }
}

// ---- backends: a hand-drawn SVG bar chart of each one's share of its capacity

function renderBackends(f) {
  const backends = f.backends || [];
  const rows = backends.map((b) => {
    const ok = b.health === "ok";
    // The reason it fails, and a past error of a backend that answers again.
    const why = ok ? b.last_error : b.health;
    return h("tr", { "data-backend": b.name, "data-health": ok ? "ok" : "failing" },
      h("th", { scope: "row" }, h("code", {}, b.name)),
      h("td", { class: "health" },
        h("div", {}, h("span", { class: "dot " + (ok ? "ok" : "bad"), "aria-hidden": "true" }),
          ok ? "OK" : ["Failing", b.failing_since ? [" since ", timeEl(b.failing_since)] : null]),
        why ? h("div", { class: "why", title: why }, ok ? "last error: " + why : why) : null),
      h("td", { class: "num" }, b.latency_ms === null || b.latency_ms === undefined ? "—" : b.latency_ms.toFixed(1) + " ms"),
      h("td", { class: "num" }, b.objects === null || b.objects === undefined ? "—" : b.objects.toLocaleString()),
      h("td", { class: "num" }, bytes(b.bytes)),
      h("td", { class: "num" }, b.capacity ? bytes(b.capacity) : "not set"));
  });
  $("backends").tBodies[0].replaceChildren(...rows);
  $("backend-chart").replaceChildren(backendChart(backends));
}

function backendChart(backends) {
  const W = 720, label = 220, bar = 300, rowH = 34, top = 6;
  const H = top + rowH * Math.max(1, backends.length);
  // Without a configured capacity a bar is drawn against the largest backend's use.
  const most = Math.max(1, ...backends.map((b) => b.bytes || 0));
  const chart = svg("svg", {
    viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", id: "backend-chart-svg",
    "aria-label": "Bytes each backend stores, against its capacity",
  });
  backends.forEach((b, i) => {
    const y = top + i * rowH;
    const ok = b.health === "ok";
    const share = b.capacity ? Math.min(1, (b.bytes || 0) / b.capacity) : (b.bytes || 0) / most;
    const text = b.capacity
      ? `${bytes(b.bytes)} of ${bytes(b.capacity)} (${(100 * (b.bytes || 0) / b.capacity).toFixed(1)}%)`
      : `${bytes(b.bytes)} (no capacity set)`;
    chart.append(svg("g", { "data-backend": b.name, class: ok ? "ok" : "bad" },
      svg("title", {}, `${b.name}: ${text}${ok ? "" : " — failing: " + b.health}`),
      svg("circle", { cx: 8, cy: y + 12, r: 6, class: ok ? "dot-ok" : "dot-bad" }),
      svg("text", { x: 22, y: y + 16, class: "chart-label" }, shorten(b.name, 25)),
      svg("rect", { x: label, y: y + 4, width: bar, height: 16, rx: 3, class: b.capacity ? "track" : "track nocap" }),
      svg("rect", { x: label, y: y + 4, width: Math.max(share > 0 ? 2 : 0, share * bar), height: 16, rx: 3, class: ok ? "fill" : "fill bad" }),
      svg("text", { x: label + bar + 10, y: y + 16, class: "chart-value" }, text)));
  });
  if (!backends.length) chart.append(svg("text", { x: 0, y: 20 }, "No backends."));
  return chart;
}

function shorten(s, n) { return s.length <= n ? s : "…" + s.slice(s.length - n + 1); }

// ---- activity

function renderActivity(f) {
  const items = S.activity.items.map((v) => {
    const changes = v.changes || [];
    const shown = changes.slice(0, 12).map((c) => h("li", { "data-kind": c.kind, "data-path": c.path },
      h("span", { class: "kind " + c.kind, title: c.kind }, { added: "+", modified: "~", deleted: "−" }[c.kind] || "?"),
      " ", c.path));
    const more = changes.length - shown.length + (v.more || 0);
    if (more > 0) shown.push(h("li", { class: "muted" }, `and ${more} more`));
    // A commit merged in from another device has no version number here: named by its id.
    const named = v.version !== null && v.version !== undefined;
    const ref = named ? v.version : (v.commit || "").slice(0, 12);
    return h("li", { "data-version": named ? v.version : null, "data-commit": v.commit || null },
      h("div", { class: "version-head" },
        h("strong", {}, named ? "Version " + v.version : "Commit " + ref), " · ",
        h("span", { class: "device" }, v.device || "?"), " · ", timeEl(v.time),
        ref ? h("a", { class: "browse", href: routeHash(f.id, "history", ref) }, "Browse files") : null),
      v.message ? h("p", { class: "message" }, v.message) : null,
      h("ul", { class: "changes" }, shown));
  });
  if (!items.length) items.push(h("li", { class: "muted" }, "No versions yet."));
  $("activity").replaceChildren(...items);
}

// ---- conflicts

function renderConflicts(f) {
  const items = S.conflicts.items.map((c) => {
    // The copy carries the device that made its version: this one's when mine is the copy.
    const mineIsPath = c.mine === "path";
    const mine = mineIsPath ? c.path : c.copy;
    const theirs = mineIsPath ? c.copy : c.path;
    const preview = h("div", { class: "compare", hidden: true });
    return h("li", { "data-path": c.path, "data-copy": c.copy },
      h("p", {}, h("strong", {}, c.path), h("span", { class: "muted" }, " — changed on two devices before either saw the other's change")),
      h("ul", { class: "versions" },
        h("li", {}, mineIsPath ? "Mine: " : `Mine (${c.device}, this device): `,
          h("a", { class: "open-mine", href: fileUrl(f.id, mine), download: basename(mine) }, mine)),
        h("li", {}, mineIsPath ? `Theirs (${c.device}): ` : "Theirs: ",
          h("a", { class: "open-theirs", href: fileUrl(f.id, theirs), download: basename(theirs) }, theirs))),
      h("div", { class: "buttons" },
        h("button", { type: "button", class: "compare-button", onclick: () => compare(f.id, mine, theirs, preview) }, "Compare"),
        h("button", { type: "button", "data-keep": "mine", onclick: (e) => resolve(f.id, c.copy, "mine", e.target) }, "Keep mine"),
        h("button", { type: "button", "data-keep": "theirs", onclick: (e) => resolve(f.id, c.copy, "theirs", e.target) }, "Keep theirs"),
        h("button", { type: "button", "data-keep": "both", onclick: (e) => resolve(f.id, c.copy, "both", e.target) }, "Keep both")),
      preview);
  });
  show($("conflicts-empty"), !items.length);
  $("conflicts").replaceChildren(...items);
}

function basename(p) { return p.split("/").pop(); }

/** Show both versions side by side (the first 64 KiB of each, as text). */
async function compare(id, mine, theirs, box) {
  const get = async (p) => {
    const r = await fetch(fileUrl(id, p), { credentials: "same-origin", cache: "no-store" });
    if (!r.ok) return `(cannot open: ${r.status})`;
    const data = await r.arrayBuffer();
    return new TextDecoder("utf-8", { fatal: false }).decode(data.slice(0, 65536));
  };
  const [a, b] = await Promise.all([get(mine), get(theirs)]);
  box.replaceChildren(
    h("figure", { class: "side mine" }, h("figcaption", {}, "Mine: " + mine), h("pre", {}, a)),
    h("figure", { class: "side theirs" }, h("figcaption", {}, "Theirs: " + theirs), h("pre", {}, b)));
  box.hidden = false;
}

async function resolve(id, copy, keep, button) {
  const err = $("conflict-error");
  err.hidden = true;
  button.disabled = true;
  try {
    S.conflicts.items = await api("POST", folderUrl(id, "/conflicts/resolve"), { copy, keep });
    const f = current();
    S.conflicts.key = null; // the folder's next poll fetches the list again
    S.conflictCounts[id] = { key: null, n: S.conflicts.items.length };
    S.drawn.conflicts = null;
    renderConflicts(f);
    await pollFolders();
  } catch (exc) {
    err.textContent = `Could not resolve ${copy}: ${exc.message}`;
    err.hidden = false;
    button.disabled = false;
  }
}

// ---- history

function historyVersion(f) { return S.route.version || f.version || null; }

function renderHistory(f) {
  const version = historyVersion(f);
  const input = $("history-version");
  if (document.activeElement !== input) input.value = typeof version === "number" ? version : "";
  input.max = f.version || 1;
  const numbered = typeof version === "number";
  $("history-older").disabled = !numbered || version <= 1;
  $("history-newer").disabled = !numbered || version >= (f.version || 0);
  const known = S.activity.items.find((v) => v.version === version
    || (!numbered && v.commit && v.commit.startsWith(String(version))));
  $("history-message").textContent = known
    ? `${known.device} · ${when(known.time)}${known.message ? " · " + known.message : ""}`
    : (version === f.version ? "the latest version" : numbered ? "" : `commit ${version}`);

  const parts = S.route.path ? S.route.path.split("/") : [];
  const crumbs = [h("a", { href: routeHash(f.id, "history", S.route.version), "data-path": "" }, f.label || "/")];
  parts.forEach((part, i) => {
    const p = parts.slice(0, i + 1).join("/");
    crumbs.push(" / ", h("a", { href: routeHash(f.id, "history", S.route.version, p), "data-path": p }, part));
  });
  if (parts.length) {
    crumbs.push(" ", h("button", { type: "button", id: "restore-folder", class: "restore",
      onclick: (e) => restore(f.id, S.route.path, version, e.target) }, `Restore this folder from version ${version}`));
  }
  $("history-crumbs").replaceChildren(...crumbs);

  const rows = S.history.entries.map((e) => h("tr", { "data-path": e.path, "data-type": e.type },
    h("td", { class: "name" },
      e.type === "dir"
        ? h("a", { class: "dir", href: routeHash(f.id, "history", S.route.version, e.path) }, e.name + "/")
        : h("span", {}, e.name, e.type === "link" ? h("span", { class: "muted" }, " (symbolic link)") : null),
      S.history.latest && !S.history.latest.has(e.path)
        ? h("span", { class: "gone", "data-role": "gone" }, "deleted since") : null),
    h("td", { class: "num" }, e.type === "file" ? bytes(e.size) : ""),
    h("td", { class: "actions" },
      e.type === "file"
        ? h("a", { class: "download", href: fileUrl(f.id, e.path, version), download: e.name }, "Download")
        : null,
      h("button", { type: "button", class: "restore", onclick: (ev) => restore(f.id, e.path, version, ev.target) },
        "Restore"))));
  $("history-tree").tBodies[0].replaceChildren(...rows);
  show($("history-empty"), S.history.key !== null && !rows.length);
}

async function restore(id, path, version, button) {
  const status = $("history-status"), err = $("history-error");
  status.hidden = true; err.hidden = true;
  button.disabled = true;
  try {
    const out = await api("POST", folderUrl(id, "/restore"), { path, version });
    const n = (out.restored || []).length;
    status.textContent = `Restored ${path} from version ${version} (${n} path${n === 1 ? "" : "s"}); syncing it.`;
    status.hidden = false;
    await pollFolders();
  } catch (exc) {
    err.textContent = `Could not restore ${path}: ${exc.message}`;
    err.hidden = false;
  } finally {
    button.disabled = false;
  }
}

// ---- notifications

const EVENT_TEXT = {
  conflict: "Conflict", paused: "Paused", "backend-failing": "Backend failing",
  "backend-ok": "Backend back", synced: "Synced", error: "Error",
};

function renderEvents() {
  const label = (id) => { const f = S.folders.find((x) => x.id === id); return f ? (f.label || f.path) : id; };
  const items = S.events.slice().reverse().map((e) => h("li", {
    "data-event-id": e.id, "data-kind": e.kind, "data-folder": e.folder, class: "event " + e.kind,
  },
  h("div", {}, h("strong", {}, EVENT_TEXT[e.kind] || e.kind), " · ",
    h("a", { href: routeHash(e.folder, e.kind === "conflict" ? "conflicts" : "overview") }, label(e.folder)),
    " · ", timeEl(e.time)),
  h("div", { class: "message", title: e.message }, e.message)));
  $("events").replaceChildren(...items);
  show($("events-empty"), !items.length);
}

// ------------------------------------------------------------------ polling

async function pollFolders() {
  S.folders = await api("GET", "/rest/folders");
  render();
}

async function pollEvents() {
  const out = await api("GET", "/rest/events?since=" + S.lastEvent);
  if (!out) return;
  // A restarted service numbers its events from 1 again and, asked for more than it
  // has, answers all of them: what the page showed is from the earlier run.
  if (typeof out.last === "number" && out.last < S.lastEvent) S.events = [];
  S.events.push(...(out.events || []));
  S.events = S.events.slice(-EVENTS_KEPT);
  if (typeof out.last === "number") S.lastEvent = out.last;
}

/** Fetch what the open tab shows, when what it depends on changed. */
async function refreshPanel() {
  const f = current();
  if (!f) return;
  const tab = S.route.tab;
  if (tab === "activity" || tab === "history") {
    const key = `${f.id}:${f.version}`;
    if (S.activity.key !== key) {
      const items = await api("GET", folderUrl(f.id, "/activity?limit=30"));
      S.activity = { key, items };
    }
  }
  if (tab === "conflicts") {
    const key = `${f.id}:${conflictKey(f)}`;
    if (S.conflicts.key !== key) {
      const items = await api("GET", folderUrl(f.id, "/conflicts"));
      S.conflicts = { key, items };
      S.conflictCounts[f.id] = { key: conflictKey(f), n: items.length };
    }
    draw("conflicts", S.conflicts.key, () => renderConflicts(f));
  }
  if (tab === "history") {
    const version = historyVersion(f);
    const key = `${f.id}:${version}:${S.route.path}`;
    if (S.history.key !== key) {
      const q = new URLSearchParams();
      if (version) q.set("version", String(version));
      if (S.route.path) q.set("path", S.route.path);
      try {
        const entries = await api("GET", folderUrl(f.id, "/tree?" + q.toString()));
        // In an older version, mark what the latest one no longer has (what a restore brings back).
        let latest = null;
        if (version && version !== f.version) {
          const lq = new URLSearchParams();
          if (S.route.path) lq.set("path", S.route.path);
          try {
            latest = new Set((await api("GET", folderUrl(f.id, "/tree?" + lq.toString()))).map((e) => e.path));
          } catch (exc) {
            latest = new Set(); // the folder itself is gone in the latest version
          }
        }
        S.history = { key, entries, latest };
        $("history-error").hidden = true;
      } catch (exc) {
        S.history = { key, entries: [], latest: null };
        $("history-error").textContent = `Cannot show version ${version}: ${exc.message}`;
        $("history-error").hidden = false;
      }
    }
    draw("history", `${S.history.key}:${f.version}:${S.activity.key}:${S.route.version}`,
      () => renderHistory(f));
  }
  if (tab === "activity") draw("activity", S.activity.key, () => renderActivity(f));
}

let timer = null;

async function tick() {
  clearTimeout(timer);
  try {
    if (!S.system) S.system = await api("GET", "/rest/system");
    await pollFolders();
    await pollEvents();
    await refreshConflictCounts();
    render();
    await refreshPanel();
    setConnected(true);
    if (S.signedOut) setSignedOut(false);
  } catch (exc) {
    setConnected(false, exc.message);
  }
  if (!S.signedOut) timer = setTimeout(tick, POLL_MS);
}

// ------------------------------------------------------------------ actions

async function folderAction(action) {
  const f = current();
  if (!f) return;
  const err = $("action-error");
  err.hidden = true;
  try {
    const out = await api("POST", folderUrl(f.id, "/" + action));
    S.folders = S.folders.map((x) => (x.id === out.id ? out : x));
    render();
  } catch (exc) {
    err.textContent = `${action} failed: ${exc.message}`;
    err.hidden = false;
  }
}

async function addFolder(event) {
  event.preventDefault();
  const input = $("add-folder-path"), err = $("add-folder-error");
  err.hidden = true;
  $("add-folder-submit").disabled = true;
  try {
    const f = await api("POST", "/rest/folders", { path: input.value.trim() });
    input.value = "";
    S.system = null;
    location.hash = routeHash(f.id, "overview");
    await tick();
  } catch (exc) {
    err.textContent = exc.message;
    err.hidden = false;
  } finally {
    $("add-folder-submit").disabled = false;
  }
}

function init() {
  parseRoute();
  window.addEventListener("hashchange", () => { parseRoute(); render(); refreshPanel().catch(() => {}); });
  for (const b of document.querySelectorAll("#folder-actions [data-action]")) {
    b.addEventListener("click", () => folderAction(b.dataset.action));
  }
  for (const t of document.querySelectorAll("#tabs [role=tab]")) {
    t.addEventListener("click", () => go(t.dataset.tab, t.dataset.tab === "history" ? S.route.version : null,
      t.dataset.tab === "history" ? S.route.path : ""));
  }
  $("tabs").addEventListener("keydown", (e) => {  // arrow keys move between tabs
    const tabs = [...document.querySelectorAll("#tabs [role=tab]")];
    const i = tabs.indexOf(document.activeElement);
    if (i < 0 || (e.key !== "ArrowRight" && e.key !== "ArrowLeft")) return;
    const next = tabs[(i + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length];
    next.focus();
    next.click();
  });
  $("add-folder").addEventListener("submit", addFolder);
  $("history-nav").addEventListener("submit", (e) => {
    e.preventDefault();
    const v = Number($("history-version").value);
    if (v >= 1) go("history", v, S.route.path);
  });
  $("history-older").addEventListener("click", () => {
    const v = historyVersion(current());
    if (typeof v === "number" && v > 1) go("history", v - 1, S.route.path);
  });
  $("history-newer").addEventListener("click", () => {
    const f = current();
    const v = historyVersion(f);
    if (typeof v === "number" && v < f.version) go("history", v + 1, S.route.path);
  });
  $("history-latest").addEventListener("click", () => go("history", null, S.route.path));
  tick();
}

document.addEventListener("DOMContentLoaded", init);
