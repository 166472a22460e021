// The dashboard page: reads GET /v1/activity/stream (server-sent events through fetch, so the API key travels in a
// header, never in the URL) and GET /v1/usage, and draws them. The logic it relies on is in logic.js.
import {
  authHeaders, bucketRates, cacheTiers, formatBytes, formatDuration, formatNumber, formatShare, linePath,
  mergeHistory, mergeRecent, niceMax, parseSSE, usagePivot,
} from "./logic.js";

const KEY_ITEM = "tandem.apiKey";
const SVG = "http://www.w3.org/2000/svg";
const state = { history: [], recent: [], last: null };
const $ = (id) => document.getElementById(id);

function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

class NeedsKey extends Error {}

async function get(path) {
  const response = await fetch(path, { headers: authHeaders(apiKey()), cache: "no-store" });
  if (response.status === 401) throw new NeedsKey("a key is needed");
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
  setStatus("needs a key", "warn");
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = `pill ${kind || ""}`;
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
}

function svgPath(svg, d, cls) {
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("d", d);
  path.setAttribute("class", cls);
  svg.appendChild(path);
}

function drawRates() {
  const svg = $("rate-chart");
  svg.replaceChildren();
  const now = Math.floor(Date.now() / 1000);
  const buckets = bucketRates(state.history.filter((h) => h[0] > now - 600), 5);
  const byStart = new Map(buckets.map((b) => [b[0], b[1]]));
  const values = [];
  for (let t = Math.floor((now - 600) / 5) * 5; t <= now; t += 5) values.push(byStart.get(t) || 0);
  const top = niceMax(Math.max(...values));
  svgPath(svg, linePath(values, 600, 120, top), "line tokens");
  $("rate-max").textContent = `max ${formatNumber(top, 0)} tok/s`;
}

function drawRequests() {
  const svg = $("request-chart");
  svg.replaceChildren();
  const speeds = state.recent.map((r) => r.tokens_per_s);
  const ttfts = state.recent.map((r) => (r.ttft_s === null ? null : r.ttft_s * 1000));
  const top = niceMax(Math.max(0, ...speeds.filter((v) => v !== null), ...ttfts.filter((v) => v !== null)));
  svgPath(svg, linePath(speeds, 300, 120, top), "line speed");
  svgPath(svg, linePath(ttfts, 300, 120, top), "line ttft");
  $("request-max").textContent = `max ${formatNumber(top, 0)}`;
  $("request-count").textContent = `${state.recent.length} requests`;
  const rounds = state.recent.map((r) => r.tokens_per_round);
  const roundTop = niceMax(Math.max(1, ...rounds.filter((v) => v !== null)));
  const roundSvg = $("round-chart");
  roundSvg.replaceChildren();
  svgPath(roundSvg, linePath(rounds, 300, 120, roundTop), "line rounds");
  $("round-max").textContent = `max ${formatNumber(roundTop, 1)} tokens`;
  const accepted = state.recent.map((r) => r.acceptance).filter((v) => v !== null);
  $("acceptance").textContent = accepted.length
    ? `drafts accepted ${formatShare(accepted.reduce((a, b) => a + b, 0) / accepted.length)}` : "no drafts";
}

function drawLive(body) {
  const tbody = $("live").querySelector("tbody");
  tbody.replaceChildren();
  for (const r of body.requests) {
    const row = document.createElement("tr");
    row.dataset.phase = r.phase;
    for (const text of [r.id, r.route, r.client || "–", r.phase, r.slot ?? "–", r.prompt_tokens, r.cached_tokens,
      r.generated_tokens, formatDuration(r.wait_s), formatDuration(r.ttft_s), formatNumber(r.tokens_per_s),
      formatNumber(r.tokens_per_round, 2), formatShare(r.acceptance)]) cell(row, String(text));
    tbody.appendChild(row);
  }
  $("live-empty").hidden = body.requests.length > 0;
}

function drawEngine(body) {
  $("model").textContent = `${body.model} · spec ${body.spec}`;
  $("uptime").textContent = `up ${formatDuration(body.uptime_s)}`;
  $("running").textContent = `${body.running} / ${body.slots}`;
  $("waiting").textContent = body.waiting;
  $("tokens-rate").textContent = formatNumber(body.rates.tokens_per_s);
  $("rounds-rate").textContent = formatNumber(body.rates.rounds_per_s);
  $("requests-done").textContent = formatNumber(body.totals.requests, 0);
  $("tokens-total").textContent = formatNumber(body.totals.generated_tokens, 0);
  const cache = body.cache;
  $("cache-hits").textContent = cache.enabled ? formatShare(cache.hit_rate) : "off";
  $("cache-reused").textContent = cache.enabled ? formatShare(cache.reused_share) : "–";
  const tiers = $("tiers");
  tiers.replaceChildren();
  for (const tier of cacheTiers(cache)) {
    const line = document.createElement("div");
    line.className = "tier";
    line.textContent = `${tier.name}: ${formatBytes(tier.bytes)} of ${formatBytes(tier.budget)} · ${tier.entries} blocks`;
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = `${Math.round((tier.share || 0) * 100)}%`;
    bar.appendChild(fill);
    tiers.append(line, bar);
  }
  const mem = body.memory;
  $("host-memory").textContent = formatBytes(mem.host_rss_bytes);
  const dev = mem.device;
  $("device-memory").textContent = dev ? `${formatBytes(dev.used_bytes)} of ${formatBytes(dev.total_bytes)}` : "none";
  $("device-bar").style.width = dev ? `${Math.round((dev.used_bytes / dev.total_bytes) * 100)}%` : "0%";
  $("joint").textContent = body.joint
    ? `${formatNumber(body.joint.passes, 0)} (${formatNumber(body.joint.items / Math.max(1, body.joint.passes), 2)} slots a pass)`
    : "–";
}

function onActivity(body) {
  if (!body.enabled) {
    setStatus("activity off", "warn");
    return;
  }
  state.history = mergeHistory(state.history, body.history);
  state.recent = mergeRecent(state.recent, body.recent);
  if (state.last && body.recent.length) loadUsage(); // requests ended: their ledger rows are in
  state.last = body;
  drawEngine(body);
  drawLive(body);
  drawRates();
  drawRequests();
  setStatus(body.draining ? "draining" : "live", body.draining ? "warn" : "ok");
}

async function follow() {
  for (;;) {
    try {
      const response = await get("/v1/activity/stream?interval=1");
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const parsed = parseSSE(buffer + decoder.decode(value, { stream: true }));
        buffer = parsed.rest;
        for (const ev of parsed.events) if (ev.event === "activity") onActivity(JSON.parse(ev.data));
      }
      setStatus("reconnecting…", "warn");
    } catch (err) {
      if (err instanceof NeedsKey) {
        askForKey(apiKey() ? "That key was refused." : "");
        return;
      }
      setStatus("disconnected", "bad");
    }
    await new Promise((done) => setTimeout(done, 2000));
  }
}

async function loadUsage() {
  try {
    const response = await get("/v1/usage?group=day,client&since=7d");
    drawUsage((await response.json()).data);
  } catch (err) {
    if (err instanceof NeedsKey) return;
    $("usage-note").textContent = String(err.message).includes("404")
      ? "This server keeps no ledger (tandem serve --ledger PATH)." : `Usage unavailable: ${err.message}`;
  }
}

function drawUsage(rows) {
  const { days, clients, cells } = usagePivot(rows);
  const head = $("usage").querySelector("thead");
  const body = $("usage").querySelector("tbody");
  head.replaceChildren();
  body.replaceChildren();
  const top = document.createElement("tr");
  for (const text of ["day", ...clients]) {
    const th = document.createElement("th");
    th.textContent = text;
    top.appendChild(th);
  }
  head.appendChild(top);
  for (const day of days) {
    const row = document.createElement("tr");
    cell(row, day);
    for (const client of clients) {
      const c = cells[day][client];
      cell(row, c ? `${c.requests} req · ${formatNumber(c.prompt, 0)} in (${formatNumber(c.cached, 0)} cached) · `
        + `${formatNumber(c.generated, 0)} out` : "");
    }
    body.appendChild(row);
  }
  $("usage-note").textContent = days.length ? "" : "No request in the last 7 days.";
}

async function downloadCsv(event) {
  event.preventDefault();
  try {
    const response = await get("/v1/usage?group=day,client&format=csv");
    const url = URL.createObjectURL(await response.blob());
    const a = document.createElement("a");
    a.href = url;
    a.download = "usage.csv";
    a.click();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  } catch (err) {
    $("usage-note").textContent = `CSV unavailable: ${err.message}`;
  }
}

function start() {
  $("key-form").hidden = true;
  follow();
  loadUsage();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("key-input").value);
  $("key-input").value = "";
  start();
});
$("usage-csv").addEventListener("click", downloadCsv);
setInterval(loadUsage, 30000);
setInterval(() => { if (state.last) drawRates(); }, 5000);
start();
