"""The MTP drafter on the GPU (tandem/models/qwen3_5/cuda_mtp.py) at Qwen3.5-27B's and -9B's shapes.

Synthetic weights as bench/decode.py's (random, generated on the device), plus an MTP head of the checkpoint's
shape: fc [E, 2E], one full-attention layer like the model's, the model's embedding and lm_head, in the same format.
Reports per format (host wall time, each call from an idle GPU and synchronised after):
- decode_ms: one decode step of the model (its launch plan), for scale;
- draft_step_ms: one draft row (``forward`` at T = 1) and its best 3 ids (``top_probs``, one read of 8 words);
- propose4_ms: ``MTPDrafter.propose`` of a 4-step chain with up to 3 ids a step (its rows already caught up):
  ``CudaMTPHead.chain``, one host read a chain; propose4_ms_rows: the same planned rows one by one, a host read
  each; both draft_step and propose4 also ``_unplanned`` (CudaMTPHead.PLANNED False: every launch through the
  launchers, a host read each row);
- catch_up16_ms: the head's ``forward`` over 16 committed rows (a verify's accepted tokens are fewer);
- draft_step_gpu_ms: the kernels' time of one draft row + top-k (events around a CUDA-graph replay of the
  launchers' row: a measurement aid, the engine uses no graphs), and the bytes it reads (head weights as stored,
  lm_head included) over that time.
Usage: python3 bench/mtp_draft.py [--shapes 27b,9b] [--formats nvfp4,fp8,bf16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import SHAPES, build, copy_bandwidth_gbps, make_linear, time_ms, wall_ms  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.argmax import top_k  # noqa: E402
from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model, _Attn, _Layer  # noqa: E402
from tandem.models.qwen3_5.cuda_mtp import CudaMTPHead  # noqa: E402
from tandem.speculative.mtp_drafter import MTPDrafter  # noqa: E402

POS = 128  # committed tokens before the drafts


def build_head(m: CudaQwen3_5Model, fmt: str, c: dict[str, int]) -> CudaMTPHead:
    """A random MTP head of shape ``c`` in format ``fmt`` on model ``m`` (fused q|k|v and gate|up, as loaded)."""
    e, f, h, hkv, d = c["hidden"], c["mlp"], c["heads"], c["kv_heads"], c["head_dim"]
    ones = cp.ones(e, dtype=cp.float32)
    mixer = _Attn(None, None, None, make_linear(fmt, e, h * d), cp.ones(d, cp.float32), cp.ones(d, cp.float32),
                  proj=gemv.concat([make_linear(fmt, 2 * h * d, e), make_linear(fmt, hkv * d, e),
                                    make_linear(fmt, hkv * d, e)]))
    layer = _Layer(ones, ones, mixer, None, None, make_linear(fmt, e, f),
                   gate_up=gemv.glu_pair(make_linear(fmt, f, e), make_linear(fmt, f, e)))
    cp.get_default_memory_pool().free_all_blocks()
    return CudaMTPHead(m, ones, ones, make_linear(fmt, e, 2 * e), layer, ones)


def head_bytes(head: CudaMTPHead) -> int:
    lw = head.layer
    lins = [head.fc, lw.mixer.proj, lw.mixer.o, lw.gate_up, lw.down, head.model.head]
    return int(sum(lin.bytes_per_use for lin in lins))


def measure(fmt: str, shape: str, reps: int, copy_gbps: float) -> dict[str, Any]:
    c = SHAPES[shape]
    m = build(fmt, c)
    head = build_head(m, fmt, c)
    e = c["hidden"]
    state = m.new_state(POS + 64)
    m.prefill(state, list(range(POS)))

    def decode() -> None:
        m.decode(state, 7)
        state.length -= 1

    for _ in range(3):
        decode()
    res: dict[str, Any] = {"format": fmt, "shape": shape, "decode_ms": wall_ms(decode, reps)}

    hs = head.new_state(POS + 64)
    h_rows = cp.random.standard_normal((POS, e), dtype=cp.float32)
    for a in range(0, POS, 64):
        head.forward(hs, list(range(a + 1, a + 65)), h_rows[a:a + 64], a)
    h1 = h_rows[-1:]

    def draft_step() -> None:
        out = head.forward(hs, [7], h1, POS)
        head.top_probs(out, 3)

    def draft_gpu() -> None:  # the same launches without the host read
        top_k(head.logits(head.forward(hs, [7], h1, POS)), 3)

    drafter = MTPDrafter(head, steps=4, branch_ratio=0.0, max_branch=3)
    drafter.reset(list(range(POS)), cp.asnumpy(h_rows), POS + 64)
    drafter.propose(5, 16, 4)  # catches up the committed rows

    def propose() -> None:
        frag = drafter.propose(5, 16, 4)
        assert len(frag) == 12

    for planned in (True, False):  # single rows through launch plans, or through the launchers
        head.PLANNED = planned
        suffix = "" if planned else "_unplanned"
        for _ in range(3):
            draft_step()
            propose()
        res["draft_step_ms" + suffix] = wall_ms(draft_step, reps)
        res["propose4_ms" + suffix] = wall_ms(propose, reps)
        if planned:  # the same planned rows one by one, a host read each (before CudaMTPHead.chain)
            drafter.device_chain = False
            propose()
            res["propose4_ms_rows"] = wall_ms(propose, reps)
            drafter.device_chain = True
    gpu_ms = float("nan")
    try:  # the kernels' own time: events around a CUDA-graph replay of the launchers' row (a measurement aid)
        head.PLANNED = False
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(2):
                draft_gpu()
            stream.synchronize()
            stream.begin_capture()
            draft_gpu()
            graph = stream.end_capture()
            graph.launch()
            stream.synchronize()
            gpu_ms = time_ms(lambda: graph.launch(), reps)
    except Exception as exc:  # report why, keep the other figures
        print(f"{shape} {fmt}: graph capture failed: {exc!r}")
    head.PLANNED = True
    res["draft_step_gpu_ms"] = gpu_ms
    nbytes = head_bytes(head)
    res["draft_step_bytes"] = nbytes
    res["draft_step_gbps"] = nbytes / gpu_ms / 1e6
    res["draft_step_copy_fraction"] = res["draft_step_gbps"] / copy_gbps

    def catch_up() -> None:
        head.forward(hs, list(range(16)), h_rows[:16], POS)

    catch_up()
    res["catch_up16_ms"] = wall_ms(catch_up, reps)
    del m, head, state, hs
    cp.get_default_memory_pool().free_all_blocks()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="27b,9b")
    ap.add_argument("--formats", default="nvfp4,fp8,bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results: dict[str, Any] = {"device": name, "copy_gbps": copy_gbps, "pos": POS, "runs": []}
    print(f"{name}: copy {copy_gbps:.0f} GB/s")
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            r = measure(fmt, shape, args.reps, copy_gbps)
            results["runs"].append(r)
            print(f"{shape} {fmt}: decode {r['decode_ms']:.3f} ms | draft step {r['draft_step_ms']:.3f} ms wall, "
                  f"(unplanned {r['draft_step_ms_unplanned']:.3f}), {r['draft_step_gpu_ms']:.3f} GPU "
                  f"({r['draft_step_bytes'] / 1e9:.2f} GB, "
                  f"{100 * r['draft_step_copy_fraction']:.0f} % of copy) | 4-step propose {r['propose4_ms']:.3f} ms "
                  f"(rows {r['propose4_ms_rows']:.3f}, unplanned {r['propose4_ms_unplanned']:.3f}) | "
                  f"16-row catch-up {r['catch_up16_ms']:.3f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
