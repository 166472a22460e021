"""bench/decode.py --contexts: decode and tree verify at long contexts, and prefill next to the tensor-core peak.

For one model (bench/decode.py `build`), at each context C (KV rows visible to the step):
- decode: ms a token in the engine's run-ahead loop (engine._run_ahead; greedy, device argmax), the state held
  at C (every timed step writes row C-1 and reads rows 0..C-1);
- verify: ms of the engine's verify of N-node draft trees rooted at position C (`--rows`);
- bytes a step reads: weights as stored + embedding row + every section of the state read and written (GDN state
  and conv tail) + C rows of every view (K and V), each at the state's own dtype (read from the state's buffers,
  so a bf16 KV cache counts 2 bytes an element); the KV share, GB/s and the fraction of the copy bandwidth.
The KV rows are filled with random values instead of prefilled (a 128k prefill takes a minute a format): a step's
time does not depend on them. Prefill: wall time of the engine's prefill of P-token prompts (`--prefills`), its
tok/s and TFLOPS (2 · weights' multiply-adds a token of every projection except the head, which runs for the last
token only, + the causal attention's 2 · H · D · P² a layer) as a fraction of the dense bf16 tensor-core peak
measured in the same run (bench/wgmma_peak.py `peak_tflops`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cupy as cp


def parse_tokens(spec: str) -> list[int]:
    """"1k,8k,32k,128k" → [1024, 8192, 32768, 131072] (a plain number is tokens)."""
    out = []
    for item in filter(None, (s.strip().lower() for s in spec.split(","))):
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def _wall_ms(fn: Any, reps: int) -> float:
    """bench/decode.py's ``wall_ms`` (imported at call time: bench/decode.py imports this module at its top)."""
    from bench.decode import wall_ms

    return wall_ms(fn, reps)


def state_bytes(state: Any, rows: int) -> tuple[int, int]:
    """(sections' bytes read + written, views' bytes over `rows` rows) of a state, at its buffers' dtypes."""
    sections = views = 0
    for spec in state.specs:
        buf = state.buffers[spec.name]
        if spec.kind == "view":
            views += int(buf.nbytes) // int(buf.shape[0]) * rows
        else:
            sections += 2 * int(buf.nbytes)
    return sections, views


def fill_views(state: Any, rows: int) -> None:
    """Random rows 0..rows-1 in every view of the state (float32 / float16 values, or bf16 bits in uint16)."""
    for spec in state.specs:
        if spec.kind != "view":
            continue
        buf = state.buffers[spec.name]
        for start in range(0, rows, 8192):
            piece = buf[start:min(rows, start + 8192)]
            x = cp.random.standard_normal(piece.shape, dtype=cp.float32) * np.float32(0.5)
            if piece.dtype == cp.uint16:  # bf16 bits
                piece[...] = (x.view(cp.uint32) >> 16).astype(cp.uint16)
            else:
                piece[...] = x.astype(piece.dtype)


def _decode_ms(m: Any, state: Any, ctx: int) -> float:
    """The engine's run-ahead greedy loop at context ctx: ms a token over 10 steps (median of 5)."""
    state.length = ctx - 1
    first = m.decode(state, 7)
    state.length -= 1

    def steps() -> None:
        pending = m.choose_on_device(state, first, None, 1, ctx - 1)
        for _ in range(10):
            follow = m.choose_on_device(state, m.decode(state, pending), None, 1, ctx - 1)
            state.length -= 1
            pending.get()
            pending = follow
        pending.get()

    steps()
    return _wall_ms(steps, 5) / 10


def _verify_ms(m: Any, state: Any, scratch: Any, ctx: int, parents: list[int]) -> float:
    """The engine's verify of a tree (parents) rooted at position ctx: ms (median of 5, after one)."""
    n = len(parents)
    ids = [int(t) for t in np.random.default_rng(n).integers(0, int(m.hp.vocab_size), n)]
    state.length = ctx
    m.verify_tree(state, scratch, ids, parents)
    return _wall_ms(lambda: m.verify_tree(state, scratch, ids, parents), 5)


def weight_bytes(linears: list[Any], hidden: int) -> int:
    """Weights as stored a step reads (each Linear once) + the embedding row (BF16)."""
    return sum(int(lin.bytes_per_use) for lin in linears) + 2 * hidden


def contexts(m: Any, linears: list[Any], ctxs: list[int], rows: list[int], copy_gbps: float,
             tree: Any) -> dict[str, Any]:
    """Decode and verify at each context of `ctxs` (verify trees of `rows` nodes, parents from tree(n, seed)); see
    the module docstring. Returns {"kv_dtypes": the views' dtypes, "contexts": {str(C): figures}}."""
    top = max(ctxs)
    state = m.new_state(top + max(rows, default=1) + 8)
    fill_views(state, top)
    wbytes = weight_bytes(linears, int(m.hp.hidden_size))
    scratches = {n: m.new_tree_scratch(n) for n in rows}  # one per size: its recorded verify plans serve every C
    out: dict[str, Any] = {}
    for ctx in ctxs:
        sections, kv = state_bytes(state, ctx)
        nbytes = wbytes + sections + kv
        ms = _decode_ms(m, state, ctx)
        verify = {str(n): round(_verify_ms(m, state, scratches[n], ctx, tree(n, n)), 3) for n in rows}
        gbps = nbytes / ms / 1e6
        out[str(ctx)] = {"decode_ms": round(ms, 4), "decode_tok_per_s": round(1e3 / ms, 1),
                         "verify_ms": verify, "bytes_per_step": nbytes, "kv_bytes_per_step": kv,
                         "kv_share": round(kv / nbytes, 3), "achieved_GBps": round(gbps, 1),
                         "fraction_of_copy": round(gbps / copy_gbps, 3)}
        print(f"  context {ctx:>6}: decode {ms:.3f} ms ({1e3 / ms:.1f} tok/s), verify ms {verify}, "
              f"{nbytes / 1e9:.2f} GB/step (KV {100 * kv / nbytes:.0f}%), {gbps:.0f} GB/s "
              f"({100 * gbps / copy_gbps:.0f}% of copy)", flush=True)
    state.length = 0
    del scratches
    kv_dtypes = sorted({str(state.buffers[s.name].dtype) for s in state.specs if s.kind == "view"})
    del state
    cp.get_default_memory_pool().free_all_blocks()
    return {"kv_dtypes": kv_dtypes, "contexts": out}


def prefill_flops(m: Any, linears: list[Any], tokens: int) -> float:
    """Multiply-add FLOPs of a `tokens`-token prefill: 2 · in · out a token of every projection (the head once, for
    the last token) + 2 · H · D · P² a full-attention layer (QKᵀ and PV over the causal half)."""
    head = linears[0]
    per_token = sum(2 * lin.shape[0] * lin.shape[1] for lin in linears[1:])
    hp = m.hp
    attn_layers = sum(1 for t in hp.layer_types if t == "full_attention")
    attn = attn_layers * 2 * hp.num_attention_heads * hp.head_dim * tokens * tokens
    return float(per_token * tokens + 2 * head.shape[0] * head.shape[1] + attn)


def prefills(m: Any, linears: list[Any], lengths: list[int], peak_tflops: float) -> dict[str, Any]:
    """Wall time of the engine's prefill of each prompt length (a warm-up at the shortest first; median of 3 up to
    8k tokens, one run above), tok/s and the fraction of the tensor-core peak."""
    out: dict[str, Any] = {}
    state = m.new_state(max(lengths) + 8)
    rng = np.random.default_rng(1)
    for i, p in enumerate(sorted(lengths)):
        ids = rng.integers(0, int(m.hp.vocab_size), p).tolist()

        def run() -> None:
            state.length = 0
            m.prefill(state, ids)

        if i == 0:
            run()
        ms = _wall_ms(run, 3 if p <= 8192 else 1)
        tflops = prefill_flops(m, linears, p) / (ms / 1e3) / 1e12
        out[str(p)] = {"ms": round(ms, 1), "tok_per_s": round(p / ms * 1e3, 1), "tflops": round(tflops, 1),
                       "fraction_of_peak": round(tflops / peak_tflops, 3)}
        print(f"  prefill {p:>6}: {ms / 1e3:.2f} s, {p / ms * 1e3:.0f} tok/s, {tflops:.0f} TFLOPS "
              f"({100 * tflops / peak_tflops:.1f}% of the {peak_tflops:.0f} TFLOPS peak)", flush=True)
    del state
    cp.get_default_memory_pool().free_all_blocks()
    return out
