"""`tandem serve` over a synthetic Qwen3.5 model of a real shape built on the GPU, for benchmarks through the server
(bench/conversation.py --synthetic) at shapes whose checkpoints are impractical here: the checkpoint loader
dequantises every linear to float32 on the host first (a 27B checkpoint: about 108 GB of host memory), and a
27B FP8 checkpoint alone is about 29 GB of disk written with NumPy. Not a product path.

The model is bench/decode.py's ``build(fmt, shape)`` (random device weights of the shape, the engine's CUDA model)
with CuPy's generator seeded by ``--seed``, so a restart with the same arguments has the same weights; the
lm_head's rows past the embedded tokenizer's vocabulary are zero, so greedy replies stay inside it (the head's
shape and cost stay the shape's). Tokenizer and chat template: the embedded model's. The disk tier's signature
names the shape, format, seed and GPU, so a restart reads the files it wrote and another build's never load.
Prints ``tandem: serving NAME at URL`` (as ``tandem serve``) once it listens.

    python3 bench/synthetic_server.py --shape 27b --format nvfp4 [--seed 0] [--host 127.0.0.1] [--port 0]
        [--max-context 32768] [--cache on|off] [--cache-gb 8] [--cache-host-gb 16] [--cache-dir DIR]
        [--prefix-chunk 1024] [--served-model-name NAME] [--parallel 4] [--spec off|lookup]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from tandem.cache.build import state_signature  # noqa: E402
from tandem.cache.signature import cache_signature  # noqa: E402
from tandem.cache.store import GB, PrefixCache  # noqa: E402
from tandem.chat import ChatTemplate  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402


def zero_rows_head(fmt: str, vocab: int, hidden: int, keep: int) -> Any:
    """A random device lm_head [vocab, hidden] in ``fmt`` (as bench/decode.py ``make_linear``) whose rows from
    ``keep`` on are zero (every one of their logits is 0.0, under the random rows' largest)."""
    import cupy as cp
    import numpy as np

    from tandem.backend.cuda import gemv

    if fmt == "bf16":
        w = cp.random.standard_normal((vocab, hidden), dtype=cp.float32) * np.float32(0.02)
        w[keep:] = 0
        return gemv.CudaDenseLinear((w.view(cp.uint32) >> 16).astype(cp.uint16))
    if fmt == "fp8":
        codes = cp.random.randint(0, 256, (vocab, hidden), dtype=cp.uint8)
        codes = cp.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).astype(cp.uint8)
        codes[keep:] = 0  # E4M3 +0
        grid = (-(-vocab // 128), -(-hidden // 128))
        return gemv.CudaFP8BlockLinear(codes, cp.random.uniform(1e-4, 2e-4, grid).astype(cp.float32))
    packed = cp.random.randint(0, 256, (vocab, hidden // 2), dtype=cp.uint8)
    packed[keep:] = 0  # E2M1 +0, both nibbles
    scales = cp.random.randint(0x28, 0x38, (vocab, hidden // 16), dtype=cp.uint8)
    return gemv.CudaNVFP4Linear(packed, scales, 0.01)


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine: the seeded synthetic model, the embedded tokenizer and template, the cache as asked."""
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    template = ChatTemplate.from_dir(DEFAULT_MODEL)
    assert tok is not None and template is not None, "the embedded model's tokenizer and template are missing"
    if args.shape == "embedded":  # the server plumbing on a machine without a GPU: the embedded model on the CPU
        model, name = Engine.from_pretrained(cache="off").model, "cpu"
    else:
        import cupy as cp

        from decode import SHAPES, build

        shape = SHAPES[args.shape]
        cp.random.seed(args.seed)
        model = build(args.format, shape, args.kv_dtype)
        model.JOINT_PLANNED = args.joint_planned == "on"
        model.JOINT_BATCHED = args.joint_batched == "on"
        model.PREFILL_WEIGHTS = args.prefill_weights
        model.head = zero_rows_head(args.format, shape["vocab"], shape["hidden"],
                                    min(tok.vocab_size, shape["vocab"]))
        cp.get_default_memory_pool().free_all_blocks()
        name = repr(cp.cuda.runtime.getDeviceProperties(0)["name"])
    cache = None
    if args.cache == "on":
        tag = f"synthetic|{args.shape}|{args.format}|seed {args.seed}|{name}"
        backend = "cpu" if args.shape == "embedded" else "cuda"
        signature = cache_signature(hashlib.sha256(tag.encode()).hexdigest(), backend, args.prefix_chunk,
                                    state_signature(model)) if args.cache_dir else ""
        cache = PrefixCache(args.prefix_chunk, int(args.cache_gb * GB), int(args.cache_host_gb * GB),
                            args.cache_dir, int(args.cache_disk_gb * GB), signature, background_writes=True)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    engine = Engine(model, tok, template, args.max_context, eos, f"synthetic-{args.shape}-{args.format}", args.spec,
                    cache, args.prefix_chunk, args.parallel)
    engine.spec_max_running = args.spec_max_running
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27b", choices=("27b", "9b", "embedded"),
                    help="embedded: the embedded model on the CPU (checks this script without a GPU)")
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "fp8", "bf16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model's KV storage (default: the engine's)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--cache", default="on", choices=("on", "off"))
    ap.add_argument("--cache-gb", type=float, default=8.0)
    ap.add_argument("--cache-host-gb", type=float, default=16.0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--cache-disk-gb", type=float, default=20.0)
    ap.add_argument("--prefix-chunk", type=int, default=1024)
    ap.add_argument("--parallel", type=int, default=4, help="sequence slots (as tandem serve --parallel)")
    ap.add_argument("--spec", default="off", choices=("off", "lookup"),
                    help="speculation (a synthetic model has no MTP head)")
    ap.add_argument("--spec-max-running", type=int, default=1,
                    help="slots draft trees while at most this many run (as tandem serve --spec-max-running)")
    ap.add_argument("--joint-planned", default="on", choices=("on", "off"),
                    help="the slots' decode-only joint passes through recorded plans (cuda_joint.JOINT_PLANNED)")
    ap.add_argument("--joint-batched", default="on", choices=("on", "off"),
                    help="the joint passes' decode attention and GDN updates in one launch a layer for all slots "
                         "(cuda_joint.JOINT_BATCHED)")
    ap.add_argument("--prefill-weights", default="auto", choices=("auto", "layer", "resident"),
                    help="the tensor-core prefill's bf16 weights (CudaQwen3_5Model.PREFILL_WEIGHTS); layer: dequantised "
                         "per call, so two servers fit on one card")
    ap.add_argument("--activity", default="on", choices=("on", "off"), help="as tandem serve --activity")
    ap.add_argument("--ledger", default="off", metavar="PATH", help="the usage ledger's file (default: off)")
    args = ap.parse_args()
    from tandem.server.app import create_app
    from tandem.server.options import ServerOptions
    from tandem.server.serve import _serve, bind

    t0 = time.perf_counter()
    sock = bind(args.host, args.port)
    print(f"tandem: building a synthetic {args.shape} {args.format} model on the GPU ...", file=sys.stderr, flush=True)
    engine = build_engine(args)
    warm = engine.warm_up()  # as `tandem serve`: the kernels compiled before the first request
    if warm:
        print(f"tandem: device kernels ready in {warm:.1f} s", file=sys.stderr, flush=True)
    options = ServerOptions(activity=args.activity == "on", ledger=None if args.ledger == "off" else args.ledger)
    app = create_app(engine, served_name=args.served_model_name, bound_host=args.host, options=options)
    url = f"http://{args.host}:{sock.getsockname()[1]}/v1"
    print(f"tandem: serving {app.state.tandem.served_name} at {url} (built in {time.perf_counter() - t0:.1f} s)",
          flush=True)
    asyncio.run(_serve(app, sock, drain_timeout_s=60.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
