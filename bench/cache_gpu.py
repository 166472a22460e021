"""The prefix cache's targets (issue 36) measured on the engine directly: no server, no checkpoint files.

On the GPU the model is bench/decode.py's synthetic Qwen3.5 shape (random device weights, ``build(fmt, shape)``);
with ``--device cpu`` it is the embedded NumPy model (a check of this script's logic, not a target figure). Prompts
are random token ids; every request is greedy with max_tokens=1 and logprobs=1; TTFT is the host wall time from
the request to its first chunk (the engine yields it after reading the id from the device).

Per format it reports:
1. cold TTFT of a ``--context``-token prompt, cache off and cache on (snapshots taken): overhead = on/off - 1
   (target <= 3 %);
2. a resend of the same prompt: TTFT (target <= 0.15 s) and ``last_cached_tokens``;
3. a turn adding n tokens (``--add``): TTFT against a cold prefill of n tokens alone (target <= prefill(n) + 50 ms);
4. a host-tier restore: every resident block demoted to pinned host memory (the store's own eviction step,
   ``PrefixCache._evict`` with nothing protected), then the resend (target <= 0.3 s; none on the CPU engine,
   whose resident tier is host memory);
5. a disk-tier restore after a restart (a new PrefixCache and Engine over the same ``--cache-dir``): the files are
   fsynced and dropped from the page cache (posix_fadvise DONTNEED) first; TTFT against the bytes the restore read
   over a sequential read of the same files (os.read, 16 MiB pieces, dropped again first): target within 1.2x;
6. exactness: every cached request's first token and logprob equal the cache-off engine's (PASS / FAIL).
Usage: python3 bench/cache_gpu.py [--formats nvfp4,fp8] [--shape 27b|9b] [--context 32768] [--add 256,1024,4096]
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


def read_bandwidth(paths: list[Path]) -> tuple[int, float]:
    """(bytes, seconds) of a sequential os.read of ``paths`` in 16 MiB pieces, after dropping their pages."""
    drop_page_cache(paths)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                b = os.read(fd, PIECE)
                if not b:
                    break
                total += len(b)
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def bench_format(b: Bench, cache_dir: Path) -> dict[str, Any]:
    a = b.args
    out: dict[str, Any] = {}
    prompt = b.ids(a.context)
    warm_cache = b.cache(cache_dir)
    on = b.engine(warm_cache)
    warm_ids = b.ids(2 * a.prefix_chunk + 17)  # kernels compiled, states allocated, plans recorded
    b.ttft(b.off, warm_ids)
    b.ttft(on, b.ids(2 * a.prefix_chunk + 17))
    # 1. cold, cache off and on
    t_off, cold = b.ttft(b.off, prompt)
    t_on, got = b.ttft(on, prompt)
    b.check("cold, cache on", got, cold)
    out["cold_off_s"], out["cold_on_s"] = t_off, t_on
    out["snapshot_overhead_pct"] = 100 * (t_on / t_off - 1)
    print(f"  cold {a.context}: off {t_off:.3f} s, on {t_on:.3f} s ({out['snapshot_overhead_pct']:+.1f} %)",
          flush=True)
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
        out["turns"].append({"n": n, "ttft_s": t_turn, "prefill_n_s": t_pre, "cached_tokens": cached,
                             "margin_ms": 1000 * (t_turn - t_pre)})
        print(f"  turn +{n}: {t_turn:.3f} s vs prefill({n}) {t_pre:.3f} s, cached {cached}", flush=True)
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
    read: list[int] = []
    orig = cache_disk.read_block

    def counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        read.append(Path(path).stat().st_size)
        return orig(path, *args, **kwargs)

    restart_cache = b.cache(cache_dir)
    again = b.engine(restart_cache)
    b.ttft(again, b.ids(a.prefix_chunk + 5))  # the new engine's state allocated and its plans recorded
    drop_page_cache(files)
    cache_disk.read_block = counted  # type: ignore[assignment]
    try:
        t_disk, got = b.ttft(again, prompt)
    finally:
        cache_disk.read_block = orig  # type: ignore[assignment]
    b.check("disk tier (restart)", got, cold)
    nbytes, secs = read_bandwidth(files)
    bw = nbytes / secs if secs > 0 else float("inf")
    ideal = sum(read) / bw
    out["disk"] = {"ttft_s": t_disk, "cached_tokens": again.last_cached_tokens, "files": len(files),
                   "bytes_read": sum(read), "blocks_read": len(read), "read_gbps": bw / 1e9, "ideal_s": ideal,
                   "ratio": t_disk / ideal if ideal > 0 else None}
    print(f"  disk restore: {t_disk:.3f} s, cached {again.last_cached_tokens}, read {sum(read) / GB:.2f} GB in "
          f"{len(read)} blocks; files read at {bw / 1e9:.2f} GB/s -> ideal {ideal:.3f} s", flush=True)
    again.release_state()
    b.off.release_state()
    out["exact"] = b.exact
    return out


def make_model(fmt: str, args: argparse.Namespace) -> Any:
    if args.device == "cpu":
        return Engine.from_pretrained(cache="off").model
    from decode import SHAPES, build  # bench/decode.py (imports cupy)
    return build(fmt, SHAPES[args.shape])


def table(results: dict[str, Any]) -> str:
    rows = [f"{'format':8} {'cold off':>9} {'cold on':>9} {'ovh %':>6} {'resend':>7} {'host':>7} {'disk':>7} "
            f"{'disk/ideal':>10}  turns +n: ttft / prefill(n)  exact"]
    for fmt, r in results.items():
        host = f"{r['host']['ttft_s']:7.3f}" if r["host"] else f"{'-':>7}"
        d = r["disk"]
        turns = ", ".join(f"+{t['n']}: {t['ttft_s']:.3f}/{t['prefill_n_s']:.3f}" for t in r["turns"])
        ok = "PASS" if all(e["pass"] for e in r["exact"]) else "FAIL"
        ratio = f"{d['ratio']:10.2f}" if d["ratio"] is not None else f"{'-':>10}"
        rows.append(f"{fmt:8} {r['cold_off_s']:9.3f} {r['cold_on_s']:9.3f} {r['snapshot_overhead_pct']:6.1f} "
                    f"{r['resend_s']:7.3f} {host} {d['ttft_s']:7.3f} {ratio}  {turns}  {ok}")
    rows.append("targets: ovh <= 3 %, resend <= 0.15 s, turn <= prefill(n) + 0.05 s, host <= 0.3 s, "
                "disk/ideal <= 1.2")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--shape", default="27b", choices=("27b", "9b"))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--add", default="256,1024,4096")
    ap.add_argument("--prefix-chunk", type=int, default=1024)
    ap.add_argument("--cache-gb", type=float, default=8.0, help="resident budget (the engine's GPU default)")
    ap.add_argument("--cache-host-gb", type=float, default=16.0)
    ap.add_argument("--cache-disk-gb", type=float, default=20.0)
    ap.add_argument("--cache-dir", default=None, help="the disk tier's folder (default: a temp dir, removed)")
    ap.add_argument("--no-turn-refs", dest="turn_refs", action="store_false",
                    help="skip the cold cache-off runs that check each turn's first token")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None, help="default bench/results/cache_gpu_h200.json (cpu: none)")
    args = ap.parse_args()
    args.add = [int(x) for x in args.add.split(",") if x]
    formats = [f for f in args.formats.split(",") if f] if args.device == "cuda" else ["cpu"]
    device = "cpu"
    if args.device == "cuda":
        import cupy as cp
        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
    print(f"device {device}, shape {args.shape}, context {args.context}, add {args.add}", flush=True)
    results: dict[str, Any] = {}
    for fmt in formats:
        print(f"[{fmt}] building", flush=True)
        t0 = time.perf_counter()
        model = make_model(fmt, args)
        cache_dir = Path(args.cache_dir) / fmt if args.cache_dir else Path(tempfile.mkdtemp(prefix="tandem-cache-"))
        if cache_dir.exists() and any(cache_dir.iterdir()):
            shutil.rmtree(cache_dir)  # a fresh disk tier for this model's signature
        try:
            b = Bench(model, args, args.device, fmt)
            results[fmt] = bench_format(b, cache_dir)
            results[fmt]["seconds"] = time.perf_counter() - t0
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
    ok = all(e["pass"] for r in results.values() for e in r["exact"])
    print("exactness:", "PASS" if ok else "FAIL")
    out = args.out or (str(ROOT / "bench" / "results" / "cache_gpu_h200.json") if args.device == "cuda" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"device": device, "command": " ".join(["python3"] + sys.argv),
                                         "shape": args.shape, "context": args.context, "add": args.add,
                                         "prefix_chunk": args.prefix_chunk, "exact": ok, "results": results},
                                        indent=1) + "\n")
        print("wrote", out)


if __name__ == "__main__":
    main()
