"""The CUDA MoE model (tandem/models/qwen3_5_moe/cuda_model.py) on synthetic checkpoints of Qwen3.5-35B-A3B's and
Qwen3-Next-80B-A3B's shapes (spec/qwen3_5.md §1.2): decode and tree verify as the engine runs them.

Weights are random, generated on the device (bench/decode.py make_linear): attention, GDN, routed experts and the
shared expert in the format under test, the router and shared-expert gate BF16 (as the FP8 / NVFP4 releases keep
them), embedding and head BF16. Reports, per format: ms a token as the engine runs it (greedy, each step queued
before its id is read) and the kernels' time (a CUDA-graph replay of one step, a measurement aid), the bytes a step
actually reads (the k chosen experts' weights + the shared expert + router + attention / GDN weights + GDN state +
KV rows + head + embedding row) and their rate as a fraction of the device-to-device copy bandwidth (read + written,
measured in the same run), and the engine's verify of 4/8/16-node trees over one decode step with the measured
distinct experts a layer (and the bytes those experts add); one step's kernels timed one by one (``kernel_ms_count``:
ms and launches per kernel name) and the launches a layer they add up to.
Run through bench/decode.py: python3 bench/decode.py --shapes 35b-a3b,80b-a3b [--formats fp8,nvfp4,nvfp4:separate]
[--rows 4,8,16] [--out F.json] (FMT:separate: the shared expert in launches of its own instead of stacked).
"""

from __future__ import annotations

import statistics
from typing import Any

import cupy as cp
import numpy as np

from bench import decode as dense
from tandem.backend.cuda import gemv, moe, operand
from tandem.models.qwen3_5.cuda_layers import _Attn, _GDN, _Layer
from tandem.models.qwen3_5_moe.cuda_model import CudaQwen3_5MoeModel

QWEN35_35B_A3B = dict(layers=40, hidden=2048, mlp=512, vocab=248320, heads=16, kv_heads=2, head_dim=256,
                      gdn_k_heads=16, gdn_v_heads=32, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64,
                      experts=256, top_k=8, moe_mlp=512, shared_mlp=512)
QWEN3_NEXT_80B_A3B = dict(layers=48, hidden=2048, mlp=512, vocab=151936, heads=16, kv_heads=2, head_dim=256,
                          gdn_k_heads=16, gdn_v_heads=32, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64,
                          experts=512, top_k=10, moe_mlp=512, shared_mlp=512)
SHAPES = {"35b-a3b": QWEN35_35B_A3B, "80b-a3b": QWEN3_NEXT_80B_A3B}


def build(fmt: str, c: dict[str, int], stacked: bool = True) -> CudaQwen3_5MoeModel:
    """The CUDA MoE model over random device weights of shape ``c``: every layer sparse (experts stacked as
    moe.upload_experts stacks them; the shared expert as expert X with ``stacked``, as the model loads the releases'
    shapes, else in launches of its own), projections fused as on load."""
    e, x, i, s = c["hidden"], c["experts"], c["moe_mlp"], c["shared_mlp"]
    hk, hv, dg = c["gdn_k_heads"], c["gdn_v_heads"], c["gdn_dim"]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    conv_dim = 2 * hk * dg + hv * dg
    ones = cp.ones(e, dtype=cp.float32)
    mk = dense.make_linear
    layers = []
    for li in range(c["layers"]):
        mixer: Any
        if (li + 1) % c["attn_every"] == 0:
            mixer = _Attn(None, None, None, mk(fmt, e, h * d), cp.ones(d, cp.float32), cp.ones(d, cp.float32),
                          proj=gemv.concat([mk(fmt, 2 * h * d, e), mk(fmt, hkv * d, e), mk(fmt, hkv * d, e)]))
        else:
            mixer = _GDN(None, None, None, None, mk(fmt, e, hv * dg),
                         cp.random.standard_normal((conv_dim, c["conv_taps"]), dtype=cp.float32) * 0.3,
                         cp.zeros(hv, cp.float32), cp.zeros(hv, cp.float32), cp.ones(dg, cp.float32),
                         proj=gemv.concat([mk(fmt, conv_dim, e), mk(fmt, hv * dg, e), mk(fmt, hv, e),
                                           mk(fmt, hv, e)]))
        stored = x + int(stacked)
        gate_up = gemv.glu_pair(mk(fmt, stored * i, e), mk(fmt, stored * i, e))
        cp.get_default_memory_pool().free_all_blocks()
        down = mk(fmt, stored * e, i)
        if stacked:
            ffn = moe.CudaMoE(mk("bf16", x + 1, e), None, x, c["top_k"], True, gate_up, down, None, None, None, None,
                              stacked=True)
        else:
            ffn = moe.CudaMoE(mk("bf16", x + 1, e), None, x, c["top_k"], True, gate_up, down,
                              gemv.glu_pair(mk(fmt, s, e), mk(fmt, s, e)), None, None, mk(fmt, e, s))
        layers.append(_Layer(ones, ones, mixer, None, None, moe.MoEDelta(e), gate_up=ffn))
        cp.get_default_memory_pool().free_all_blocks()
    embed = (cp.random.standard_normal((c["vocab"], e), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    hp = dense.hparams({**c, "mlp": c["moe_mlp"]})
    return CudaQwen3_5MoeModel.from_parts(hp, embed, ones, mk("bf16", c["vocab"], e), layers)


def step_bytes(m: CudaQwen3_5MoeModel, c: dict[str, int], pos: int, experts_per_layer: float | None = None) -> int:
    """Bytes one step reads: every Linear but the routed experts, ``experts_per_layer`` (default k) experts' weights
    a layer, the embedding row, GDN state (read + written), KV rows (pos + 1 of each attention layer)."""
    total = int(m.head.bytes_per_use) + 2 * c["hidden"]
    for lw in m.layers:
        ffn = lw.gate_up
        mx = lw.mixer
        total += int(mx.proj.bytes_per_use) + int((mx.out if isinstance(mx, _GDN) else mx.o).bytes_per_use)
        total += ffn.shared_bytes + int(round((experts_per_layer or ffn.top_k) * ffn.expert_bytes))
        if isinstance(mx, _GDN):
            total += 2 * c["gdn_v_heads"] * c["gdn_dim"] ** 2 * 4
        else:
            total += 2 * (pos + 1) * c["kv_heads"] * c["head_dim"] * 4
    return int(total)


def distinct_experts(m: CudaQwen3_5MoeModel, fn: Any) -> float:
    """Mean distinct experts a layer over one unplanned call of ``fn`` (the route tables read back)."""
    tables: list[Any] = []
    orig = moe.route

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        tables.append(out[0])
        return out

    moe.route = spy  # type: ignore[assignment]
    m._plannable_cache = False  # type: ignore[attr-defined]
    try:
        fn()
    finally:
        moe.route = orig  # type: ignore[assignment]
        m._plannable_cache = None  # type: ignore[attr-defined]
    counts = []
    for t in tables:
        host = cp.asnumpy(t)
        counts.append(len(np.unique(host[:host.size // 5])))
    return float(statistics.mean(counts)) if counts else 0.0


def bench_format(fmt: str, c: dict[str, int], pos: int, rows: list[int], copy_gbps: float,
                 stacked: bool = True, times: Any = None) -> dict[str, Any]:
    m = build(fmt, c, stacked)
    vocab = c["vocab"]
    state = m.new_state(pos + 80)
    m.prefill(state, np.random.default_rng(0).integers(0, vocab, pos).tolist())
    first = m.decode(state, 7)
    state.length -= 1

    def steps_ahead() -> None:  # the engine's plain loop (engine._run_ahead): each step queued before its id is read
        pending = m.choose_on_device(state, first, None, 1, pos)
        for _ in range(10):
            follow = m.choose_on_device(state, m.decode(state, pending), None, 1, pos)
            state.length -= 1
            pending.get()
            pending = follow
        pending.get()

    steps_ahead()
    eager = dense.wall_ms(steps_ahead, 5) / 10
    graph_ms = dense.graph_decode_ms(m, state, fmt)
    profile = None
    if times is not None:  # each kernel of one step through the launchers (events around each: a profile)
        m._plannable_cache = False  # type: ignore[attr-defined]
        m.decode(state, 7)
        state.length -= 1
        times.on = True
        m.decode(state, 7)
        times.on = False
        state.length -= 1
        profile = times.report()
        m._plannable_cache = None  # type: ignore[attr-defined]
    nbytes = step_bytes(m, c, pos)
    verify: dict[str, Any] = {}
    for n in rows:
        parents = dense.random_tree(n, n)
        scratch = m.new_tree_scratch(n)
        ids_n = [int(t) for t in np.random.default_rng(n).integers(0, vocab, n)]
        m.verify_tree(state, scratch, ids_n, parents)
        ms = dense.wall_ms(lambda: m.verify_tree(state, scratch, ids_n, parents), 5)
        dist = distinct_experts(m, lambda: m.verify_tree(state, scratch, ids_n, parents))
        verify[str(n)] = {"ms": round(ms, 4), "over_decode": round(ms / eager, 3), "distinct_experts": round(dist, 1),
                          "expected_uniform": round(c["experts"] * (1 - (1 - c["top_k"] / c["experts"]) ** n), 1),
                          "bytes": step_bytes(m, c, pos, dist)}
    routing = m.capabilities.expert_routing
    del m, state
    cp.get_default_memory_pool().free_all_blocks()
    best = graph_ms if graph_ms is not None else eager
    return {"ms_per_token_engine": round(eager, 4), "tok_per_s_engine": round(1e3 / eager, 1),
            "ms_per_token_kernels": None if graph_ms is None else round(graph_ms, 4),
            "bytes_per_step": nbytes, "fraction_of_copy_engine": round(nbytes / eager / 1e6 / copy_gbps, 3),
            "fraction_of_copy_kernels": round(nbytes / best / 1e6 / copy_gbps, 3), "verify": verify,
            "expert_routing": routing, "kernel_ms_count": profile,
            "launches_per_layer": None if profile is None else
            round(sum(count for _, count in profile.values()) / c["layers"], 2)}


def run(shapes: list[str], formats: list[str], pos: int, rows: list[int], copy_gbps: float,
        result: dict[str, Any], save: Any) -> None:
    """Bench every (shape, format) pair into result["shapes"][shape] (save() after each); BF16 is skipped for a shape
    whose BF16 experts do not fit the device. Each format's report holds one step's kernels timed one by one."""
    dense.LAUNCHERS = dense.LAUNCHERS + (moe, operand)
    times = dense.KernelTimes()
    for shape in shapes:
        c = SHAPES[shape]
        res: dict[str, Any] = {"config": c, "formats": {}}
        result["shapes"][shape] = res
        for name in formats:  # FMT, or FMT:separate (the shared expert in launches of its own)
            fmt, _, mode = name.partition(":")
            if fmt == "bf16" and c["layers"] * c["experts"] * 3 * c["moe_mlp"] * c["hidden"] * 2 > 100e9:
                res["formats"][name] = "skipped: BF16 experts exceed the device memory"
                continue
            r = bench_format(fmt, c, pos, rows, copy_gbps, stacked=mode != "separate", times=times)
            res["formats"][name] = r
            print(f"{shape} {name:6s} engine {r['ms_per_token_engine']:.3f} ms/tok ({r['tok_per_s_engine']} tok/s, "
                  f"{100 * r['fraction_of_copy_engine']:.0f}% of copy)  kernels {r['ms_per_token_kernels']} ms "
                  f"({100 * r['fraction_of_copy_kernels']:.0f}%)  {r['bytes_per_step'] / 1e9:.3f} GB/step  "
                  f"launches/layer {r['launches_per_layer']}  verify {r['verify']}", flush=True)
            print(f"  kernels (ms, launches) {r['kernel_ms_count']}", flush=True)
            save()
