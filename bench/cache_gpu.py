"""The prefix cache's targets (issue 36) measured on the engine directly: no server, no checkpoint files.

On the GPU the model is bench/decode.py's synthetic Qwen3.5 shape (random device weights, ``build(fmt, shape)``);
with ``--device cpu`` it is the embedded NumPy model (a check of this script's logic, not a target figure). Prompts
are random token ids; every request is greedy with max_tokens=1 and logprobs=1; TTFT is the host wall time from
the request to its first chunk (the engine yields it after reading the id from the device).

Per format it reports:
1. cold TTFT of ``--context``-token prompts, cache off and cache on (snapshots taken), alternated ``--cold-reps``
   times in this process (a new prompt each pair, each cache-on run on an empty cache of the same budgets):
   medians, spread, and overhead = median(on) / median(off) - 1 (target <= 3 %), with what the snapshots did
   (blocks taken, spilled to the host tier, host seconds inside ``PrefixCache.snapshot``);
2. a resend of the same prompt: TTFT (target <= 0.15 s) and ``last_cached_tokens``;
3. a turn adding n tokens (``--add``): TTFT against a cold prefill of n tokens alone (target <= prefill(n) + 50 ms);
4. a host-tier restore: every resident block demoted to pinned host memory (the store's own eviction step,
   ``PrefixCache._evict`` with nothing protected), then the resend (target <= 0.3 s; none on the CPU engine,
   whose resident tier is host memory);
5. a disk-tier restore after a restart (a new PrefixCache and Engine over the same ``--cache-dir``): the files are
   fsynced and dropped from the page cache (posix_fadvise DONTNEED) first; TTFT against the bytes the restore read
   (``disk_read_bytes``) over the disk's read bandwidth, measured once a run on a fresh file as large as those
   bytes, written by this run beside the cache files, fsynced and dropped from the page cache, then read
   sequentially (os.readv into one 16 MiB buffer); read a second time without dropping it, the figure is the page
   cache's: when the first read is not clearly slower (under 1.5x the second's time), the disk figure is flagged
   ``looks_cached`` (the kernel did not drop the pages: gVisor, say): target within 1.2x;
6. exactness: every cached request's first token and logprob equal the cache-off engine's (PASS / FAIL);
7. sizing, for choosing ``--prefix-chunk``, ``--cache-gb`` and ``--cache-host-gb``: the bytes of a block (view rows a
   token, sections a restore point), a ``--context`` chain's bytes at each grid in ``--sizing-chunks``, how many
   such chains each tier holds, and what re-prefilling half a grid step costs at depth (the turns' prefill rate).
Usage: python3 bench/cache_gpu.py [--formats nvfp4,fp8] [--shape 27b|9b] [--context 32768] [--add 256,1024,4096]
[--cold-reps 3 | 2,1] [--cache-gb 8] [--cache-host-gb 16] [--sizing-chunks 256,512,1024,2048,4096]
[--cache-dir DIR] [--out FILE.json] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tandem.cache import disk as cache_disk  # noqa: E402
from tandem.cache.build import state_signature  # noqa: E402
from tandem.cache.index import RESIDENT  # noqa: E402
from tandem.cache.signature import cache_signature  # noqa: E402
from tandem.cache.store import GB, PrefixCache  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=1)
PIECE = 16 << 20
CACHED_RATIO = 1.5  # a dropped read under this many times slower than a cached one was not from the disk


class Bench:
    """One format's model, its cache-off engine and the measurements (``rows``: name → figures)."""

    def __init__(self, model: Any, args: argparse.Namespace, backend: str, fmt: str) -> None:
        self.model, self.args, self.backend = model, args, backend
        self.sync = _synchronizer(backend)
        self.max_context = args.context + max(args.add + [0]) + 64
        self.vocab = int(model.hp.vocab_size)
        self.rng = np.random.default_rng(7)
        tag = f"synthetic|{args.shape}|{fmt}|{backend}|{os.getpid()}|{id(model)}|{time.time_ns()}"
        # no checkpoint: the weights are this process's random ones, so the digest names this build only
        self.signature = cache_signature(hashlib.sha256(tag.encode()).hexdigest(), backend, args.prefix_chunk,
                                         state_signature(model))
        self.off = self.engine(None)
        self.exact: list[dict[str, Any]] = []
        self.disk: dict[str, Any] | None = None  # the disk's bandwidth, measured once a run

    def engine(self, cache: PrefixCache | None) -> Engine:
        return Engine(self.model, None, None, self.max_context, (), "synthetic", "off", cache, self.args.prefix_chunk)

    def cache(self, cache_dir: Path | None) -> PrefixCache:
        a = self.args
        return PrefixCache(a.prefix_chunk, int(a.cache_gb * GB), int(a.cache_host_gb * GB), cache_dir,
                           int(a.cache_disk_gb * GB), self.signature if cache_dir is not None else "")

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def ttft(self, engine: Engine, ids: list[int]) -> tuple[float, tuple[int, float]]:
        """Seconds to the first chunk, and (token, logprob) of it; the rest of the request is drained untimed."""
        self.sync()
        t0 = time.perf_counter()
        it = engine.generate(ids, PARAMS)
        first = next(it)
        dt = time.perf_counter() - t0
        for _ in it:
            pass
        self.sync()
        lp = first.logprobs[0] if first.logprobs else None
        return dt, (first.token_ids[0], float(lp.logprob) if lp is not None else float("nan"))

    def check(self, case: str, got: tuple[int, float], want: tuple[int, float]) -> None:
        ok = got[0] == want[0] and (got[1] == want[1] or (np.isnan(got[1]) and np.isnan(want[1])))
        self.exact.append({"case": case, "pass": bool(ok), "token": got[0], "logprob": got[1],
                           "cold_token": want[0], "cold_logprob": want[1]})
        print(f"  exact {case}: {'PASS' if ok else 'FAIL'} (token {got[0]} vs {want[0]}, "
              f"logprob {got[1]!r} vs {want[1]!r})", flush=True)


def _synchronizer(backend: str) -> Any:
    if backend != "cuda":
        return lambda: None
    import cupy as cp
    return lambda: cp.cuda.Device().synchronize()


def drop_page_cache(paths: list[Path]) -> None:
    """fsync each file and ask the kernel to drop its pages (posix_fadvise DONTNEED: no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(path: Path, drop: bool) -> tuple[int, float]:
    """(bytes, seconds) of a sequential read of ``path`` into one 16 MiB buffer (after dropping its pages)."""
    if drop:
        drop_page_cache([path])
    buf = bytearray(PIECE)
    total, t0 = 0, time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            total += n
    finally:
        os.close(fd)
    return total, time.perf_counter() - t0


def disk_bandwidth(folder: Path, nbytes: int) -> dict[str, Any]:
    """The disk's sequential read bandwidth on a fresh file of ``nbytes`` written in ``folder`` (removed after),
    read once after dropping its pages and once more from the page cache."""
    path = folder / "read_bandwidth.probe"
    piece = np.random.default_rng(1).integers(0, 256, PIECE, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = max(PIECE, nbytes)
        while left > 0:
            left -= f.write(piece[:min(PIECE, left)])
    drop_page_cache([path])  # fsync: the write is on the disk before its pages are dropped
    write_s = time.perf_counter() - t0
    try:
        n, cold = read_seconds(path, True)
        _, warm = read_seconds(path, False)
    finally:
        path.unlink()
    looks_cached = cold < CACHED_RATIO * warm
    out = {"bytes": n, "read_s": cold, "read_gbps": n / cold / 1e9, "cached_read_gbps": n / warm / 1e9,
           "write_gbps": n / write_s / 1e9, "looks_cached": bool(looks_cached)}
    print(f"  disk: a fresh {n / GB:.2f} GB file read at {out['read_gbps']:.2f} GB/s after dropping its pages "
          f"({out['cached_read_gbps']:.2f} GB/s from the page cache; written at {out['write_gbps']:.2f} GB/s)"
          + ("  LOOKS CACHED: the dropped read was not slower than the cached one" if looks_cached else ""),
          flush=True)
    return out


def sizing(b: "Bench", turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes of the cache's blocks at each grid step in --sizing-chunks, and the cost of half a step at depth."""
    from tandem.cache import arrays

    specs = _specs(b.model)
    row = sum(arrays.spec_rows_nbytes(s.shape, s.dtype) for s in specs if s.kind == "view")
    sections = sum(arrays.spec_nbytes(s.shape, s.dtype) for s in specs if s.kind == "section")
    logits = 4 * b.vocab
    a = b.args
    rate = None  # seconds a token prefilled at depth, from the largest turn
    if turns:
        t = max(turns, key=lambda r: r["n"])
        rate = t["ttft_s"] / t["n"]
    rows = []
    for c in a.sizing_chunks:
        blocks = -(-a.context // c)
        chain = a.context * row + blocks * (sections + logits)
        rows.append({"prefix_chunk": c, "block_bytes": c * row + sections + logits, "chain_bytes": chain,
                     "chains_resident": a.cache_gb * GB / chain, "chains_host": a.cache_host_gb * GB / chain,
                     "half_step_prefill_s": rate * c / 2 if rate is not None else None})
    out = {"view_bytes_per_token": row, "section_bytes": sections, "logits_bytes": logits,
           "prefill_s_per_token_at_depth": rate, "chunks": rows}
    print(f"  sizing: {row / 1024:.0f} KiB of view rows a token, {sections / 2**20:.0f} MiB of sections a restore "
          f"point; a {a.context}-token chain:", flush=True)
    for r in rows:
        half = f"{r['half_step_prefill_s']:.3f} s" if r["half_step_prefill_s"] is not None else "-"
        print(f"    --prefix-chunk {r['prefix_chunk']:5d}: block {r['block_bytes'] / GB:.3f} GB, chain "
              f"{r['chain_bytes'] / GB:.2f} GB ({r['chains_resident']:.2f} chains in --cache-gb {a.cache_gb:g}, "
              f"{r['chains_host']:.2f} in --cache-host-gb {a.cache_host_gb:g}); a turn diverging mid-step "
              f"re-prefills ~{r['prefix_chunk'] // 2} tokens at depth: {half}", flush=True)
    return out


def live_prefill_s(b: Bench, on: Engine, prompt: list[int], extra: list[int]) -> float | None:
    """Seconds to prefill ``extra`` into a live state holding ``prompt`` (the cache not involved) up to its last
    logits on the device: what the turn's new tokens cost an engine that kept the sequence in place. The state is the
    cache-on engine's kept one after a resend of ``prompt`` (None when it does not hold exactly the prompt)."""
    b.ttft(on, prompt)
    state = on._spare_state
    if state is None or state.length != len(prompt):
        return None
    on._spare_state = None  # not reused in place by a later request while it is extended here
    b.sync()
    t0 = time.perf_counter()
    b.model.prefill(state, extra)
    b.sync()
    dt = time.perf_counter() - t0
    on._spare_state = state  # reset in place by the next request
    return dt


def _specs(model: Any) -> list[Any]:
    specs = getattr(model, "state_specs", None) or getattr(getattr(model, "host", None), "state_specs", None)
    if specs is not None:
        return list(specs(1))
    from tandem.models.qwen3_5.state_layout import state_specs
    return list(state_specs(model.hp, 1, getattr(model, "kv_dtype", "float32")))


def bench_format(b: Bench, cache_dir: Path, num_reps: int) -> dict[str, Any]:
    a = b.args
    out: dict[str, Any] = {}
    prompt = b.ids(a.context)
    warm_cache = b.cache(cache_dir)
    on = b.engine(b.cache(None))
    warm_ids = b.ids(2 * a.prefix_chunk + 17)  # kernels compiled, states allocated, plans recorded
    b.ttft(b.off, warm_ids)
    b.ttft(on, b.ids(2 * a.prefix_chunk + 17))
    # 1. cold, cache off and on, alternated; the last cache-on run fills the cache the later steps use
    offs, ons, pairs = [], [], []
    for rep in range(num_reps):
        ids = prompt if rep == num_reps - 1 else b.ids(a.context)
        cache = warm_cache if rep == num_reps - 1 else b.cache(None)
        on.cache = cache  # an empty cache of the same budgets for each cache-on run
        t_off, cold = b.ttft(b.off, ids)
        snap = _time_snapshots(cache)
        t_on, got = b.ttft(on, ids)
        snap_s = snap()
        b.check(f"cold, cache on ({rep + 1})", got, cold)
        info = cache.info()
        pairs.append({"off_s": t_off, "on_s": t_on, "overhead_pct": 100 * (t_on / t_off - 1),
                      "snapshots": info["snapshots"], "spills": info["spills"], "refused": info["refused"],
                      "snapshot_host_s": snap_s})
        offs.append(t_off)
        ons.append(t_on)
        print(f"  cold {a.context} ({rep + 1}/{num_reps}): off {t_off:.3f} s, on {t_on:.3f} s "
              f"({pairs[-1]['overhead_pct']:+.2f} %); {info['snapshots']} snapshots, {info['spills']} spilled to "
              f"the host tier, {snap_s:.3f} s of host time inside snapshot()", flush=True)
        if cache is not warm_cache:
            cache.clear()
    out["cold_pairs"] = pairs
    out["cold_off_s"], out["cold_on_s"] = float(np.median(offs)), float(np.median(ons))
    out["cold_off_spread_s"] = [float(min(offs)), float(max(offs))]
    out["cold_on_spread_s"] = [float(min(ons)), float(max(ons))]
    out["snapshot_overhead_pct"] = 100 * (out["cold_on_s"] / out["cold_off_s"] - 1)
    print(f"  cold {a.context}, median of {num_reps}: off {out['cold_off_s']:.3f} s "
          f"[{min(offs):.3f}, {max(offs):.3f}], on {out['cold_on_s']:.3f} s [{min(ons):.3f}, {max(ons):.3f}] "
          f"({out['snapshot_overhead_pct']:+.2f} %)", flush=True)
    out["tiers_after_cold"] = tiers = warm_cache.info()["tiers"]
    print("  tiers after the cold run: " + ", ".join(f"{t} {v['entries']} blocks {v['bytes'] / GB:.2f} GB"
                                                     for t, v in tiers.items()), flush=True)
    # 2. resend
    times = []
    for _ in range(3):
        t, got = b.ttft(on, prompt)
        times.append(t)
    b.check("resend", got, cold)
    out["resend_s"] = float(np.median(times))
    out["resend_cached_tokens"] = on.last_cached_tokens
    print(f"  resend: {out['resend_s']:.3f} s (median of 3), cached {on.last_cached_tokens}", flush=True)
    # 3. turns adding n tokens
    out["turns"] = []
    for n in a.add:
        extra = b.ids(n)
        t_pre = min(b.ttft(b.off, b.ids(n))[0] for _ in range(2))
        t_turn, got = b.ttft(on, prompt + extra)
        cached = on.last_cached_tokens
        if a.turn_refs:
            b.check(f"turn +{n}", got, b.ttft(b.off, prompt + extra)[1])
        t_depth = live_prefill_s(b, on, prompt, extra)
        out["turns"].append({"n": n, "ttft_s": t_turn, "prefill_n_s": t_pre, "cached_tokens": cached,
                             "margin_ms": 1000 * (t_turn - t_pre), "prefill_n_at_depth_s": t_depth,
                             "margin_at_depth_ms": 1000 * (t_turn - t_depth) if t_depth is not None else None})
        depth = f", prefilled into the live {len(prompt)}-token state {t_depth:.3f} s" if t_depth is not None else ""
        print(f"  turn +{n}: {t_turn:.3f} s vs prefill({n}) {t_pre:.3f} s{depth}, cached {cached}", flush=True)
    out["sizing"] = sizing(b, out["turns"])
    # 4. host tier
    if b.backend == "cuda":
        with warm_cache.lock:
            warm_cache._evict(RESIDENT, warm_cache.budget[RESIDENT], set())
            tiers = warm_cache.info()["tiers"]
        print(f"  demoted: resident {tiers['resident']['bytes'] / GB:.2f} GB, host {tiers['host']['bytes'] / GB:.2f}"
              f" GB in {tiers['host']['entries']} blocks", flush=True)
        t, got = b.ttft(on, prompt)
        b.check("host tier", got, cold)
        out["host"] = {"ttft_s": t, "cached_tokens": on.last_cached_tokens,
                       "host_bytes_before": tiers["host"]["bytes"], "resident_bytes_before": tiers["resident"]["bytes"]}
        print(f"  host-tier restore: {t:.3f} s, cached {on.last_cached_tokens}", flush=True)
    else:
        out["host"] = None
        print("  host tier: none on a host state (its resident tier is host memory)", flush=True)
    # 5. disk tier across a restart
    on.release_state()
    del on, warm_cache
    files = sorted(cache_dir.glob("*" + cache_disk.SUFFIX))
    drop_page_cache(files)
    restart_cache = b.cache(cache_dir)
    again = b.engine(restart_cache)
    b.ttft(again, b.ids(a.prefix_chunk + 5))  # the new engine's state allocated and its plans recorded
    files = sorted(cache_dir.glob("*" + cache_disk.SUFFIX))
    drop_page_cache(files)
    before = restart_cache.info()
    t_disk, got = b.ttft(again, prompt)
    after = restart_cache.info()
    b.check("disk tier (restart)", got, cold)
    nbytes = after["disk_read_bytes"] - before["disk_read_bytes"]
    blocks = after["disk_read_blocks"] - before["disk_read_blocks"]
    if b.disk is None:
        b.disk = disk_bandwidth(cache_dir, nbytes)
    bw = b.disk["read_gbps"] * 1e9
    ideal = nbytes / bw
    out["disk"] = {"ttft_s": t_disk, "cached_tokens": again.last_cached_tokens, "files": len(files),
                   "bytes_read": nbytes, "blocks_read": blocks, "read_gbps": bw / 1e9, "ideal_s": ideal,
                   "ratio": t_disk / ideal if ideal > 0 else None, "looks_cached": b.disk["looks_cached"],
                   "bandwidth": b.disk, "read_buffers": restart_cache.read_buffers}
    print(f"  disk restore: {t_disk:.3f} s, cached {again.last_cached_tokens}, read {nbytes / GB:.2f} GB in "
          f"{blocks} blocks; the disk reads {bw / 1e9:.2f} GB/s -> ideal {ideal:.3f} s, ratio "
          f"{t_disk / ideal if ideal > 0 else float('nan'):.2f}" + (" (the bandwidth LOOKS CACHED)" if b.disk["looks_cached"] else ""),
          flush=True)
    again.release_state()
    b.off.release_state()
    out["exact"] = b.exact
    return out


def _time_snapshots(cache: PrefixCache) -> Any:
    """Wrap ``cache.snapshot`` to sum its host time; returns a function that unwraps it and gives the seconds."""
    orig = cache.snapshot
    spent = [0.0]

    def timed(*args: Any, **kwargs: Any) -> bool:
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    cache.snapshot = timed  # type: ignore[method-assign]

    def done() -> float:
        del cache.snapshot
        return spent[0]
    return done


def make_model(fmt: str, args: argparse.Namespace) -> Any:
    if args.device == "cpu":
        return Engine.from_pretrained(cache="off").model
    from decode import SHAPES, build  # bench/decode.py (imports cupy)
    return build(fmt, SHAPES[args.shape], args.kv_dtype)


def table(results: dict[str, Any]) -> str:
    rows = [f"{'format':8} {'cold off':>9} {'cold on':>9} {'ovh %':>6} {'resend':>7} {'host':>7} {'disk':>7} "
            f"{'disk/ideal':>10}  turns +n: ttft / prefill(n) / prefill(n) at depth  exact"]
    for fmt, r in results.items():
        host = f"{r['host']['ttft_s']:7.3f}" if r["host"] else f"{'-':>7}"
        d = r["disk"]
        turns = ", ".join(f"+{t['n']}: {t['ttft_s']:.3f}/{t['prefill_n_s']:.3f}/{t.get('prefill_n_at_depth_s') or 0:.3f}"
                          for t in r["turns"])
        ok = "PASS" if all(e["pass"] for e in r["exact"]) else "FAIL"
        ratio = f"{d['ratio']:10.2f}" if d["ratio"] is not None else f"{'-':>10}"
        rows.append(f"{fmt:8} {r['cold_off_s']:9.3f} {r['cold_on_s']:9.3f} {r['snapshot_overhead_pct']:6.2f} "
                    f"{r['resend_s']:7.3f} {host} {d['ttft_s']:7.3f} {ratio}  {turns}  {ok}")
    rows.append("cold off / on: medians of the alternated pairs; targets: ovh <= 3 %, resend <= 0.15 s, turn <= prefill(n) + 0.05 s, host <= 0.3 s, "
                "disk/ideal <= 1.2")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--shape", default="27b", choices=("27b", "9b"))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--add", default="256,1024,4096")
    ap.add_argument("--prefix-chunk", type=int, default=1024)
    ap.add_argument("--cold-reps", default="3",
                    help="cold cache off / on pairs, alternated; a comma list gives each format its own")
    ap.add_argument("--sizing-chunks", default="256,512,1024,2048,4096")
    ap.add_argument("--cache-gb", type=float, default=8.0, help="resident budget (the engine's GPU default)")
    ap.add_argument("--cache-host-gb", type=float, default=16.0)
    ap.add_argument("--cache-disk-gb", type=float, default=20.0)
    ap.add_argument("--cache-dir", default=None, help="the disk tier's folder (default: a temp dir, removed)")
    ap.add_argument("--no-turn-refs", dest="turn_refs", action="store_false",
                    help="skip the cold cache-off runs that check each turn's first token")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the synthetic model's KV storage (default: the engine's)")
    ap.add_argument("--out", default=None, help="default bench/results/cache_gpu_h200.json (cpu: none)")
    args = ap.parse_args()
    args.add = [int(x) for x in args.add.split(",") if x]
    args.sizing_chunks = [int(x) for x in args.sizing_chunks.split(",") if x]
    reps = [max(1, int(x)) for x in str(args.cold_reps).split(",") if x] or [1]
    formats = [f for f in args.formats.split(",") if f] if args.device == "cuda" else ["cpu"]
    args.cold_reps = {f: reps[min(i, len(reps) - 1)] for i, f in enumerate(formats)}
    device = "cpu"
    if args.device == "cuda":
        import cupy as cp
        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
    print(f"device {device}, shape {args.shape}, context {args.context}, add {args.add}", flush=True)
    out = args.out or (str(ROOT / "bench" / "results" / "cache_gpu_h200.json") if args.device == "cuda" else None)
    results: dict[str, Any] = {}
    disk_bw: dict[str, Any] | None = None  # the disk's bandwidth: measured by the first format, reused
    for fmt in formats:
        print(f"[{fmt}] building", flush=True)
        t0 = time.perf_counter()
        model = make_model(fmt, args)
        cache_dir = Path(args.cache_dir) / fmt if args.cache_dir else Path(tempfile.mkdtemp(prefix="tandem-cache-"))
        if cache_dir.exists() and any(cache_dir.iterdir()):
            shutil.rmtree(cache_dir)  # a fresh disk tier for this model's signature
        try:
            b = Bench(model, args, args.device, fmt)
            b.disk = disk_bw
            results[fmt] = bench_format(b, cache_dir, args.cold_reps.get(fmt, 1))
            disk_bw = b.disk
            results[fmt]["seconds"] = time.perf_counter() - t0
            write_results(out, device, args, results)
            del b
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache_dir, ignore_errors=True)
            del model
            if args.device == "cuda":
                import cupy as cp
                cp.get_default_memory_pool().free_all_blocks()
                cp.get_default_pinned_memory_pool().free_all_blocks()
    print(table(results))
    print("exactness:", "PASS" if all(e["pass"] for r in results.values() for e in r["exact"]) else "FAIL")


def write_results(out: str | None, device: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The results so far as JSON (written after each format, so a run cut short keeps what it measured)."""
    if not out:
        return
    ok = all(e["pass"] for r in results.values() for e in r["exact"])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"device": device, "command": " ".join(["python3"] + sys.argv),
                                     "shape": args.shape, "context": args.context, "add": args.add,
                                     "prefix_chunk": args.prefix_chunk, "cold_reps": args.cold_reps,
                                     "cache_gb": args.cache_gb, "cache_host_gb": args.cache_host_gb,
                                     "exact": ok, "results": results}, indent=1) + "\n")
    print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
