"""``/fair-sched/ui``: one self-contained page that watches the status document live.

No build step, no CDN, no external font: the HTML, CSS and JavaScript below are the whole page.
It carries no data. It asks for the admin key (a password field whose value is never part of a
URL: the input has no name and the Content-Security-Policy forbids form submission), keeps it in
memory and in the tab's sessionStorage, and polls ``./status`` with ``Authorization: Bearer``.
A 401 drops the key and shows the prompt again. History for the sparklines is kept in the page.
Everything the status says is written with ``textContent``, never parsed as HTML (model names
come from clients). The CSP allows exactly the inline script and style below (by hash) and
connections to this origin.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import html

from starlette.responses import Response

_STYLE = """
:root { color-scheme: light dark; --bg:#f6f7f9; --card:#fff; --ink:#1c2330; --mute:#667085;
  --line:#e3e6ea; --ok:#1f9d55; --warn:#d97706; --bad:#d14343; --info:#2f6fd6; --bar:#5b8def; }
@media (prefers-color-scheme: dark) { :root { --bg:#12151b; --card:#1b2029; --ink:#e7eaf0;
  --mute:#98a2b3; --line:#2b3340; --bar:#6b9cff; } }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
  background:var(--bg); color:var(--ink); }
header { display:flex; align-items:center; gap:12px; padding:10px 18px;
  border-bottom:1px solid var(--line); background:var(--card); }
header h1 { font-size:16px; margin:0; font-weight:600; }
header .live { color:var(--mute); font-size:12px; margin-left:auto; }
button { font:inherit; padding:5px 12px; border-radius:6px; border:1px solid var(--line);
  background:var(--card); color:var(--ink); cursor:pointer; }
button.primary { background:var(--info); color:#fff; border-color:var(--info); }
main { padding:16px 18px; max-width:1280px; margin:0 auto; }
#login { max-width:380px; margin:12vh auto; background:var(--card); padding:22px;
  border:1px solid var(--line); border-radius:10px; }
#login h2 { margin:0 0 6px; font-size:17px; }
#login p { color:var(--mute); margin:0 0 14px; font-size:13px; }
#login input { width:100%; font:inherit; padding:7px 9px; border-radius:6px;
  border:1px solid var(--line); background:var(--bg); color:var(--ink); margin-bottom:10px; }
#login-error { color:var(--bad); min-height:1.2em; font-size:13px; margin-bottom:6px; }
.hidden { display:none !important; }
.totals { display:flex; gap:10px; flex-wrap:wrap; margin-bottom:14px; }
.stat { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:8px 14px; min-width:110px; }
.stat b { display:block; font-size:20px; font-variant-numeric:tabular-nums; }
.stat span { color:var(--mute); font-size:12px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px;
  padding:14px 16px; margin-bottom:14px; }
.card h2 { font-size:15px; margin:0 0 10px; display:flex; align-items:center; gap:10px; }
.card h3 { font-size:12px; text-transform:uppercase; letter-spacing:.04em; color:var(--mute);
  margin:14px 0 6px; font-weight:600; }
.grid { display:grid; grid-template-columns:repeat(auto-fit,minmax(300px,1fr)); gap:14px; }
table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:4px 8px 4px 0; border-bottom:1px solid var(--line);
  white-space:nowrap; }
th { color:var(--mute); font-weight:500; font-size:12px; }
td.num, th.num { text-align:right; }
.badge { font-size:12px; padding:1px 8px; border-radius:999px; color:#fff; font-weight:500; }
.mode-metrics { background:var(--ok); } .mode-fallback { background:var(--warn); }
.mode-starting { background:var(--mute); } .mode-inflight_cap { background:var(--info); }
.blocked { color:var(--warn); font-size:13px; font-weight:400; }
.open { color:var(--ok); font-size:13px; font-weight:400; }
.meter { display:inline-block; width:70px; height:8px; background:var(--line);
  border-radius:4px; vertical-align:middle; margin-right:6px; overflow:hidden; }
.meter i { display:block; height:100%; background:var(--bar); }
.spark { display:flex; gap:14px; flex-wrap:wrap; }
.spark figure { margin:0; }
.spark figcaption { color:var(--mute); font-size:12px; }
.spark svg { display:block; background:var(--bg); border-radius:6px; }
.spark .line { fill:none; stroke:var(--bar); stroke-width:1.5; }
.spark .area { fill:var(--bar); opacity:.18; stroke:none; }
.scroll { overflow-x:auto; }
td.url { white-space:normal; word-break:break-all; max-width:220px; }
.muted { color:var(--mute); }
.err { color:var(--bad); }
#conn { color:var(--bad); font-size:12px; }
"""

_SCRIPT = r"""
"use strict";
const POLL_MS = 400, POLL_HIDDEN_MS = 5000, HISTORY_S = 120, STORE = "fair-sched-admin-key";
let key = null, timer = null, session = 0;
const samples = new Map();          // model -> [{t, queued, waiting, jain:<tier>, gap:<tier>}]
const $ = (id) => document.getElementById(id);

function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (name === "class") el.className = value;
    else if (name.startsWith("data-")) el.setAttribute(name, value);
    else el[name] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}
const DASH = "\u2013";
const num = (v, digits = 0) => (v === null || v === undefined ? DASH : Number(v).toFixed(digits));
const ms = (s) => (s === null || s === undefined ? DASH : (s * 1000).toFixed(0) + " ms");
const pct = (r) => (r === null || r === undefined ? DASH : (r * 100).toFixed(0) + " %");

const shortUrl = (url) => url.replace(/^https?:\/\//, "").replace(/\/metrics$/, "");

function meter(ratio) {
  const bar = h("i");
  bar.style.width = Math.max(0, Math.min(1, ratio || 0)) * 100 + "%";
  return h("span", { class: "meter" }, bar);
}

function sparkline(points, field, label, digits = 0) {
  const W = 260, H = 48, NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const now = Date.now() / 1000;
  const known = points.filter((p) => p[field] != null);  // a tier may come and go
  const values = known.map((p) => p[field]);
  const max = Math.max(1, ...values);
  // The x axis spans what this tab has seen (at least 10 s), up to HISTORY_S.
  const span = Math.max(10, Math.min(HISTORY_S, known.length ? now - known[0].t : 0));
  const xy = known.map((p) => [W - ((now - p.t) / span) * W, H - 2 - (p[field] / max) * (H - 6)]);
  if (xy.length === 1) xy.unshift([xy[0][0] - 3, xy[0][1]]);  // one sample: a short dash
  if (xy.length) {
    const area = document.createElementNS(NS, "polygon");
    area.setAttribute("class", "area");
    area.setAttribute("points", [[xy[0][0], H], ...xy, [xy[xy.length - 1][0], H]]
      .map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("class", "line");
    line.setAttribute("points", xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
    svg.append(area, line);
  }
  const caption = values.length
    ? `${label}: now ${num(values[values.length - 1], digits)}, ` +
      `max ${num(Math.max(...values), digits)} ` +
      `(last ${span.toFixed(0)} s)`
    : `${label}: no reading yet`;
  return h("figure", { "data-spark": field }, svg, h("figcaption", {}, caption));
}

function remember(model, doc) {
  const points = samples.get(model) || [];
  const t = Date.now() / 1000;
  const queued = Object.values(doc.queued || {}).reduce((a, b) => a + b, 0);
  const waiting = doc.gate && doc.gate.waiting !== undefined ? doc.gate.waiting : null;
  const point = { t, queued, waiting };
  // Per tier, the fairness gauges (their sparklines beside the tier's row).
  for (const [tier, f] of Object.entries(doc.fairness || {})) {
    point["jain:" + tier] = f.jain_index && f.jain_index.tokens !== undefined
      ? f.jain_index.tokens : null;
    point["gap:" + tier] = f.service_gap_tokens;
  }
  points.push(point);
  while (points.length && points[0].t < t - HISTORY_S) points.shift();
  samples.set(model, points);
  return points;
}

function principalsTable(doc) {
  const rows = new Map();  // tier|user -> row
  const row = (tier, user) => {
    const id = tier + "\u0000" + user;
    if (!rows.has(id)) rows.set(id, { tier, user, queued: 0, in_flight: 0, wait: null });
    return rows.get(id);
  };
  for (const b of doc.backlog || []) {
    const r = row(b.tier, b.user); r.queued = b.depth; r.wait = b.oldest_wait_s;
  }
  for (const f of doc.in_flight_by_user || []) row(f.tier, f.user).in_flight = f.in_flight;
  const list = [...rows.values()].sort((a, b) =>
    a.tier.localeCompare(b.tier) || b.queued - a.queued || b.in_flight - a.in_flight ||
    a.user.localeCompare(b.user));
  if (!list.length) return h("p", { class: "muted" }, "Nobody queued or running.");
  const most = Math.max(1, ...list.map((r) => r.queued));
  const more = (doc.backlog_truncated || 0) + (doc.in_flight_by_user_truncated || 0);
  return h("div", {},
    h("table", { class: "principals" },
      h("thead", {}, h("tr", {}, h("th", {}, "principal"), h("th", {}, "tier"),
        h("th", { class: "num" }, "queued"), h("th", {}, ""),
        h("th", { class: "num" }, "in flight"), h("th", { class: "num" }, "oldest wait"))),
      h("tbody", {}, list.map((r) => h("tr", { "data-user": r.user, "data-tier": r.tier },
        h("td", {}, r.user), h("td", {}, r.tier),
        h("td", { class: "num queued" }, r.queued), h("td", {}, meter(r.queued / most)),
        h("td", { class: "num in-flight" }, r.in_flight),
        h("td", { class: "num" }, r.wait === null ? DASH : num(r.wait, 1) + " s"))))),
    more ? h("p", { class: "muted" }, `... and ${more} more not listed`) : null);
}

function gateLine(gate) {
  const mode = gate.mode || "unknown";
  const parts = [h("span", { class: `badge mode-${mode}`, "data-gate-mode": mode }, mode)];
  if (gate.blocked_reason) {
    parts.push(h("span", { class: "blocked" }, "blocked: " + gate.blocked_reason));
  } else if (mode === "metrics") {
    parts.push(h("span", { class: "open" }, "open"));
  }
  if (mode === "inflight_cap") {
    parts.push(h("span", { class: "muted" }, `cap ${gate.max_inflight} in flight`));
  }
  return parts;
}

function allowedQueue(gate) {
  if ((gate.mode === "fallback" || gate.mode === "starting") && gate.fallback_max_inflight) {
    // Without a reading the metric thresholds decide nothing: the in-flight cap does.
    return h("p", { class: "muted allowed" }, (gate.mode === "starting"
      ? "no engine reading yet" : "engine metrics unavailable") +
      `: at most ${gate.fallback_max_inflight} in flight per deployment` +
      ` · in flight now: ${gate.in_flight}`);
  }
  const allowed = gate.waiting_threshold;
  if (!allowed) return null;
  const text = Object.entries(allowed).map(([tier, n]) => `${tier} < ${num(n, 0)}`).join(" · ");
  return h("p", { class: "muted allowed" }, "engine queue allowed per tier: " + text +
    (gate.pending !== undefined ? ` · released, not yet seen by the engine: ${gate.pending}` : ""));
}

function deploymentsTable(doc) {
  const deps = doc.deployments || [];
  if (!deps.length) return h("p", { class: "muted" }, "No engine metrics for this model.");
  const anyPrefix = deps.some(
    (d) => d.last_snapshot && d.last_snapshot.prefix_cache_hit_rate != null);
  return h("div", { class: "scroll" }, h("table", { class: "deployments" },
    h("thead", {}, h("tr", {}, h("th", {}, "deployment"), h("th", { class: "num" }, "waiting"),
      h("th", { class: "num" }, "running"), h("th", { class: "num" }, "TPOT"),
      h("th", {}, "KV cache"),
      anyPrefix ? h("th", { class: "num" }, "prefix hits") : null,
      h("th", { class: "num" }, "reading age"), h("th", {}, "scrapes"))),
    h("tbody", {}, deps.map((d) => {
      const s = d.last_snapshot || {};
      return h("tr", { "data-deployment": d.url },
        h("td", { class: "url", title: d.url }, shortUrl(d.url)),
        h("td", { class: "num waiting" }, num(s.waiting)),
        h("td", { class: "num running" }, num(s.running)),
        h("td", { class: "num tpot" }, ms(s.tpot_s)),
        h("td", { class: "kv" }, s.kv_usage == null ? DASH : [meter(s.kv_usage), pct(s.kv_usage)]),
        anyPrefix ? h("td", { class: "num" }, pct(s.prefix_cache_hit_rate)) : null,
        h("td", { class: "num age" }, d.reading_age_s == null
          ? (s.ok === false ? "none yet" : DASH) : num(d.reading_age_s, 1) + " s"),
        h("td", { class: s.ok === false ? "err" : "muted" },
          s.ok === false ? "failing: " + (s.error || "")
            : `${d.scrapes_total} (${d.failures_total} failed)`));
    }))));
}

function gateTable(gate) {
  const rows = gate.per_deployment || [];
  if (!rows.length) return null;
  // Each deployment has its own gate: its threshold holds for its own engine queue.
  return h("div", { class: "scroll" }, h("table", { class: "gates" },
    h("thead", {}, h("tr", {}, h("th", {}, "deployment"), h("th", {}, "gate"),
      h("th", { class: "num" }, "pending"), h("th", { class: "num" }, "free slots"),
      h("th", { class: "num" }, "in flight"), h("th", {}, "allowed queue (auto)"))),
    h("tbody", {}, rows.map((r) => h("tr", { "data-gate-deployment": r.deployment },
      h("td", { class: "url", title: r.deployment }, shortUrl(r.deployment)),
      h("td", {}, h("span", { class: `badge mode-${r.mode}` }, r.mode),
        r.blocked_reason ? h("span", { class: "blocked" }, " blocked: " + r.blocked_reason)
          : null),
      h("td", { class: "num pending" }, num(r.pending)),
      h("td", { class: "num free" }, num(r.free_slots)),
      h("td", { class: "num in-flight" }, num(r.in_flight)),
      h("td", { class: "muted" }, Object.entries(r.allowed_queue || {})
        .map(([tier, n]) => `${tier} < ${num(n, 1)}`).join(" · ") || DASH))))));
}

function reservationLine(reserved) {
  // Slots a tier keeps free: the principals' "in flight" column shows the slots each holds.
  if (!reserved.length) return null;
  return h("p", { class: "muted reserve" }, "running slots kept free for a principal holding " +
    "none: " + reserved.map((t) => `${t.name} ${t.reserve_slots}`).join(" · "));
}

function fairnessTable(doc, points) {
  const tiers = Object.entries(doc.fairness || {});
  if (!tiers.length) return null;
  // Jain's index per unit: tokens always, the fairness policy's own unit where it is another.
  const units = [...new Set(tiers.flatMap(([, f]) => Object.keys(f.jain_index || {})))].sort();
  return h("div", {},
    h("div", { class: "scroll" }, h("table", { class: "fairness" },
      h("thead", {}, h("tr", {}, h("th", {}, "tier"),
        h("th", { class: "num", title: "backlogged throughout the window" }, "users"),
        ...units.map((u) => h("th", { class: "num" }, `Jain (${u})`)),
        h("th", { class: "num" }, "gap (tokens)"),
        h("th", { class: "num", title: "the most starved user's wait for its next release" },
          "longest wait"))),
      h("tbody", {}, tiers.map(([tier, f]) => h("tr", { "data-fairness-tier": tier },
        h("td", {}, tier), h("td", { class: "num users" }, num(f.users)),
        ...units.map((u) => h("td", { class: "num jain", "data-unit": u },
          num((f.jain_index || {})[u], 2))),
        h("td", { class: "num gap" }, num(f.service_gap_tokens, 0)),
        h("td", { class: "num starved" }, num(f.starved_wait_s, 1) + " s")))))),
    tiers.map(([tier]) => h("div", { class: "spark", "data-fairness-spark": tier },
      sparkline(points, "jain:" + tier, tier + ": Jain (tokens)", 2),
      sparkline(points, "gap:" + tier, tier + ": gap (tokens)"))));
}

function modelCard(name, doc, reserved) {
  const points = remember(name, doc);
  const queuedByTier = Object.entries(doc.queued || {}).map(([t, n]) => `${t} ${n}`).join(" · ");
  return h("section", { class: "card model", "data-model": name },
    h("h2", {}, name, ...gateLine(doc.gate || {})),
    h("div", { class: "muted" }, `queued: ${queuedByTier || 0} · in flight: ${doc.in_flight} · ` +
      `backlogged principals: ${doc.backlogged_users}`),
    allowedQueue(doc.gate || {}),
    reservationLine(reserved),
    h("div", { class: "grid" },
      h("div", {}, h("h3", {}, "Queued and in flight per principal"), principalsTable(doc),
        doc.fairness && Object.keys(doc.fairness).length
          ? h("h3", {}, "Fairness over the last window") : null,
        fairnessTable(doc, points)),
      h("div", {}, h("h3", {}, "Engine"), deploymentsTable(doc), gateTable(doc.gate || {}),
        h("h3", {}, "History"),
        h("div", { class: "spark" }, sparkline(points, "queued", "queue depth"),
          sparkline(points, "waiting", "engine waiting")))));
}

function rejectionsCard(status) {
  const byReason = status.totals.rejected || {};
  const recent = status.recent_rejections || [];
  return h("section", { class: "card", id: "rejections" },
    h("h2", {}, "Rejections"),
    h("div", { class: "totals" }, Object.entries(byReason).map(([reason, n]) =>
      h("div", { class: "stat", "data-reason": reason }, h("b", {}, n), h("span", {}, reason)))),
    recent.length ? h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "when"), h("th", {}, "principal"),
        h("th", {}, "model"), h("th", {}, "tier"), h("th", {}, "reason"))),
      h("tbody", {}, recent.map((r) => h("tr", {}, h("td", {}, num(r.age_s, 1) + " s ago"),
        h("td", {}, r.user), h("td", {}, r.model), h("td", {}, r.tier), h("td", {}, r.reason)))))
      : h("p", { class: "muted" }, "No rejection since the plugin started."));
}

function tiersCard(status) {
  const tiers = status.tiers || [];
  if (!tiers.some((t) => t.share != null || t.promote_after_s != null)) return null;
  return h("section", { class: "card", id: "tiers" },
    h("h2", {}, "Tier shares"),
    h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "tier"), h("th", { class: "num" }, "share"),
        h("th", { class: "num" }, "released"), h("th", { class: "num" }, "delivered"),
        h("th", { class: "num" }, "promoted after"))),
      h("tbody", {}, tiers.map((t) => h("tr", { "data-tier": t.name },
        h("td", {}, t.name), h("td", { class: "num" }, t.share == null ? "strict" : pct(t.share)),
        h("td", { class: "num" }, t.released),
        h("td", { class: "num delivered" }, pct(t.delivered_share)),
        h("td", { class: "num" },
          t.promote_after_s == null ? DASH : num(t.promote_after_s, 0) + " s"))))));
}

function deadlinesCard(status) {
  const tiers = (status.tiers || []).filter((t) => t.deadlines &&
    (t.max_wait_s != null || t.deadlines.met + t.deadlines.missed + t.deadlines.refused > 0));
  if (!tiers.length) return null;
  return h("section", { class: "card", id: "deadlines" },
    h("h2", {}, "Deadlines"),
    h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "tier"), h("th", { class: "num" }, "max wait"),
        h("th", { class: "num" }, "met"), h("th", { class: "num" }, "missed"),
        h("th", { class: "num" }, "refused at once"))),
      h("tbody", {}, tiers.map((t) => h("tr", { "data-tier": t.name },
        h("td", {}, t.name),
        h("td", { class: "num" }, t.max_wait_s == null ? DASH : num(t.max_wait_s, 1) + " s"),
        h("td", { class: "num met" }, t.deadlines.met),
        h("td", { class: "num missed" }, t.deadlines.missed),
        h("td", { class: "num refused" }, t.deadlines.refused))))));
}

function budgetsCard(status) {
  const budgets = status.budgets || [];
  if (!budgets.length) return null;
  const amount = (b, v) => (b.unit === "usd" ? "$" + num(v, 4) : num(v, 0));
  return h("section", { class: "card", id: "budgets" },
    h("h2", {}, "Budgets"),
    h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "principal"), h("th", { class: "num" }, "spent"),
        h("th", {}, ""), h("th", { class: "num" }, "remaining"),
        h("th", { class: "num" }, "window ends in"), h("th", {}, "over budget"))),
      h("tbody", {}, budgets.map((b) => h("tr", { "data-user": b.user },
        h("td", {}, b.user),
        h("td", { class: "num spent" }, amount(b, b.spent) + " of " + amount(b, b.limit)),
        h("td", {}, meter(b.limit > 0 ? Math.min(1, b.spent / b.limit) : 1)),
        h("td", { class: "num remaining" }, amount(b, b.remaining)),
        h("td", { class: "num" }, num(b.resets_in_s, 0) + " s"),
        h("td", { class: b.over ? "err over" : "muted over" }, b.over
          ? (b.action === "demote" ? "demoted to " + b.demote_to : "rejected") : "no"))))));
}

function render(status) {
  const t = status.totals;
  const stats = [["queued", t.queued], ["in flight", t.in_flight], ["released", t.released],
    ["completed", t.completed], ["cancelled", t.cancelled],
    ["rejected", Object.values(t.rejected || {}).reduce((a, b) => a + b, 0)]];
  const totals = h("div", { class: "totals", id: "totals" }, stats.map(([label, value]) =>
    h("div", { class: "stat", "data-total": label }, h("b", {}, value), h("span", {}, label))));
  const reserved = (status.tiers || []).filter((t) => t.reserve_slots > 0);
  const models = Object.entries(status.models || {}).map(
    ([name, doc]) => modelCard(name, doc, reserved));
  const cards = [totals, tiersCard(status), deadlinesCard(status), ...models,
    budgetsCard(status), rejectionsCard(status)];
  $("dashboard").replaceChildren(...cards.filter((card) => card !== null));
}

function showLogin(message) {
  key = null;
  session += 1;
  sessionStorage.removeItem(STORE);
  clearTimeout(timer);
  $("dashboard").replaceChildren();
  $("app").classList.add("hidden");
  $("login").classList.remove("hidden");
  $("login-error").textContent = message || "";
  $("key").value = "";
  $("key").focus();
}

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(poll, ms);
}

async function poll() {
  // One timer, so one loop; an answer for an earlier key (or after "forget") is dropped.
  const mine = session;
  if (!key) return;
  let response;
  try {
    response = await fetch("status", { headers: { Authorization: "Bearer " + key },
      cache: "no-store", credentials: "omit", redirect: "error" });
  } catch (error) {
    if (mine !== session) return;
    $("conn").textContent = "connection lost, retrying";
    schedule(POLL_MS * 3);
    return;
  }
  if (mine !== session) return;
  if (response.status === 401) { showLogin("That key was not accepted."); return; }
  if (!response.ok) {
    let message = `The status endpoint answered ${response.status}.`;
    try { message = (await response.json()).error.message || message; } catch (e) { /* keep */ }
    if (mine === session) showLogin(message);
    return;
  }
  let status;
  try {
    status = await response.json();
  } catch (error) {
    status = null;
  }
  if (mine !== session || !key) return;
  $("login").classList.add("hidden");
  $("app").classList.remove("hidden");
  try {
    render(status);
    $("conn").textContent = "";
    $("live").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    // Keep the last good view and keep asking: a proxy restart or a partial answer passes.
    $("conn").textContent = "could not read the status, retrying";
  }
  // A hidden tab asks less often; it catches up as soon as it is shown again.
  schedule(document.hidden ? POLL_HIDDEN_MS : POLL_MS);
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden && key) schedule(0);
});

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const typed = $("key").value.trim();
  $("key").value = "";
  if (!typed) { $("login-error").textContent = "Type the admin key."; return; }
  key = typed;
  session += 1;
  sessionStorage.setItem(STORE, key);
  samples.clear();
  $("login-error").textContent = "";
  poll();
});
$("forget").addEventListener("click", () => showLogin(""));
key = sessionStorage.getItem(STORE);
if (key) poll(); else showLogin("");
"""

_BODY = """
<form id="login" class="hidden" autocomplete="off">
  <h2>fair-sched</h2>
  <p>Type the admin key: {key_hint}. It stays in this tab only.</p>
  <input id="key" type="password" placeholder="admin key" autocomplete="off" aria-label="admin key">
  <div id="login-error" role="alert"></div>
  <button class="primary" type="submit">Show the queues</button>
</form>
<div id="app" class="hidden">
  <header><h1>fair-sched: queues and engines</h1><span id="conn"></span>
    <span id="live" class="live"></span><button id="forget" type="button">Forget key</button>
  </header>
  <main id="dashboard"></main>
</div>
"""


def _csp_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


# Which key the prompt asks for, per integration.
LITELLM_KEY_HINT = "the LiteLLM proxy's master key (general_settings.master_key)"
SETTINGS_KEY_HINT = "observability.admin_key of the fair_sched settings"
ARGUMENT_KEY_HINT = "the admin_key this app gave FairSchedulerMiddleware"


@functools.lru_cache(maxsize=8)
def page(key_hint: str = SETTINGS_KEY_HINT) -> bytes:
    """The page's bytes; only the prompt's text differs between integrations."""
    body = _BODY.replace("{key_hint}", html.escape(key_hint))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>fair-sched</title><style>{_STYLE}</style></head>"
        f"<body>{body}<script>{_SCRIPT}</script></body></html>\n"
    ).encode()


_CSP = "; ".join(
    (
        "default-src 'none'",
        f"script-src {_csp_hash(_SCRIPT)}",
        f"style-src {_csp_hash(_STYLE)}",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "content-security-policy": _CSP,
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
}


def ui_response(key_hint: str = SETTINGS_KEY_HINT) -> Response:
    """The page (identical for everyone; it holds no data); `key_hint` names the key to type."""
    return Response(page(key_hint), media_type="text/html; charset=utf-8", headers=HEADERS)
