"""Images in on the GPU at Qwen3.5-27B's shapes: the vision tower's encode time for one 1024 × 1024 image, and the
time to first token of a chat turn with that image.

The tower has the released checkpoints' vision shape (transformers' ``Qwen3_5VisionConfig`` defaults: 27 blocks of
width 1152, MLP 4304, 16 heads, patch 16, temporal patch 2, merge 2, a 48 × 48 position table, gelu_pytorch_tanh;
its output width the 27B's 5120), random fp32 weights generated on the device (tandem/models/qwen3_5/vision.py on
CuPy: ``VisionTower.from_tensors``). A 1024 × 1024 image is 64 × 64 patches, 1,024 text tokens.
The text model is bench/decode.py's synthetic 27B in ``--format`` (random device weights), prefilling as the engine
does (the tensor-core prefill) with the image's rows on the state (3-D positions, features at the pads).

Reports (median of ``--reps`` after one warm-up): ``preprocess_ms`` (PNG decode, resize check, normalisation and
patches on the host: tandem/images.py), ``encode_ms`` (the tower on the GPU, synchronised), ``prefill_ms`` (the
chat turn's prompt with the image's rows, to the first token's id on the host), ``ttft_ms`` (all three in a row:
bytes in, first token out), and ``text_prefill_ms`` (a text-only prompt of the same length: what the 3-D rotary
prep and the feature rows cost beside it). Usage: python3 bench/vision.py [--side 1024] [--format nvfp4]
[--reps 5] [--no-ttft] [--out FILE.json].
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from tandem.images import ImageSpec, load_image  # noqa: E402
from tandem.models.qwen3_5.mrope import MultimodalRows, mrope_positions  # noqa: E402
from tandem.models.qwen3_5.vision import VisionHParams, VisionTower  # noqa: E402

VISION_27B = VisionHParams(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120,
                           num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                           image_token_id=248056, vision_start_token_id=248053, vision_end_token_id=248054)
# the released processor's bounds (preprocessor_config.json size) and normalisation
SPEC = ImageSpec(16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
TEXT_BEFORE, TEXT_AFTER = 24, 40  # a system line and the user's question around the image, the assistant header


def device_tower(hp: VisionHParams, seed: int = 0) -> VisionTower:
    """A tower of shape ``hp`` over random fp32 device weights (LayerNorm weights near 1, the rest N(0, 0.02))."""
    rs = cp.random.RandomState(seed)
    tensors: dict[str, Any] = {}
    for name, shape in VisionTower.tensor_shapes(hp).items():
        w = rs.standard_normal(shape, dtype=cp.float32) * cp.float32(0.02)
        tensors[name] = w + cp.float32(1) if "norm" in name and name.endswith("weight") else w
    return VisionTower.from_tensors(hp, tensors)


def png(side: int, seed: int = 0) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "PNG")
    return buf.getvalue()


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up: cuBLAS handles, kernel compiles, pools
    times = []
    for _ in range(reps):
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.get_current_stream().synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def chat_ids(vocab: int, pads: int, seed: int = 1) -> list[int]:
    """A chat turn's ids: text, vision start, the image's pads, vision end, text (random text ids)."""
    hp = VISION_27B
    words = np.random.default_rng(seed).integers(0, min(vocab, hp.vision_start_token_id), TEXT_BEFORE + TEXT_AFTER)
    return [*words[:TEXT_BEFORE].tolist(), hp.vision_start_token_id, *([hp.image_token_id] * pads),
            hp.vision_end_token_id, *words[TEXT_BEFORE:].tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=1024, help="the image's width and height in pixels")
    ap.add_argument("--format", default="nvfp4", choices=("bf16", "fp8", "nvfp4"), help="the text model's weights")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-ttft", action="store_true", help="the tower only (no 27B text model)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    data = png(args.side)
    image = load_image(data, SPEC)
    tower = device_tower(VISION_27B)
    result: dict[str, Any] = {"device": name, "side": args.side, "grid": list(image.grid),
                              "image_tokens": image.num_tokens, "tower_nbytes": tower.nbytes,
                              "vision_shape": {k: getattr(VISION_27B, k) for k in (
                                  "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                                  "out_hidden_size")}}
    result["preprocess_ms"] = median_ms(lambda: load_image(data, SPEC), args.reps)
    result["encode_ms"] = median_ms(lambda: tower.encode(image.pixels, image.grid), args.reps)
    print(f"{name}: {args.side}x{args.side} image, grid {image.grid}, {image.num_tokens} tokens: preprocess "
          f"{result['preprocess_ms']} ms, encode {result['encode_ms']} ms", flush=True)
    if not args.no_ttft:
        from bench.decode import QWEN35_27B, build

        model = build(args.format, QWEN35_27B)
        model.mrope_section = (11, 11, 10)
        ids = chat_ids(QWEN35_27B["vocab"], image.num_tokens)
        state = model.new_state(len(ids) + 8)
        features = tower.encode(image.pixels, image.grid)

        def rows_of(feats: Any) -> MultimodalRows:
            positions, delta, pads = mrope_positions(ids, [image.grid], 2, VISION_27B.image_token_id)
            return MultimodalRows(positions, delta, pads, feats)

        def prefill(rows: MultimodalRows | None) -> int:
            state.length, state.multimodal = 0, rows
            return int(cp.argmax(model.prefill(state, ids)))  # the first token's id on the host

        def ttft() -> int:
            img = load_image(data, SPEC)
            return prefill(rows_of(tower.encode(img.pixels, img.grid)))

        result["format"] = args.format
        result["prompt_tokens"] = len(ids)
        result["tensor_core_prefill"] = model.tensor_core_prefill() is not None
        result["prefill_ms"] = median_ms(lambda: prefill(rows_of(features)), args.reps)
        result["text_prefill_ms"] = median_ms(lambda: prefill(None), args.reps)
        result["ttft_ms"] = median_ms(ttft, args.reps)
        print(f"27B {args.format}, {len(ids)}-token chat turn: prefill with the image's rows "
              f"{result['prefill_ms']} ms (text-only prompt of that length {result['text_prefill_ms']} ms), TTFT "
              f"(bytes in, first id out) {result['ttft_ms']} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
