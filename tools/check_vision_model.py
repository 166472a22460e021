#!/usr/bin/env python3
"""Check an exported VL default model with Tandem on the CPU: an image chat request as the compliance suite sends it
(a 32×32 PNG data URI, "What do you see ... one sentence.") through the Engine API, then greedy parity with
transformers' Qwen3_5ForConditionalGeneration (its own image processor, read from the checkpoint's
preprocessor_config.json) on a few drawn images.

Usage: PYTHONPATH=. python3 tools/check_vision_model.py MODEL_DIR
"""

from __future__ import annotations

import base64
import io
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def png_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main(path: str) -> None:
    import torch
    from PIL import Image
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import vision_data
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams

    engine = Engine.from_pretrained(path, kv_dtype="fp32", max_context=2048)
    red = Image.new("RGB", (32, 32), (255, 0, 0))
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "image_url", "image_url": {"url": png_uri(red)}}]}]
    done = engine.complete(msgs, SamplingParams(temperature=0.0, max_tokens=48))
    print(f"engine, 32x32 red PNG: {engine.tokenizer.decode(done.token_ids)!r}")

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = Qwen2VLImageProcessorPil.from_pretrained(path)
    pad = hf.config.image_token_id
    rng = random.Random(5)
    same = 0
    for i in range(4):
        img, facts = vision_data.draw_image(rng)
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_uri(img)}},
                                             {"type": "text", "text": "What do you see?"}]}]
        ids, _ = engine.encode_prompt_images(msgs)
        done = engine.complete(msgs, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        ref = proc(images=[img], return_tensors="pt")
        seq = torch.tensor([ids + done.token_ids])
        with torch.no_grad():
            logits = hf(input_ids=seq, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                        mm_token_type_ids=(seq == pad).int(), use_cache=False).logits[0]
        want = logits[len(ids) - 1:-1].argmax(-1).tolist()
        same += want == done.token_ids
        print(f"image {img.size} {facts}: engine {engine.tokenizer.decode(done.token_ids)!r}; "
              f"transformers greedy {'equal' if want == done.token_ids else 'DIFFERS'}")
    print(f"greedy parity with transformers: {same} of 4")


if __name__ == "__main__":
    main(sys.argv[1])
