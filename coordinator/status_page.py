"""The coordinator's live status page: ``/`` (also ``/status``) and its data, ``/status.json``.

One self-contained HTML document: no build step, no external script, style
sheet, font or image, so it works on a cluster with no way out. A small
inline script fetches ``/status.json`` (``coordinator/observe.py``) every
``REFRESH_MS`` and redraws the fleet table, the frontier and the recent
batches' reward, response length, dropped ratio and trainer wait as inline
SVG sparklines. Everything the page shows comes from that JSON; the page
itself holds no state beyond the last answer.

Element ids the page fills (tests and scrapers can rely on them): ``#summary``,
``#fleet`` (one ``tr.agent`` per agent, ``data-agent`` its id), ``#gateways`` (one ``div.gateway`` per
gateway of ``--gateways``, ``data-gateway`` its number), ``#frontier``,
``#batch-count``, ``#plots`` (one ``svg.spark`` per series, ``data-series``
its name, one ``polyline`` each once there are batches), ``#drops``,
``#updated``, ``#error``.
"""

from __future__ import annotations

import json

from aiohttp import web

from coordinator.observe import Observed, status_snapshot

REFRESH_MS = 2000

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rollfleet coordinator</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fafafa; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 14px; margin: 18px 0 6px; }
table { border-collapse: collapse; background: #fff; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.healthy, .alive { color: #17702a; } .down, .dead, .retired, .stale { color: #b3261e; }
.starting { color: #8a6d00; } #error { color: #b3261e; } #summary span { margin-right: 18px; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plot { background: #fff; border: 1px solid #ddd; padding: 6px 8px; }
.plot .label { font-weight: 600; } .plot .last { float: right; margin-left: 12px; }
svg.spark { display: block; margin-top: 4px; } svg.spark polyline { fill: none; stroke: #1f5fbf; stroke-width: 1.5; }
</style></head>
<body>
<h1>rollfleet coordinator</h1>
<div id="summary">loading...</div><div id="error"></div>
<h2>Fleet</h2>
<table><thead><tr><th>agent</th><th>status</th><th>capacity</th><th>leases</th><th>engines</th></tr></thead>
<tbody id="fleet"></tbody></table>
<div id="gateways"></div>
<h2>Prompt frontier</h2><div id="frontier"></div>
<h2>Batches: <span id="batch-count">0</span></h2>
<div id="plots" class="plots"></div>
<h2>Drops by reason</h2><div id="drops"></div>
<p>updated <span id="updated">never</span>, every __REFRESH__ ms from <a href="status.json">status.json</a>;
<a href="metrics">metrics</a></p>
<script>
"use strict";
const SERIES = [
  ["reward_mean", "reward"], ["response_len_mean", "response length"],
  ["dropped_ratio", "dropped ratio"], ["wait_s", "trainer wait (s)"]];
const W = 260, H = 60;
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
}
function fmt(x) {
  if (x === null || x === undefined) return "-";
  return Math.abs(x) >= 100 ? x.toFixed(0) : Math.abs(x) >= 1 ? x.toFixed(2) : x.toFixed(3);
}
function spark(name, values) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark"); svg.setAttribute("data-series", name);
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const vs = values.filter(v => typeof v === "number");
  if (vs.length) {
    // A constant series is drawn across the middle, not along the floor.
    const lo = Math.min(...vs) - (Math.max(...vs) === Math.min(...vs) ? 1 : 0);
    const hi = Math.max(...vs) + (Math.max(...vs) === Math.min(...vs) ? 1 : 0), span = hi - lo;
    const step = vs.length > 1 ? W / (vs.length - 1) : 0;
    const pts = vs.map((v, i) => `${(i * step).toFixed(1)},${(H - 3 - (v - lo) / span * (H - 6)).toFixed(1)}`);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", vs.length > 1 ? pts.join(" ") : `0,${H / 2} ${W},${H / 2}`);
    svg.appendChild(line);
  }
  return svg;
}
function render(s) {
  const alive = s.fleet.filter(a => a.status === "alive").length;
  const summary = document.getElementById("summary");
  summary.replaceChildren(
    el("span", {}, `agents alive ${alive}/${s.fleet.length}`),
    el("span", {}, `weights v${s.weights.version} (${s.weights.updates} updates)`),
    el("span", {}, `receipts ${s.receipts.accepted}`),
    el("span", {}, s.paused ? "PAUSED" : "running"),
    el("span", {}, s.starved ? `STARVED: ${s.starved}` : ""),
    el("span", {}, s.waiting_for_update ? `WAITING: ${s.waiting_for_update}` : ""));
  const rows = s.fleet.map(a => {
    const tr = el("tr", {class: "agent", "data-agent": a.agent});
    tr.append(el("td", {}, a.agent), el("td", {class: a.status}, a.status),
      el("td", {class: "num"}, a.capacity), el("td", {class: "num"}, a.leases));
    const td = el("td");
    for (const e of a.engines) {
      td.append(el("div", {class: "engine " + e.state},
        `${e.name}: ${e.state}, in flight ${e.in_flight ?? "-"}, version ${e.version ?? "-"}`));
    }
    tr.append(td);
    return tr;
  });
  document.getElementById("fleet").replaceChildren(...rows);
  document.getElementById("gateways").replaceChildren(...(s.gateways || []).map(g =>
    el("div", {class: "gateway " + (g.up ? "alive" : "dead"), "data-gateway": g.gateway},
      `gateway ${g.gateway}: ${g.up ? "up" : "DOWN"}, pid ${g.pid ?? "-"}, ${g.peers ?? "-"} peers, ` +
      `messages in ${g.messages_in ?? "-"} / out ${g.messages_out ?? "-"}, restarts ${g.restarts}`)));
  const f = s.frontier;
  const named = Object.keys(f.datasets || {}).length > 1 || !(f.datasets || {}).default;
  const ep = f.epochs.map(e => `${named ? "dataset " + e.dataset + ", " : ""}epoch ${e.epoch}: ` +
    `position ${e.position} / ${e.size}, finished ${e.finished}`);
  const mix = named ? Object.entries(f.datasets).map(([n, d]) => el("div", {class: "dataset"},
    `dataset ${n}: weight ${d.weight}, filtered ${d.filtered}, ` +
    Object.entries(d.prompts).map(([k, v]) => `${k} ${v}`).join(", "))) : [];
  document.getElementById("frontier").replaceChildren(
    ...ep.map(t => el("div", {class: "epoch"}, t)), ...mix,
    el("div", {}, `leases outstanding ${f.leases_in_flight}, groups ready ${f.groups_ready}, ` +
      Object.entries(f.prompts).map(([k, v]) => `${k} ${v}`).join(", ")));
  const b = s.batches;
  document.getElementById("batch-count").textContent = String(b.assembled);
  const plots = SERIES.map(([key, label]) => {
    const values = b.recent.map(r => r[key]);
    const div = el("div", {class: "plot"});
    div.append(el("span", {class: "label"}, label), el("span", {class: "last"}, fmt(values[values.length - 1])),
      spark(key, values));
    return div;
  });
  document.getElementById("plots").replaceChildren(...plots);
  const drops = Object.entries(s.drops);
  document.getElementById("drops").textContent =
    drops.length ? drops.map(([k, v]) => `${k} ${v}`).join(", ") : "none";
  document.getElementById("updated").textContent = new Date().toLocaleTimeString();
}
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error(`status.json: HTTP ${r.status}`);
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = `cannot refresh: ${e.message}`;
  }
}
refresh();
setInterval(refresh, __REFRESH__);
</script>
</body></html>
""".replace("__REFRESH__", str(REFRESH_MS))


def routes(server: Observed) -> dict:
    """GET handlers for the observation endpoint: the page and its JSON."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def data(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(status_snapshot(server)), content_type="application/json")

    return {"/": page, "/status": page, "/status.json": data}
