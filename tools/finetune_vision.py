"""--finetune --vision: give the default model a tiny Qwen3.5 vision tower and train it with the language model.

The tower is transformers' Qwen3_5ForConditionalGeneration visual part (VISION_CONFIG: patch 16, temporal patch 2,
spatial merge 2, depth 2, hidden 128, 2 heads, out_hidden_size = the text hidden), drawn fresh; the VL model shares
the language model and head of tools/finetune_chat.py's Qwen3_5ForCausalLM, so code and chat rows go through the
text path as before and image rows through ``model.model(input_ids, pixel_values, image_grid_thw, ...)``: transformers
scatters the tower's features into the pad rows and computes the 3-D rotary positions.

Image rows are packed conversations about synthetic images (tools/vision_data.py). Their pixels and pad runs come
from the engine's own code (tandem.images.prepare_image with IMAGE_SPEC, tandem.multimodal.expand_pads), and
IMAGE_SPEC is written as preprocessor_config.json, which the engine reads back at serve time (ImageSpec.from_dir):
what the tower saw in training is what it sees when served. Loss: the final assistant turn, main head only (the MTP
head is trained on text rows; its image-row positions are 3-D and it is not asked to learn them here).
"""

from __future__ import annotations

import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import chat_data  # noqa: E402
import vision_data  # noqa: E402
from tandem.images import ImageSpec, prepare_image  # noqa: E402
from tandem.multimodal import expand_pads  # noqa: E402

VISION_CONFIG = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 128, "intermediate_size": 512,
                 "num_heads": 2, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                 "temporal_patch_size": 2, "out_hidden_size": 384, "num_position_embeddings": 256,
                 "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02}
# 64² .. 256² pixels after resizing: 4 .. 64 image tokens; 256² is a 16×16 patch grid = num_position_embeddings
IMAGE_SPEC = ImageSpec(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=256 * 256,
                       image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def preprocessor_config(spec: ImageSpec) -> dict[str, Any]:
    """preprocessor_config.json for `spec`, in the fields transformers' Qwen2VL image processor and ImageSpec read."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "do_convert_rgb": True, "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
            "patch_size": spec.patch_size, "temporal_patch_size": spec.temporal_patch_size,
            "merge_size": spec.merge_size, "image_mean": list(spec.image_mean), "image_std": list(spec.image_std)}


def build_vl(model, text_cfg, tok, device):
    """A Qwen3_5ForConditionalGeneration whose language model and head are `model`'s (shared parameters) and whose
    vision tower is new (transformers' init)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vocab = tok.get_vocab()
    vcfg = dict(VISION_CONFIG, out_hidden_size=text_cfg.hidden_size)
    cfg = Qwen3_5Config(text_config=text_cfg.to_dict(), vision_config=vcfg, image_token_id=vocab["<|image_pad|>"],
                        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                        vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=True)
    vl = Qwen3_5ForConditionalGeneration(cfg)
    vl.model.language_model = model.model
    vl.lm_head = model.lm_head
    vl.model.config._attn_implementation = "sdpa"
    vl.model.visual.config._attn_implementation = "sdpa"
    return vl.to(device), vcfg


def build_pool(tok, template, seed: int, num_images: int, num_convs: int, max_tokens: int):
    """(images [PreparedImage], convs [(prompt ids with pads expanded, target ids, image index, keys)])."""
    rng = random.Random(seed)
    pad = tok.token_to_id("<|image_pad|>")
    images, facts = [], []
    for _ in range(num_images):
        img, f = vision_data.draw_image(rng)
        images.append(prepare_image(img, IMAGE_SPEC))
        facts.append(f)
    convs = []
    for i in range(num_convs):
        k = i % num_images
        ex = vision_data.example(rng, facts[k])
        prompt, target = chat_data.render_example(template, ex)
        p = expand_pads(tok.encode(prompt, add_special_tokens=False).ids, [images[k]], pad)
        t = tok.encode(target, add_special_tokens=False).ids
        if len(p) + len(t) + 2 <= max_tokens:
            convs.append((p, t, k, ex))
    return images, convs


def pack_vision(convs, start: int, length: int, eot: int):
    """One row of `length` tokens packed with image conversations from convs[start:], EOT-separated: (ids, loss
    mask, image indices in row order, next start)."""
    ids, mask, imgs = [eot], [0], []
    i = start
    while True:
        p, t, k, _ = convs[i % len(convs)]
        if len(ids) + len(p) + len(t) + 1 > length and len(ids) > 1:
            break
        ids += p + t + [eot]
        mask += [0] * len(p) + [1] * len(t) + [0]
        imgs.append(k)
        i += 1
    pad = length - len(ids)
    return np.array(ids + [eot] * pad, dtype=np.int64), np.array(mask + [0] * pad, dtype=np.float32), imgs, i


def vl_hidden(vl, ids: torch.Tensor, images: list, pad_id: int) -> torch.Tensor:
    """Post-norm hidden states [B, T, E] of the VL model for ids [B, T] whose pads hold `images` (in order)."""
    dev = ids.device
    kw: dict[str, Any] = {}
    if images:
        kw["pixel_values"] = torch.from_numpy(np.concatenate([im.pixels for im in images])).to(dev)
        kw["image_grid_thw"] = torch.tensor([im.grid for im in images], device=dev)
        if "mm_token_type_ids" in inspect.signature(vl.model.get_rope_index).parameters:
            kw["mm_token_type_ids"] = (ids == pad_id).int()
    vl.model.rope_deltas = None
    out = vl.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)
    return out.last_hidden_state


def vision_batch(convs, images, start: int, n_rows: int, length: int, eot: int, device):
    """(ids [n, length], mask [n, length], images in order, next start)."""
    rows, masks, imgs = [], [], []
    for _ in range(n_rows):
        r, m, ks, start = pack_vision(convs, start, length, eot)
        rows.append(r)
        masks.append(m)
        imgs += [images[k] for k in ks]
    return (torch.from_numpy(np.stack(rows)).to(device), torch.from_numpy(np.stack(masks)).to(device), imgs, start)


@torch.no_grad()
def greedy_vl(vl, ids: list[int], image, max_new: int, stop: int, pad_id: int, device) -> list[int]:
    """Greedy tokens after `ids` (pads expanded) with one image; the whole prefix is re-run each step (no cache:
    transformers' 3-D positions are recomputed from the ids, the same way in every version)."""
    seq = list(ids)
    for _ in range(max_new):
        x = torch.tensor([seq], device=device)
        h = vl_hidden(vl, x, [image], pad_id)
        nxt = int(vl.lm_head(h[:, -1]).argmax(-1).item())
        seq.append(nxt)
        if nxt == stop:
            break
    return seq[len(ids):]


def vision_eval(vl, tok, template, seed: int, n: int, max_new: int, device) -> dict[str, Any]:
    """Held-out synthetic images (another seed than training): greedy answers, fraction that name every expected
    colour / shape, and that end with <|im_end|>."""
    vl.eval()
    im_end, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|image_pad|>")
    images, convs = build_pool(tok, template, seed, n, n, 10_000)
    c = {"ended": 0, "colour": 0, "shape": 0, "both": 0, "exact": 0}
    shown = []
    for p, t, k, ex in convs:
        gen = greedy_vl(vl, p, images[k], max_new, im_end, pad, device)
        text = tok.decode(gen, skip_special_tokens=False)
        answer = text.split("</think>")[-1].replace("<|im_end|>", "").strip()
        col, shp = vision_data.answer_keys_ok(answer, ex["keys"])
        c["ended"] += im_end in gen
        c["colour"] += col
        c["shape"] += shp
        c["both"] += col and shp
        c["exact"] += answer == ex["messages"][-1]["content"]
        if len(shown) < 8:
            q = next(p["text"] for p in ex["messages"][-2]["content"] if p["type"] == "text")
            shown.append(f"{images[k].grid} {q!r} (want {ex['messages'][-1]['content']!r}) -> {text!r}")
    vl.train()
    m = len(convs)
    return {"n": m, **{k: v / m for k, v in c.items()}, "samples": shown}


def export_vision(vl, vcfg: dict[str, Any]):
    """The `vision` argument of train_default_model.export: (tower state dict, vision_config)."""
    return {k: v for k, v in vl.model.visual.state_dict().items()}, vcfg


def write_preprocessor(mdir: Path) -> None:
    """preprocessor_config.json, and a check that the engine reads back exactly IMAGE_SPEC."""
    (mdir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(IMAGE_SPEC), indent=2) + "\n")
    got = ImageSpec.from_dir(mdir, VISION_CONFIG["patch_size"], VISION_CONFIG["temporal_patch_size"],
                             VISION_CONFIG["spatial_merge_size"])
    if got != IMAGE_SPEC:
        raise AssertionError(f"preprocessor_config.json reads back as {got}, trained with {IMAGE_SPEC}")


def pool_for_training(tok, template, a, T: int, log) -> tuple[list, list]:
    t0 = time.time()
    images, convs = build_pool(tok, template, a.seed + 21, a.vision_images, a.vision_pool, T + 1)
    log(f"vision pool: {len(images)} images, {len(convs)} conversations fit {T + 1} tokens; mean image tokens "
        f"{np.mean([im.num_tokens for im in images]):.1f}, mean conversation "
        f"{np.mean([len(p) + len(t) for p, t, _, _ in convs]):.0f} tokens; built in {time.time() - t0:.1f}s")
    log("vision example:\n" + "".join(chat_data.render_example(template, convs[0][3])) + "\n---")
    return images, convs
