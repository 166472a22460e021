"""Row-invariant CPU prefill against the former GEMM prefill, interleaved in one process (the machine is shared).

"new" is the model as it is (tandem/models/qwen3_5/model.py: one GEMV a row in every Linear, the recurrent delta rule per
token, attention_rows). "old" is the former arithmetic rebuilt here on the same weights: prefill by one GEMM per
Linear and piece (x · Wᵀ), the chunked delta rule (ops.gdn_chunk) and batched causal attention
(ops.attention_prefill); decode by one GEMV per row, the einsum delta-rule step and the per-head attention of
before. Each round times old then new prefill of the same prompt, then old then new decode of ``--decode``
tokens after it; the figures are the medians and minima over ``--rounds``.

    python bench/prefill_rows.py [--model PATH] [--tokens 1772] [--decode 32] [--rounds 5]
        [--json bench/results/prefill_rows_cpu.json]

Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.backend import numpy_ops as ops  # noqa: E402
from tandem.formats import Linear  # noqa: E402
from tandem.models.qwen3_5.hparams import FULL  # noqa: E402
from tandem.models.qwen3_5.model import Qwen3_5Model  # noqa: E402
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights  # noqa: E402
from tandem.models.state import ModelState  # noqa: E402

F32 = np.float32
DEFAULT = Path(__file__).resolve().parents[1] / "tandem" / "assets" / "default"


def old_gdn_step(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                 beta: np.ndarray) -> np.ndarray:
    state *= np.exp(g)[:, None, None]
    p = np.einsum("hkv,hk->hv", state, k)
    delta = beta[:, None] * (v - p)
    state += k[:, :, None] * delta[:, None, :]
    return np.asarray(np.einsum("hkv,hk->hv", state, q), dtype=F32)


def old_attention_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    h, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(hkv, h // hkv, d)
    out = np.empty((hkv, h // hkv, d), dtype=F32)
    scale = F32(1.0 / np.sqrt(d))
    for j in range(hkv):
        scores = (keys[:, j, :] @ qg[j].T).T * scale
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[j] = (scores / scores.sum(axis=-1, keepdims=True)) @ values[:, j, :]
    return out.reshape(h, d)


class Old:
    """The former prefill / decode arithmetic over a loaded model's weights (row-major weight copies)."""

    def __init__(self, model: Qwen3_5Model) -> None:
        self.m = model
        self.w: dict[int, np.ndarray] = {}

    def _weight(self, lin: Linear) -> np.ndarray:
        key = id(lin)
        if key not in self.w:
            self.w[key] = np.ascontiguousarray(lin.weight)  # type: ignore[attr-defined]
        return self.w[key]

    def gemm(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.ascontiguousarray(x) @ self._weight(lin).T
        return out

    def gemv(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        w = self._weight(lin)
        out = np.empty((x.shape[0], w.shape[0]), F32)
        for i in range(x.shape[0]):
            np.dot(w, np.ascontiguousarray(x[i]), out=out[i])
        return out

    def forward(self, state: ModelState, ids: list[int], start: int, decode: bool) -> np.ndarray:
        m, hp = self.m, self.m.hp
        mm = self.gemv if decode else self.gemm
        x = m.weights.embed[np.asarray(ids, dtype=np.int64)].astype(F32)
        t = len(ids)
        for i, lw in enumerate(m.weights.layers):
            h = ops.rms_norm(x, lw.input_norm, hp.rms_norm_eps)
            if lw.kind == FULL:
                assert isinstance(lw.mixer, AttnWeights)
                q, k, v, gate = m.attention_qkv(lw.mixer, h, np.arange(start, start + t), mm)
                kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
                kc[start:start + t], vc[start:start + t] = k, v
                if decode:
                    a = old_attention_decode(q[0], kc[:start + 1], vc[:start + 1])[None]
                else:
                    a = ops.attention_prefill(q, kc[:start + t], vc[:start + t], start)
                x = x + m.attention_output(lw.mixer, a, gate, mm)
            else:
                assert isinstance(lw.mixer, GDNWeights)
                tail, ssm = state.buffers[f"layers.{i}.conv"], state.buffers[f"layers.{i}.ssm"]
                q, k, v, g, beta, z, window = m.gdn_inputs(lw.mixer, h, tail, mm)
                tail[...] = window[window.shape[0] - tail.shape[0]:]
                if decode:
                    o = old_gdn_step(ssm, q[0], k[0], v[0], g[0], beta[0])[None]
                else:
                    o = ops.gdn_chunk(ssm, q, k, v, g, beta)
                x = x + m.gdn_output(lw.mixer, o, z, mm)
            x = x + m._mlp(lw, ops.rms_norm(x, lw.post_norm, hp.rms_norm_eps), mm)
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.gemv(self.m.head, ops.rms_norm(x, self.m.weights.norm, self.m.hp.rms_norm_eps))

    def prefill(self, state: ModelState, ids: list[int]) -> np.ndarray:
        pos, end = 0, len(ids)
        x = None
        while pos < end:
            stop = min(end, (pos // ops.GDN_CHUNK + 1) * ops.GDN_CHUNK)
            x = self.forward(state, ids[pos:stop], pos, decode=False)
            pos = stop
        state.length = end
        assert x is not None
        return self.logits(x[-1:])[0]

    def decode(self, state: ModelState, token: int) -> np.ndarray:
        x = self.forward(state, [token], state.length, decode=True)
        state.length += 1
        return self.logits(x)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT))
    ap.add_argument("--tokens", type=int, default=1772)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    model = Qwen3_5Model.load(args.model)
    old = Old(model)
    ids = np.random.default_rng(0).integers(0, model.hp.vocab_size, args.tokens + args.decode).tolist()
    prompt, more = ids[:args.tokens], ids[args.tokens:]
    times: dict[str, list[float]] = {k: [] for k in ("old_prefill_s", "new_prefill_s", "old_decode_ms",
                                                     "new_decode_ms")}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, prefill, decode in (("old", old.prefill, old.decode), ("new", model.prefill, model.decode)):
            state = model.new_state(args.tokens + args.decode)
            t0 = time.perf_counter()
            prefill(state, prompt)
            times[f"{name}_prefill_s"].append(time.perf_counter() - t0)
            steps = []
            for tok in more:
                t0 = time.perf_counter()
                decode(state, tok)
                steps.append(time.perf_counter() - t0)
            times[f"{name}_decode_ms"].append(statistics.median(steps) * 1e3)
    out: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "decode_tokens": args.decode,
                           "rounds": args.rounds, "cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(), "load_average_1m_at_start": load}
    for key, vals in times.items():
        out[key] = {"median": statistics.median(vals), "min": min(vals), "all": vals}
    out["prefill_speed_new_over_old_median"] = out["old_prefill_s"]["median"] / out["new_prefill_s"]["median"]
    out["prefill_speed_new_over_old_min"] = out["old_prefill_s"]["min"] / out["new_prefill_s"]["min"]
    out["decode_time_new_over_old_median"] = out["new_decode_ms"]["median"] / out["old_decode_ms"]["median"]
    out["decode_time_new_over_old_min"] = out["new_decode_ms"]["min"] / out["old_decode_ms"]["min"]
    out["load_average_1m_at_end"] = os.getloadavg()[0]
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
