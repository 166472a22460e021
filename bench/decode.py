"""The engine's CUDA model (tandem/models/qwen3_5/cuda_model.py) on synthetic checkpoints of Qwen3.5-9B's and
-27B's shapes: decode, tree verify and prefill as the engine runs them.

Weights are random, generated on the device (never shipped): BF16, FP8 block-scaled (128×128) and NVFP4 (E2M1 +
E4M3 per 16 + fp32 global), projections of one input fused (gemv.concat, gemv.glu_pair) as the model does on
load. One decode step = embedding row, the layers (GDN ×3 then attention, repeated), final norm, head, argmax on
the device and the id to the host, as the engine's greedy loop (engine._run_ahead: each step is queued before the
host reads the id it consumes, the embedding reading it on the device).

Reports, per format: ms per token as the engine runs it (host wall time, Python launches; greedy, and sampled at
temperature 0.8, top-p 0.9 by the device sampler), the loop that reads
each id before launching the next step ("step_sync", the engine before run-ahead), the launches alone without
any id read ("no-sync": ten steps, one sync) and the kernels' own time (events around a
CUDA-graph replay of the same step: a measurement aid, the engine does not use graphs),
bytes read per step (weights as stored + GDN state read and written + KV rows read), achieved GB/s and its
fraction of the device-to-device copy bandwidth measured in the same run (bytes read + written), kernel launches
per step and per layer, the engine's verify time of 4/8/16/32-node trees over one decode step, the device time
of the step's projections for those row counts over 1 row (the matrix part of a verify), and TTFT of a 4k prompt.
With ``--contexts 1k,8k,32k,128k`` it reports instead, per format, decode and verify at each context, the bytes a
step reads (weights and KV at the state's dtype) and prefill at ``--prefills`` prompt lengths next to the
tensor-core peak measured in the same run (bench/decode_contexts.py).
Usage: python3 bench/decode.py [--shapes 9b,27b] [--formats bf16,fp8,nvfp4] [--ttft 4096] [--profile]
[--contexts 1k,8k,32k,128k [--prefills 4096,32768]] [--tp 2 [--tp-devices 0,1]] [--out FILE.json]. The MoE shapes
(--shapes 35b-a3b,80b-a3b) run bench/moe_decode.py's report; ``--tp N`` bench/tp_decode.py's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from tandem.backend.cuda import (argmax, attention_decode, attention_tree, embed, gdn_seq, gdn_step,  # noqa: E402
                                 gemv, plan, rms_norm, silu_mul)
from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model, _Attn, _GDN, _Layer  # noqa: E402
from tandem.models.qwen3_5.hparams import HParams  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from bench import decode_contexts, wgmma_peak  # noqa: E402

QWEN35_9B = dict(layers=32, hidden=4096, mlp=12288, vocab=248320, heads=16, kv_heads=4, head_dim=256,
                 gdn_k_heads=16, gdn_v_heads=32, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64)
QWEN35_27B = dict(layers=64, hidden=5120, mlp=17408, vocab=248320, heads=24, kv_heads=4, head_dim=256,
                  gdn_k_heads=16, gdn_v_heads=48, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64)
SHAPES = {"9b": QWEN35_9B, "27b": QWEN35_27B}
EPS = 1e-6
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1)  # a sampled decode: the sampler on the device
LAUNCHERS = (argmax, attention_decode, attention_tree, embed, gdn_seq, gdn_step, gemv, rms_norm, silu_mul)


class Counter:
    """Counts kernel launches by wrapping each launcher module's `kernel` lookup (one lookup = one launch)."""

    def __init__(self) -> None:
        self.count = 0
        for mod in LAUNCHERS:
            orig = mod.kernel

            def counted(stem: str, name: str, _orig: Any = orig) -> Any:
                self.count += 1
                return _orig(stem, name)

            mod.kernel = counted  # type: ignore[attr-defined]


class _TimedKernel:
    """A kernel whose every launch is bracketed by two events (appended to ``events`` with ``name``); any other
    attribute, read or set, is the kernel's own (loader.raise_smem_limit reads ``kernel.ptr`` and sets
    ``max_dynamic_shared_size_bytes``)."""

    def __init__(self, fn: Any, name: str, events: list[tuple[str, Any, Any]]) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_events", events)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        res = self._fn(*args, **kwargs)
        stop.record()
        self._events.append((self._name, start, stop))
        return res

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._fn, attr, value)


class KernelTimes:
    """Device time per kernel name over one step: each launch bracketed by two events (a profile, not a speed
    figure: the brackets add gaps). Installed over Counter's wrappers; `report()` syncs and sums in ms."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []
        self.on = False
        for mod in LAUNCHERS:
            orig = mod.kernel

            def timed(stem: str, name: str, _orig: Any = orig) -> Any:
                fn = _orig(stem, name)
                if not self.on:
                    return fn
                return _TimedKernel(fn, name, self.events)

            mod.kernel = timed  # type: ignore[attr-defined]

    def report(self) -> dict[str, list[float]]:
        cp.cuda.Device().synchronize()
        out: dict[str, list[float]] = {}
        for name, start, stop in self.events:
            entry = out.setdefault(name, [0.0, 0])
            entry[0] += cp.cuda.get_elapsed_time(start, stop)
            entry[1] += 1
        self.events = []
        return {k: [round(v[0], 4), int(v[1])] for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def make_linear(fmt: str, out_dim: int, in_dim: int) -> Any:
    """A random device Linear of the given format (values of a trained model's order of magnitude)."""
    if fmt == "bf16":
        w = cp.random.standard_normal((out_dim, in_dim), dtype=cp.float32) * np.float32(0.02)
        return gemv.CudaDenseLinear((w.view(cp.uint32) >> 16).astype(cp.uint16))
    if fmt == "fp8":
        codes = cp.random.randint(0, 256, (out_dim, in_dim), dtype=cp.uint8)
        codes = cp.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).astype(cp.uint8)  # no NaN codes
        grid = (-(-out_dim // 128), -(-in_dim // 128))
        return gemv.CudaFP8BlockLinear(codes, cp.random.uniform(1e-4, 2e-4, grid).astype(cp.float32))
    packed = cp.random.randint(0, 256, (out_dim, in_dim // 2), dtype=cp.uint8)
    scales = cp.random.randint(0x28, 0x38, (out_dim, in_dim // 16), dtype=cp.uint8)
    return gemv.CudaNVFP4Linear(packed, scales, 0.01)


def hparams(c: dict[str, int]) -> HParams:
    """HParams of a synthetic Qwen3.5 shape (every attn_every-th layer full attention)."""
    types = tuple("full_attention" if (i + 1) % c["attn_every"] == 0 else "linear_attention"
                  for i in range(c["layers"]))
    return HParams(vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                   intermediate_size=c["mlp"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                   head_dim=c["head_dim"], linear_num_key_heads=c["gdn_k_heads"],
                   linear_num_value_heads=c["gdn_v_heads"], linear_key_head_dim=c["gdn_dim"],
                   linear_value_head_dim=c["gdn_dim"], linear_conv_kernel_dim=c["conv_taps"], rms_norm_eps=EPS,
                   rope_theta=1e7, partial_rotary_factor=c["rotary_dim"] / c["head_dim"],
                   max_position_embeddings=262144, layer_types=types, tie_word_embeddings=False,
                   attn_output_gate=True, eos_token_ids=())


def build(fmt: str, c: dict[str, int], kv_dtype: str = "float32") -> CudaQwen3_5Model:
    """The engine's CUDA model over random device weights of shape `c` in format `fmt` (fused projections), its
    KV views stored as `kv_dtype` ("float32" or "bfloat16")."""
    e, f = c["hidden"], c["mlp"]
    hk, hv, dg = c["gdn_k_heads"], c["gdn_v_heads"], c["gdn_dim"]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    conv_dim = 2 * hk * dg + hv * dg
    ones = cp.ones(e, dtype=cp.float32)
    layers = []
    for i in range(c["layers"]):
        gate_up = gemv.glu_pair(make_linear(fmt, f, e), make_linear(fmt, f, e))
        mixer: Any
        if (i + 1) % c["attn_every"] == 0:
            mixer = _Attn(None, None, None, make_linear(fmt, e, h * d), cp.ones(d, cp.float32),
                          cp.ones(d, cp.float32),
                          proj=gemv.concat([make_linear(fmt, 2 * h * d, e), make_linear(fmt, hkv * d, e),
                                            make_linear(fmt, hkv * d, e)]))
        else:
            mixer = _GDN(None, None, None, None, make_linear(fmt, e, hv * dg),
                         cp.random.standard_normal((conv_dim, c["conv_taps"]), dtype=cp.float32) * 0.3,
                         cp.zeros(hv, cp.float32), cp.zeros(hv, cp.float32), cp.ones(dg, cp.float32),
                         proj=gemv.concat([make_linear(fmt, conv_dim, e), make_linear(fmt, hv * dg, e),
                                           make_linear(fmt, hv, e), make_linear(fmt, hv, e)]))
        layers.append(_Layer(ones, ones, mixer, None, None, make_linear(fmt, e, f), gate_up=gate_up))
        cp.get_default_memory_pool().free_all_blocks()
    embed = (cp.random.standard_normal((c["vocab"], e), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    model = CudaQwen3_5Model.from_parts(hparams(c), embed, ones, make_linear(fmt, c["vocab"], e), layers)
    model.kv_dtype = kv_dtype
    return model


def linears(m: CudaQwen3_5Model) -> list[Any]:
    """Every device Linear of the model (the fused ones once)."""
    out = [m.head]
    for lw in m.layers:
        out += [lw.mixer.proj, lw.gate_up, lw.down, lw.mixer.out if isinstance(lw.mixer, _GDN) else lw.mixer.o]
    return out


def bytes_per_step(m: CudaQwen3_5Model, c: dict[str, int], pos: int) -> int:
    """Weights as stored + embedding row + GDN state (read + written) + KV rows read (pos + 1 of each)."""
    total = sum(lin.bytes_per_use for lin in linears(m)) + 2 * c["hidden"]
    for lw in m.layers:
        if isinstance(lw.mixer, _GDN):
            total += 2 * c["gdn_v_heads"] * c["gdn_dim"] ** 2 * 4
        else:
            total += 2 * (pos + 1) * c["kv_heads"] * c["head_dim"] * 4
    return int(total)


def time_ms(fn: Any, reps: int) -> float:
    """Median over `reps` of one call's device time (events), after the caller's warm-up."""
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(statistics.median(times))


def copy_bandwidth_gbps() -> float:
    n = 4 << 30
    src = cp.random.randint(0, 256, n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    cp.copyto(dst, src)
    ms = time_ms(lambda: cp.copyto(dst, src), 10)
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * n / ms / 1e6


def gemv_rows_ms(m: CudaQwen3_5Model, rows: int) -> float:
    """Device time of every projection of one step (prepare + GEMV, weights read once) for `rows` rows of x:
    the matrix part of a `rows`-node verify."""
    lins = linears(m)
    xs_by_in = {}
    for lin in lins:
        key = (lin.shape[1], lin.prep_kind)
        if key not in xs_by_in:
            x = cp.random.standard_normal((rows, lin.shape[1]), dtype=cp.float32)
            xs_by_in[key] = gemv.prepare(x, lin.prep_kind)
    outs = {id(lin): cp.empty((rows, lin.shape[0] // 2 if lin.glu else lin.shape[0]), dtype=cp.float32)
            for lin in lins}

    def run() -> None:
        for lin in lins:
            lin.matmul_prepared(xs_by_in[(lin.shape[1], lin.prep_kind)], out=outs[id(lin)])

    run()
    return time_ms(run, 10)


def random_tree(n: int, seed: int) -> list[int]:
    """Parents of an n-node draft tree: each node hangs off one of the 3 nodes before it (chains and branches)."""
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]


def graph_decode_ms(m: Any, state: Any, fmt: str) -> float | None:
    """Device ms of one decode step's launches replayed as a CUDA graph (a measurement aid: the engine launches
    normally), the embedding row read from a fixed device id (no host copy); ``state`` is left at its length.
    None, with the reason printed, when the capture fails."""
    orig = m._embed
    try:
        ids = cp.asarray([7], dtype=cp.int64)
        m._embed = lambda _ids: (m.embed_bits[ids].astype(cp.uint32) << 16).view(cp.float32)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(2):
                m.decode(state, 7)
                state.length -= 1
            stream.synchronize()
            stream.begin_capture()
            m.decode(state, 7)
            graph = stream.end_capture()
            state.length -= 1
            graph.launch()
            stream.synchronize()
            return time_ms(lambda: graph.launch(), 20)
    except Exception as exc:  # a measurement aid; report why it failed
        print(f"{fmt}: graph capture failed: {exc!r}")
        return None
    finally:
        m._embed = orig


def wall_ms(fn: Any, reps: int) -> float:
    """Median host wall time of fn() including a device sync: what a caller of the engine waits."""
    times = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def bench_format(fmt: str, c: dict[str, int], counter: Counter, pos: int, rows: list[int],
                 times: KernelTimes | None, ttft: int) -> dict[str, Any]:
    m = build(fmt, c)
    state = m.new_state(max(pos, ttft) + 80)
    vocab = c["vocab"]
    prompt = np.random.default_rng(0).integers(0, vocab, pos).tolist()
    m.prefill(state, prompt)
    tok = [7]

    def step() -> None:  # decode, device argmax, the id to the host before the next step (the pre-run-ahead loop)
        logits = m.decode(state, tok[0])
        tok[0] = int(argmax.argmax(logits[None])[0]) % vocab
        state.length -= 1  # stay at `pos`: every timed step reads the same cache rows

    before = counter.count
    step()  # the state's first decode records its launch plan: every launch goes through the launchers once
    launches = counter.count - before
    for _ in range(3):
        step()
    step_sync = wall_ms(step, 10)
    first = m.decode(state, 7)
    state.length -= 1

    def steps_ahead(params: SamplingParams | None = None) -> None:
        """The engine's plain loop (engine._run_ahead): each step queued before its id is read."""
        pending = m.choose_on_device(state, first, params, 1, pos)
        for _ in range(10):
            follow = m.choose_on_device(state, m.decode(state, pending), params, 1, pos)
            state.length -= 1
            pending.get()
            pending = follow
        pending.get()

    steps_ahead()
    eager = wall_ms(steps_ahead, 5) / 10
    steps_ahead(SAMPLED)
    sampled = wall_ms(lambda: steps_ahead(SAMPLED), 5) / 10

    def steps_no_sync() -> None:  # the same launches, the id left on the device: what the host's per-step read costs
        for _ in range(10):
            logits = m.decode(state, 7)
            argmax.argmax(logits[None])
            state.length -= 1

    no_sync = wall_ms(steps_no_sync, 5) / 10
    profile = None
    if times is not None:  # through the launchers (a replayed plan bypasses them), the same kernels
        m._plannable_cache = False  # type: ignore[attr-defined]
        step()
        times.on = True
        step()
        times.on = False
        profile = times.report()
        m._plannable_cache = True  # type: ignore[attr-defined]
    graph_ms = graph_decode_ms(m, state, fmt)
    verify: dict[str, float] = {}
    verify_profile: dict[str, Any] = {}
    for n in rows:
        parents = random_tree(n, n)
        scratch = m.new_tree_scratch(n)
        ids_n = [int(t) for t in np.random.default_rng(n).integers(0, vocab, n)]
        m.verify_tree(state, scratch, ids_n, parents)
        verify[str(n)] = round(wall_ms(lambda: m.verify_tree(state, scratch, ids_n, parents), 5) / eager, 3)
        if times is not None:  # the same verify through the launchers, each kernel timed
            m._plannable_cache = False  # type: ignore[attr-defined]
            m.verify_tree(state, scratch, ids_n, parents)
            times.on = True
            m.verify_tree(state, scratch, ids_n, parents)
            times.on = False
            verify_profile[str(n)] = times.report()
            m._plannable_cache = True  # type: ignore[attr-defined]
    ttft_ms = None
    if ttft:
        long_state = m.new_state(ttft + 8)
        long = np.random.default_rng(1).integers(0, vocab, ttft).tolist()

        def prefill() -> None:
            long_state.length = 0
            m.prefill(long_state, long)

        prefill()
        ttft_ms = round(wall_ms(prefill, 3), 1)  # median of 3: a 27B prefill moves by up to 40 % run to run
    nbytes = bytes_per_step(m, c, pos)
    base = gemv_rows_ms(m, 1)
    ratios = {str(r): round(gemv_rows_ms(m, r) / base, 3) for r in rows}
    del m, state
    cp.get_default_memory_pool().free_all_blocks()
    best = graph_ms if graph_ms is not None else eager
    return {"ms_per_token_engine": round(eager, 4), "tok_per_s_engine": round(1e3 / eager, 1),
            "ms_per_token_engine_no_sync": round(no_sync, 4), "ms_per_token_step_sync": round(step_sync, 4),
            "ms_per_token_engine_sampled": round(sampled, 4),
            "ms_per_token_kernels": None if graph_ms is None else round(graph_ms, 4),
            "bytes_per_step": nbytes, "achieved_GBps_engine": round(nbytes / eager / 1e6, 1),
            "achieved_GBps_kernels": round(nbytes / best / 1e6, 1),
            "launches_per_step": launches, "launches_per_layer": round(launches / c["layers"], 2),
            "verify_over_decode_engine": verify, "gemv_ms_1_row": round(base, 4), "gemv_rows_over_1_row": ratios,
            f"ttft_ms_{ttft}": ttft_ms, "kernel_ms_count": profile,
            "verify_kernel_ms_count": verify_profile or None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,nvfp4")
    ap.add_argument("--pos", type=int, default=128, help="decode position (KV rows visible - 1)")
    ap.add_argument("--shapes", default="9b,27b")
    ap.add_argument("--rows", default="4,8,16,32", help="row counts for the verify-GEMV ratio")
    ap.add_argument("--profile", action="store_true", help="also time each kernel of one step (events)")
    ap.add_argument("--ttft", type=int, default=4096, help="prompt length of the TTFT measurement (0: skip)")
    ap.add_argument("--wide", default="", help="verify kernels to use instead of gemv.WGMMA's / gemv.WIDE's, comma "
                    "list of FMT:LO-HI=VARIANT (MMA column tiles LO..HI), e.g. nvfp4:3-8=_p4n4s2 (a class-major or "
                    "warpgroup variant goes in WGMMA, another in WIDE and takes those tiles out of WGMMA and "
                    "gemv.WIDE_SMALL)")
    ap.add_argument("--resnorm-pf", default=None, help="comma list of formats whose residual + norm GEMV takes the "
                    "register-prefetch kernel (gemv.RESNORM_PF; default: as the module has it; \"\": none)")
    ap.add_argument("--contexts", default="", help="decode / verify at these contexts instead, e.g. 1k,8k,32k,128k "
                    "(with prefill at --prefills next to the tensor-core peak)")
    ap.add_argument("--prefills", default="4096,32768", help="prompt lengths of the --contexts prefill figures")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="--contexts: the model's KV storage")
    ap.add_argument("--split-decode", default="", help="--contexts: attention_decode.SPLIT_DECODE_MIN_CHUNKS values "
                    "to run each format at, comma list, 'none' = off (default: the module's); the first keeps the "
                    "format's key, the others are reported as FORMAT|splitN")
    ap.add_argument("--decode-attention", default="", help="--contexts: CudaQwen3_5Model.DECODE_ATTENTION values to "
                    "run each format at, comma list of cuda_cores, tensor_cores (bf16 KV; default: the class's); the "
                    "first keeps the format's key, the others are reported as FORMAT|tensor_cores")
    ap.add_argument("--tp", type=int, default=1, help="decode over a tensor-parallel mesh of N ranks against one "
                    "GPU instead (bench/tp_decode.py)")
    ap.add_argument("--tp-devices", default="", help="--tp: the ranks' GPUs, e.g. 0,1 (default 0..N-1; one GPU "
                    "repeated runs the ranks in turn on it)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.resnorm_pf is not None:
        gemv.RESNORM_PF = tuple(filter(None, args.resnorm_pf.split(",")))
    for item in filter(None, args.wide.split(",")):
        fmt, rest = item.split(":")
        span, variant = rest.split("=")
        lo, _, hi = span.partition("-")
        for tiles in range(int(lo), int(hi or lo) + 1):
            if gemv.is_cm(variant):
                gemv.WGMMA.setdefault(fmt, {})[tiles] = variant
            else:
                gemv.WIDE[fmt][tiles] = variant
                gemv.WGMMA.get(fmt, {}).pop(tiles, None)
                gemv.WIDE_SMALL.get(fmt, {}).pop(tiles, None)  # the override holds for every out dim
    counter = Counter() if not args.contexts else None  # --contexts: the launchers as the engine has them
    times = KernelTimes() if args.profile and not args.contexts else None
    t0 = time.time()
    copy_gbps = copy_bandwidth_gbps()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    pdl = plan.pdl_launcher() is not None
    result: dict[str, Any] = {"device": name, "command": "python3 bench/decode.py " + " ".join(sys.argv[1:]),
                              "pos": args.pos, "copy_GBps": round(copy_gbps, 1), "pdl": pdl, "wide": gemv.WIDE,
                              "wide_small": {"out_max": gemv.WIDE_SMALL_OUT, "variants": gemv.WIDE_SMALL},
                              "wgmma": gemv.WGMMA if gemv.wgmma_available() else {},
                              "shapes": {}}
    print(f"device {name}: copy {copy_gbps:.0f} GB/s (read + written); replays with PDL: {pdl}")
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.tp > 1:
        from bench import tp_decode

        devices = [int(d) for d in args.tp_devices.split(",") if d] or list(range(args.tp))
        tp_decode.run({s: SHAPES[s] for s in args.shapes.split(",")}, args.formats.split(","), args.tp, devices,
                      args.kv_dtype, result)
        result["wall_s"] = round(time.time() - t0, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    if args.contexts:
        long_contexts(args, result, copy_gbps, rows)
        return
    from bench import moe_decode

    moe_shapes = [s for s in args.shapes.split(",") if s in moe_decode.SHAPES]
    if moe_shapes:
        moe_decode.run(moe_shapes, args.formats.split(","), args.pos, rows, copy_gbps, result, lambda: args.out and
                       Path(args.out).write_text(json.dumps(result, indent=2) + "\n"))
    for shape in [s for s in args.shapes.split(",") if s not in moe_decode.SHAPES]:
        c = SHAPES[shape]
        res: dict[str, Any] = {"config": c, "formats": {}}
        result["shapes"][shape] = res
        for fmt in args.formats.split(","):
            assert counter is not None
            r = bench_format(fmt, c, counter, args.pos, rows, times, args.ttft)
            r["fraction_of_copy_engine"] = round(r["achieved_GBps_engine"] / copy_gbps, 3)
            r["fraction_of_copy_kernels"] = round(r["achieved_GBps_kernels"] / copy_gbps, 3)
            res["formats"][fmt] = r
            print(f"{shape} {fmt:6s} engine {r['ms_per_token_engine']:.3f} ms/tok ({r['tok_per_s_engine']} tok/s, "
                  f"{100 * r['fraction_of_copy_engine']:.0f}% of copy)  kernels {r['ms_per_token_kernels']} ms "
                  f"({100 * r['fraction_of_copy_kernels']:.0f}%)  no-sync {r['ms_per_token_engine_no_sync']} ms  "
                  f"step-sync {r['ms_per_token_step_sync']} ms  sampled (T 0.8, top-p 0.9) "
                  f"{r['ms_per_token_engine_sampled']} ms  "
                  f"{r['bytes_per_step'] / 1e9:.2f} GB/step  "
                  f"{r['launches_per_step']} launches ({r['launches_per_layer']}/layer)  verify/decode "
                  f"{r['verify_over_decode_engine']}  gemv rows/1-row {r['gemv_rows_over_1_row']}  "
                  f"TTFT({args.ttft}) {r[f'ttft_ms_{args.ttft}']} ms", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def long_contexts(args: Any, result: dict[str, Any], copy_gbps: float, rows: list[int]) -> None:
    """The --contexts report (bench/decode_contexts.py) of every shape and format into result (and --out)."""
    ctxs = decode_contexts.parse_tokens(args.contexts)
    lengths = decode_contexts.parse_tokens(args.prefills)
    peak = wgmma_peak.peak_tflops()
    print(f"tensor-core peak (bench/wgmma_peak.py, dense fp16 / bf16, measured now): {peak:.0f} TFLOPS", flush=True)
    result.update(contexts=ctxs, prefills=lengths, peak_tflops=round(peak, 1), kv_dtype=args.kv_dtype)
    from tandem.backend.cuda import attention_decode

    splits = [None if v.strip().lower() == "none" else int(v) for v in args.split_decode.split(",") if v.strip()] \
        or [attention_decode.SPLIT_DECODE_MIN_CHUNKS]
    paths = [v.strip() for v in args.decode_attention.split(",") if v.strip()] or [CudaQwen3_5Model.DECODE_ATTENTION]
    if any(v not in ("cuda_cores", "tensor_cores") for v in paths):
        raise SystemExit(f"--decode-attention: cuda_cores or tensor_cores, got {args.decode_attention}")
    t0 = time.time()
    for shape in args.shapes.split(","):
        c = SHAPES[shape]
        res: dict[str, Any] = {"config": c, "formats": {}}
        result["shapes"][shape] = res
        for fmt in args.formats.split(","):
            print(f"{shape} {fmt}:", flush=True)
            m = build(fmt, c, args.kv_dtype)
            lins = linears(m)
            for split, path in [(s, a) for s in splits for a in paths]:  # the same model at each setting
                attention_decode.SPLIT_DECODE_MIN_CHUNKS = split
                m.DECODE_ATTENTION = path  # this instance; contexts() makes new states, so new plans
                print(f"  {path}, " + (f"split decode from {split} chunks" if split is not None else
                                       "split decode off"), flush=True)
                r = decode_contexts.contexts(m, lins, ctxs, rows, copy_gbps, random_tree)
                r["split_decode_min_chunks"], r["decode_attention"] = split, path
                first = split == splits[0] and path == paths[0]
                if first:
                    r["prefill"] = decode_contexts.prefills(m, lins, lengths, peak) if lengths else {}
                key = fmt if first else fmt + (f"|split{split}" if split != splits[0] else "") + \
                    (f"|{path}" if path != paths[0] else "")
                res["formats"][key] = r
            attention_decode.SPLIT_DECODE_MIN_CHUNKS = splits[0]
            del m, lins
            cp.get_default_memory_pool().free_all_blocks()
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
