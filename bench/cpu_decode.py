"""CPU decode benchmark of the NumPy reference: tok/s, ms/token and the fraction of memory bandwidth it reaches.

A decode step must at least read every weight once (each Linear's ``bytes_per_use``, the head included), the
embedding row, the attention KV rows up to the position (each attention layer, K and V), and read + write each
GDN layer's recurrent state and conv tail. That byte count over the step time is compared with this machine's
memory-copy bandwidth measured in the same run (np.copyto of a 512 MiB float32 array, read + write bytes, best of
several). Also timed: the GEMVs alone (np.dot of every weight, as Linear.matmul calls it), to split the step into
weight streaming and everything else (Python, small ops, attention, GDN state).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/cpu_decode.py [--model PATH] [--tokens 256]
        [--json bench/results/cpu_decode_<host>.json]

Not a test: never run in CI timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.formats import Linear  # noqa: E402
from tandem.models.qwen3_5.hparams import FULL  # noqa: E402
from tandem.models.qwen3_5.model import Qwen3_5Model  # noqa: E402
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights  # noqa: E402
from tools.make_checkpoint import write_checkpoint  # noqa: E402

# ~240 MB of float32 weights read per step (L3 here is 32 MiB): E=1024, 4 layers (3 GDN + 1 attention), F=2048.
SYNTHETIC = dict(hidden_size=1024, num_hidden_layers=4, intermediate_size=2048, vocab_size=16384,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
                 linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                 max_position_embeddings=8192, with_vision=False, with_mtp=False, num_shards=1, init_std=0.02)


def copy_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Best read+write bytes/s of np.copyto over a float32 array of ``num_bytes``."""
    src = np.ones(num_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def linears(model: Qwen3_5Model) -> list[Linear]:
    """Every Linear a decode step multiplies by, the head included."""
    out: list[Linear] = []
    for lw in model.weights.layers:
        m = lw.mixer
        if isinstance(m, GDNWeights):
            out += [m.in_qkv, m.in_z, m.in_b, m.in_a, m.out]
        else:
            assert isinstance(m, AttnWeights)
            out += [m.q, m.k, m.v, m.o]
        out += [lw.mlp.gate, lw.mlp.up, lw.mlp.down]
    return out + [model.head]


def step_bytes(model: Qwen3_5Model, position: float) -> dict[str, float]:
    """Bytes a decode step at ``position`` must move, by kind."""
    hp = model.hp
    weights = sum(lin.bytes_per_use for lin in linears(model))
    embed_row = hp.hidden_size * 4
    num_attn = sum(1 for k in hp.layer_types if k == FULL)
    kv = num_attn * 2 * (position + 1) * hp.num_key_value_heads * hp.head_dim * 4
    gdn_state = (hp.linear_num_value_heads * hp.linear_key_head_dim * hp.linear_value_head_dim
                 + (hp.linear_conv_kernel_dim - 1) * hp.conv_dim) * 4
    gdn = (len(hp.layer_types) - num_attn) * 2 * gdn_state  # read + written
    return {"weights": weights, "embed_row": embed_row, "kv_rows": kv, "gdn_state_rw": gdn,
            "total": weights + embed_row + kv + gdn}


def gemv_only_s(model: Qwen3_5Model, repeats: int = 5) -> float:
    """Best time of one np.dot per Linear (the GEMVs of a step with nothing else)."""
    mats = [(lin.weight, np.random.default_rng(0).standard_normal(lin.shape[1]).astype(np.float32),  # type: ignore[attr-defined]
             np.empty(lin.shape[0], np.float32)) for lin in linears(model)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w, x, y in mats:
            np.dot(w, x, out=y)
        best = min(best, time.perf_counter() - t0)
    return best


def environment() -> dict[str, Any]:
    env = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                                          "OMP_NUM_THREADS")}
    info: dict[str, Any] = {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                            "cpus": os.cpu_count(), "numpy": np.__version__, "env": env}
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-not-found]

        info["threadpools"] = threadpool_info()
    except ImportError:
        info["threadpools"] = "threadpoolctl not installed"
    return info


def run(model_path: Path, tokens: int, warmup: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = Qwen3_5Model.load(model_path)
    load_s = time.perf_counter() - t0
    prompt = list(range(1, 17))
    state = model.new_state(len(prompt) + warmup + tokens)
    logits = model.prefill(state, prompt)
    tok = int(np.argmax(logits))
    for _ in range(warmup):
        tok = int(np.argmax(model.decode(state, tok)))
    start_pos = state.length
    times = np.empty(tokens)
    for i in range(tokens):
        t = time.perf_counter()
        tok = int(np.argmax(model.decode(state, tok)))
        times[i] = time.perf_counter() - t
    bw = copy_bandwidth()
    moved = step_bytes(model, start_pos + tokens / 2)
    step_s = float(np.median(times))
    gemv_s = gemv_only_s(model)
    return {
        "model": str(model_path), "load_s": load_s, "tokens": tokens, "warmup": warmup,
        "positions": [start_pos, start_pos + tokens],
        "layer_types": list(model.hp.layer_types), "hidden_size": model.hp.hidden_size,
        "intermediate_size": model.hp.intermediate_size, "vocab_size": model.hp.vocab_size,
        "ms_per_token_median": step_s * 1e3, "ms_per_token_mean": float(times.mean()) * 1e3,
        "ms_per_token_min": float(times.min()) * 1e3, "tokens_per_s": 1.0 / step_s,
        "bytes_per_step": moved, "achieved_GBps": moved["total"] / step_s / 1e9,
        "copy_bandwidth_GBps": bw / 1e9, "fraction_of_copy_bandwidth": moved["total"] / step_s / bw,
        "fraction_of_copy_bandwidth_best_step": moved["total"] / float(times.min()) / bw,
        "gemv_only_ms": gemv_s * 1e3, "gemv_only_GBps": moved["weights"] / gemv_s / 1e9,
        "gemv_only_fraction": moved["weights"] / gemv_s / bw, "non_gemv_ms": (step_s - gemv_s) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: a synthetic one)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    info = environment()
    print(f"host {info['host']}, {info['cpus']} CPUs, numpy {info['numpy']}, env {info['env']}")
    print(f"threadpools: {info['threadpools']}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = write_checkpoint(Path(tmp) / "synthetic", **SYNTHETIC)  # type: ignore[arg-type]
        res = run(path, args.tokens, args.warmup)
    res["config"] = "synthetic " + json.dumps(SYNTHETIC) if args.model is None else str(args.model)
    res.update(info)
    b = res["bytes_per_step"]
    print(f"decode: {res['tokens_per_s']:.1f} tok/s, {res['ms_per_token_median']:.2f} ms/token (median over "
          f"{args.tokens}; mean {res['ms_per_token_mean']:.2f}, min {res['ms_per_token_min']:.2f})")
    print(f"bytes/step: {b['total'] / 1e6:.1f} MB (weights {b['weights'] / 1e6:.1f}, KV {b['kv_rows'] / 1e6:.2f}, "
          f"GDN state r+w {b['gdn_state_rw'] / 1e6:.2f}, embed row {b['embed_row'] / 1e3:.1f} kB)")
    print(f"achieved {res['achieved_GBps']:.2f} GB/s = {100 * res['fraction_of_copy_bandwidth']:.1f} % of "
          f"np.copyto bandwidth {res['copy_bandwidth_GBps']:.2f} GB/s (best step: "
          f"{100 * res['fraction_of_copy_bandwidth_best_step']:.1f} %)")
    print(f"GEMVs alone: {res['gemv_only_ms']:.2f} ms ({res['gemv_only_GBps']:.2f} GB/s, "
          f"{100 * res['gemv_only_fraction']:.1f} %); the rest of the step: {res['non_gemv_ms']:.2f} ms")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
