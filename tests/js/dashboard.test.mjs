// The dashboard's pure functions (tandem/server/dashboard/logic.js) under node's built-in test runner:
// node --test tests/js/  (tests/test_dashboard.py runs it too).
import assert from "node:assert/strict";
import test from "node:test";

import {
  authHeaders, bucketRates, cacheTiers, formatBytes, formatDuration, formatNumber, formatShare, linePath,
  mergeHistory, mergeRecent, niceMax, parseSSE, usagePivot,
} from "../../tandem/server/dashboard/logic.js";

test("parseSSE splits whole events and keeps the unfinished tail", () => {
  const first = parseSSE('event: activity\ndata: {"a":1}\n\nevent: activity\ndata: {"a"');
  assert.deepEqual(first.events, [{ event: "activity", data: '{"a":1}' }]);
  const second = parseSSE(first.rest + ':2}\n\n: keep-alive\n\n');
  assert.deepEqual(second.events, [{ event: "activity", data: '{"a":2}' }]);
  assert.equal(second.rest, "");
});

test("parseSSE joins data lines, takes CRLF and defaults the event name", () => {
  const { events } = parseSSE("data: one\r\ndata:two\r\n\r\n");
  assert.deepEqual(events, [{ event: "message", data: "one\ntwo" }]);
});

test("mergeHistory replaces a second it holds, keeps order and the newest maxLength", () => {
  const merged = mergeHistory([[10, 1, 1], [11, 2, 2]], [[11, 5, 3], [12, 7, 4]], 2);
  assert.deepEqual(merged, [[11, 5, 3], [12, 7, 4]]);
});

test("bucketRates averages per-second counts over aligned buckets", () => {
  assert.deepEqual(bucketRates([[10, 10, 5], [11, 20, 5], [15, 5, 0]], 5), [[10, 6, 2], [15, 1, 0]]);
});

test("mergeRecent drops ids it already has and keeps the last maxLength", () => {
  const merged = mergeRecent([{ id: 1 }, { id: 2 }], [{ id: 2 }, { id: 3 }, { id: 4 }], 3);
  assert.deepEqual(merged.map((r) => r.id), [2, 3, 4]);
});

test("niceMax rounds up to 1, 2 or 5 times a power of ten", () => {
  assert.equal(niceMax(0), 1);
  assert.equal(niceMax(3), 5);
  assert.equal(niceMax(17), 20);
  assert.equal(niceMax(100), 100);
  assert.equal(niceMax(0.03), 0.05);
});

test("linePath scales to the box, clamps at maxY and breaks at nulls", () => {
  assert.equal(linePath([0, 10], 100, 50, 10), "M0.0 50.0 L100.0 0.0");
  assert.equal(linePath([20, null, 5], 100, 50, 10), "M0.0 0.0 M100.0 25.0");
  assert.equal(linePath([], 100, 50, 10), "");
});

test("formatting", () => {
  assert.equal(formatBytes(512), "512 B");
  assert.equal(formatBytes(1536), "1.50 KiB");
  assert.equal(formatBytes(3 * 1024 ** 3), "3.00 GiB");
  assert.equal(formatBytes(null), "–");
  assert.equal(formatNumber(12345.678, 1), "12,345.7");
  assert.equal(formatNumber(null), "–");
  assert.equal(formatDuration(0.25), "250 ms");
  assert.equal(formatDuration(12.34), "12.3 s");
  assert.equal(formatDuration(245), "4 min 5 s");
  assert.equal(formatDuration(7380), "2 h 3 min");
  assert.equal(formatShare(0.874), "87%");
  assert.equal(formatShare(null), "–");
});

test("authHeaders carries a key only when there is one", () => {
  assert.deepEqual(authHeaders(""), {});
  assert.deepEqual(authHeaders("k1"), { Authorization: "Bearer k1" });
});

test("usagePivot groups by day (newest first) and client (most tokens first)", () => {
  const rows = [
    { day: "2026-01-01", client: "alice", requests: 2, prompt_tokens: 10, cached_tokens: 4, generated_tokens: 5 },
    { day: "2026-01-02", client: "bob", requests: 1, prompt_tokens: 100, cached_tokens: 0, generated_tokens: 50 },
    { day: "2026-01-02", client: null, requests: 3, prompt_tokens: 1, cached_tokens: 0, generated_tokens: 1 },
  ];
  const pivot = usagePivot(rows);
  assert.deepEqual(pivot.days, ["2026-01-02", "2026-01-01"]);
  assert.deepEqual(pivot.clients, ["bob", "alice", "(open)"]);
  assert.deepEqual(pivot.cells["2026-01-01"].alice, { requests: 2, prompt: 10, cached: 4, generated: 5 });
  assert.equal(pivot.cells["2026-01-02"]["(open)"].requests, 3);
});

test("cacheTiers shows the tiers with a budget or bytes", () => {
  const cache = { enabled: true, tiers: {
    resident: { entries: 2, bytes: 512, budget_bytes: 1024 },
    host: { entries: 0, bytes: 0, budget_bytes: 0 },
    disk: { entries: 1, bytes: 100, budget_bytes: 0 } } };
  assert.deepEqual(cacheTiers(cache), [
    { name: "resident", bytes: 512, budget: 1024, entries: 2, share: 0.5 },
    { name: "disk", bytes: 100, budget: 0, entries: 1, share: null }]);
  assert.deepEqual(cacheTiers({ enabled: false }), []);
});
