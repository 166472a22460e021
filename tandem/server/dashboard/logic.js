// The dashboard's pure functions: parsing the event stream, keeping the history, formatting, chart geometry and the
// usage pivot. No DOM here, so node's test runner checks them (tests/js/dashboard.test.mjs).

/** Split server-sent-event text into whole events; `rest` is the unfinished tail to prepend to the next read.
 *  Returns {events: [{event, data}], rest}. Comment lines (":") are skipped; multi-line data is joined by "\n". */
export function parseSSE(text) {
  const events = [];
  const normal = text.replace(/\r\n?/g, "\n");
  const blocks = normal.split("\n\n");
  const rest = blocks.pop();
  for (const block of blocks) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line === "" || line.startsWith(":")) continue;
      const at = line.indexOf(":");
      const field = at < 0 ? line : line.slice(0, at);
      let value = at < 0 ? "" : line.slice(at + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
    if (data.length) events.push({ event, data: data.join("\n") });
  }
  return { events, rest };
}

/** The history [[unixSecond, tokens, rounds], ...] with `fresh` seconds merged in (a second already held is
 *  replaced), in time order, the last `maxLength` kept. */
export function mergeHistory(history, fresh, maxLength = 600) {
  const bySecond = new Map(history.map((row) => [row[0], row]));
  for (const row of fresh) bySecond.set(row[0], row);
  const merged = [...bySecond.values()].sort((a, b) => a[0] - b[0]);
  return merged.slice(Math.max(0, merged.length - maxLength));
}

/** Per-bucket sums of a per-second history over buckets of `step` seconds, aligned on multiples of `step`:
 *  [[bucketStart, tokensPerSecond, roundsPerSecond], ...]. */
export function bucketRates(history, step) {
  const out = new Map();
  for (const [t, tokens, rounds] of history) {
    const start = Math.floor(t / step) * step;
    const acc = out.get(start) || [start, 0, 0];
    acc[1] += tokens / step;
    acc[2] += rounds / step;
    out.set(start, acc);
  }
  return [...out.values()].sort((a, b) => a[0] - b[0]);
}

/** The finished requests kept for the per-request charts: `fresh` appended (by id, no duplicates), the last
 *  `maxLength` kept. */
export function mergeRecent(recent, fresh, maxLength = 100) {
  const seen = new Set(recent.map((r) => r.id));
  const merged = recent.concat(fresh.filter((r) => !seen.has(r.id)));
  return merged.slice(Math.max(0, merged.length - maxLength));
}

/** A round upper bound for a chart's axis: 1, 2 or 5 times a power of ten, at least `value` (1 for 0 or less). */
export function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 5, 10]) if (m * power >= value) return m * power;
  return 10 * power;
}

/** An SVG path ("M x y L x y ...") of `values` over a `width` x `height` box, y = 0 at the bottom, scaled to
 *  `maxY`; null values break the line. "" when nothing is drawn. */
export function linePath(values, width, height, maxY) {
  if (!values.length) return "";
  const dx = values.length > 1 ? width / (values.length - 1) : 0;
  let path = "";
  let pen = false;
  values.forEach((v, i) => {
    if (v === null || v === undefined || Number.isNaN(v)) {
      pen = false;
      return;
    }
    const x = (i * dx).toFixed(1);
    const y = (height - (Math.min(v, maxY) / maxY) * height).toFixed(1);
    path += `${pen ? "L" : "M"}${x} ${y} `;
    pen = true;
  });
  return path.trim();
}

/** Bytes as a short text with binary units ("1.5 MiB"); "–" for null. */
export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i === 0 ? v : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)} ${units[i]}`;
}

/** A number with at most `digits` decimals and thousands separators; "–" for null. */
export function formatNumber(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits });
}

/** Seconds as "850 ms", "12.3 s", "4 min 5 s" or "2 h 3 min"; "–" for null. */
export function formatDuration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

/** A share (0..1) as a percentage ("87%"); "–" for null. */
export function formatShare(x) {
  return x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`;
}

/** The request headers that carry `key` (none without one). */
export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** The usage rows grouped by day and client (GET /v1/usage?group=day,client) as a table: the days (newest
 *  first), the clients (by tokens, most first), and cells[day][client] = {requests, prompt, cached, generated}.
 *  A row without a client is "(open)". */
export function usagePivot(rows) {
  const days = new Set();
  const totals = new Map();
  const cells = {};
  for (const r of rows) {
    const client = r.client || "(open)";
    days.add(r.day);
    totals.set(client, (totals.get(client) || 0) + (r.prompt_tokens || 0) + (r.generated_tokens || 0));
    cells[r.day] = cells[r.day] || {};
    const cell = cells[r.day][client] || { requests: 0, prompt: 0, cached: 0, generated: 0 };
    cell.requests += r.requests || 0;
    cell.prompt += r.prompt_tokens || 0;
    cell.cached += r.cached_tokens || 0;
    cell.generated += r.generated_tokens || 0;
    cells[r.day][client] = cell;
  }
  const clients = [...totals.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1)).map((e) => e[0]);
  return { days: [...days].sort().reverse(), clients, cells };
}

/** The cache tiers worth showing (a budget or bytes), as [{name, bytes, budget, share, entries}]. */
export function cacheTiers(cache) {
  if (!cache || !cache.enabled) return [];
  return Object.entries(cache.tiers)
    .filter(([, t]) => t.budget_bytes > 0 || t.bytes > 0)
    .map(([name, t]) => ({ name, bytes: t.bytes, budget: t.budget_bytes, entries: t.entries,
      share: t.budget_bytes > 0 ? Math.min(1, t.bytes / t.budget_bytes) : null }));
}
