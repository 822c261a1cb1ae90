// The kvdepot dashboard: polls GET /v1/status, keeps a few minutes of samples in the
// page, and draws them on canvases. No library, no build step: it must work offline.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(200, Number(params.get("interval_ms")) || 1000);
const WINDOW_MS = 5 * 60 * 1000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];
const samples = [];  // {t, status}
let bearer = sessionStorage.getItem("kvdepot-bearer") || "";

// `/#bearer=...` hands the page a bearer (also pasted into an open tab); it leaves the
// address bar at once.
function bearerFromAddress() {
  if (location.hash.startsWith("#bearer=")) {
    bearer = decodeURIComponent(location.hash.slice(8));
    sessionStorage.setItem("kvdepot-bearer", bearer);
    history.replaceState(null, "", location.pathname + location.search);
    document.getElementById("login").hidden = true;
  }
}
window.addEventListener("hashchange", bearerFromAddress);

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}

function setFigure(id, value, text) {
  const el = document.getElementById(id);
  el.dataset.value = String(value);
  el.textContent = text;
}

function hitRate(counters) {
  const asked = counters.lookup_requested_tokens;
  return asked ? counters.hit_tokens / asked : null;
}

// ---- charts -----------------------------------------------------------------------------
// series: [{name, points: [[t, y], ...]}]; draws lines against time, y from 0.
function drawChart(canvas, series, format) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  const left = 70, right = 10, top = 8, bottom = 20;
  const now = Date.now(), t0 = now - WINDOW_MS;
  let ymax = 0;
  for (const s of series) for (const [, y] of s.points) ymax = Math.max(ymax, y);
  ymax = ymax > 0 ? ymax * 1.1 : 1;
  const x = t => left + (t - t0) / WINDOW_MS * (width - left - right);
  const y = v => top + (1 - v / ymax) * (height - top - bottom);
  g.strokeStyle = "#ddd"; g.fillStyle = "#666"; g.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4;
    g.beginPath(); g.moveTo(left, y(v)); g.lineTo(width - right, y(v)); g.stroke();
    g.fillText(format(v), 2, y(v) + 4);
  }
  for (let m = 0; m <= WINDOW_MS / 60000; m++) {
    g.fillText(m ? `-${m} min` : "now", x(now - m * 60000) - 16, height - 5);
  }
  series.forEach((s, i) => {
    g.strokeStyle = COLORS[i % COLORS.length]; g.lineWidth = 1.5;
    g.beginPath();
    s.points.forEach(([t, v], j) => (j ? g.lineTo : g.moveTo).call(g, x(t), y(v)));
    g.stroke();
    g.fillStyle = g.strokeStyle;
    g.fillText(s.name, left + 8 + i * 110, top + 10);
  });
  canvas.dataset.samples = String(Math.max(0, ...series.map(s => s.points.length)));
}

// Per-second rates of a counter between consecutive samples.
function rates(name) {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1], b = samples[i];
    const dt = (b.t - a.t) / 1000;
    if (dt > 0 && b.status.boot_id === a.status.boot_id) {
      out.push([b.t, Math.max(0, b.status.counters[name] - a.status.counters[name]) / dt]);
    }
  }
  return out;
}

function intervalHitRate() {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1].status.counters, b = samples[i].status.counters;
    const asked = b.lookup_requested_tokens - a.lookup_requested_tokens;
    if (asked > 0) out.push([samples[i].t, 100 * (b.hit_tokens - a.hit_tokens) / asked]);
  }
  return out;
}

function levels(pick) {  // pick(status) -> {name: value}: one series per name
  const byName = new Map();
  for (const { t, status } of samples) {
    for (const [name, v] of Object.entries(pick(status))) {
      if (!byName.has(name)) byName.set(name, []);
      byName.get(name).push([t, v]);
    }
  }
  return [...byName].map(([name, points]) => ({ name, points }));
}

// ---- tables -----------------------------------------------------------------------------
function fillTable(id, header, rows) {
  const table = document.getElementById(id);
  table.replaceChildren();
  const head = table.insertRow();
  for (const h of header) {
    const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
  }
  for (const row of rows) {
    const tr = table.insertRow();
    for (const cell of row) {
      const td = tr.insertCell();
      const [text, value] = Array.isArray(cell) ? cell : [cell, cell];
      td.textContent = text;
      td.dataset.value = String(value);
    }
  }
}

function render(status) {
  document.getElementById("server").textContent =
    `${status.url} · version ${status.version} · up ${Math.round(status.uptime_seconds)} s`;
  const state = document.getElementById("state");
  state.textContent = status.draining ? "draining" : "ready";
  state.className = "state " + (status.draining ? "draining" : "ready");
  const c = status.counters, cpu = status.tiers[0];
  const rate = hitRate(c);
  setFigure("hit-rate", rate === null ? "" : rate.toFixed(6),
            rate === null ? "–" : (100 * rate).toFixed(1) + " %");
  setFigure("lookups", c.lookups, c.lookups.toLocaleString("en-US"));
  setFigure("chunks", cpu.chunks, cpu.chunks.toLocaleString("en-US"));
  setFigure("cpu-used", cpu.used_bytes, `${bytes(cpu.used_bytes)} of ${bytes(cpu.capacity_bytes)}`);
  setFigure("engine-count", status.engines.length, String(status.engines.length));
  setFigure("sessions", status.sessions.lookup_jobs, String(status.sessions.lookup_jobs));

  const chart = (id, series, format) => drawChart(document.getElementById(id), series, format);
  const perSecond = v => v.toFixed(v < 10 ? 1 : 0) + "/s";
  chart("chart-lookups", [{ name: "lookups", points: rates("lookups") }], perSecond);
  chart("chart-hit-rate", [{ name: "hit %", points: intervalHitRate() }], v => v.toFixed(0) + " %");
  chart("chart-cpu-io", [{ name: "in", points: rates("stored_bytes") },
                         { name: "out", points: rates("retrieved_bytes") }], v => bytes(v) + "/s");
  chart("chart-lower-io", [{ name: "written", points: rates("lower_tier_writes") },
                           { name: "read up", points: rates("promoted_chunks") }], perSecond);
  chart("chart-tiers", levels(s => Object.fromEntries(
    s.tiers.filter(t => "used_bytes" in t).map(t => [t.name, t.used_bytes]))), bytes);
  chart("chart-tenants", levels(s => Object.fromEntries(
    Object.entries(s.tenants).map(([name, t]) => [name || "-", t.cpu_bytes]))), bytes);

  fillTable("tiers", ["tier", "used", "capacity", "chunks"], status.tiers.map(t => [
    t.name, [t.used_bytes === undefined ? "" : bytes(t.used_bytes), t.used_bytes ?? ""],
    [t.capacity_bytes === undefined ? "" : bytes(t.capacity_bytes), t.capacity_bytes ?? ""],
    t.chunks ?? ""]));
  fillTable("tenants", ["tenant", "CPU memory", "chunks", "quota"],
    Object.entries(status.tenants).map(([name, t]) => [
      name || "-", [bytes(t.cpu_bytes), t.cpu_bytes], t.chunks,
      t.quota_cpu_bytes === null ? ["none", ""] : [bytes(t.quota_cpu_bytes), t.quota_cpu_bytes]]));
  fillTable("engines", ["engine", "model", "rank", "tenant", "memory", "layers", "block size",
                        "blocks", "chunk"], status.engines.map(e => [
    "#" + e.engine, e.model, `${e.rank}/${e.world_size}`, e.tenant || "-", e.memory,
    e.layout.layers, e.layout.block_size, e.layout.num_blocks, [bytes(e.chunk_bytes), e.chunk_bytes]]));
}

// ---- polling ------------------------------------------------------------------------------
async function poll() {
  try {
    const headers = bearer ? { Authorization: "Bearer " + bearer } : {};
    const response = await fetch("/v1/status", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      document.getElementById("login").hidden = false;
      document.getElementById("state").textContent = "needs a bearer token";
      return;
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const status = await response.json();
    const t = Date.now();
    samples.push({ t, status });
    while (samples.length && samples[0].t < t - WINDOW_MS) samples.shift();
    render(status);
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (error) {
    const state = document.getElementById("state");
    state.textContent = "unreachable: " + error.message;
    state.className = "state down";
  } finally {
    setTimeout(poll, INTERVAL_MS);
  }
}

document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  bearer = document.getElementById("bearer").value.trim();
  sessionStorage.setItem("kvdepot-bearer", bearer);
  document.getElementById("login").hidden = true;
});
bearerFromAddress();
document.getElementById("interval").textContent = String(INTERVAL_MS / 1000);
document.getElementById("window").textContent = String(WINDOW_MS / 60000);
poll();
