"""Synthetic images and image chat for the --finetune --vision mode (tools/finetune_vision.py).

Procedural and seeded: one or two coloured shapes (circle, square, triangle, heart, star, line) on a coloured
background, 16-256 pixels a side (non-square too), drawn with Pillow at 4x and downsampled (anti-aliased edges).
Each image comes with a user turn (the image part before or after a question) and a short true answer that names the
colours and shapes, rendered with the shipped chat template by the engine's renderer (chat_data.render_example), and
prepared by the engine's own image code (tandem.images.prepare_image; tandem.multimodal.expand_pads), so the tower
sees in training exactly the patches and pad runs a served request gives it.
"""

from __future__ import annotations

import math
import random
from typing import Any

import chat_data

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 60, 220), "yellow": (240, 220, 30),
           "orange": (245, 140, 20), "purple": (140, 50, 180), "pink": (245, 130, 190), "white": (250, 250, 250),
           "black": (15, 15, 15), "gray": (128, 128, 128), "brown": (130, 80, 30), "cyan": (40, 200, 220)}
SHAPES = ["circle", "square", "triangle", "heart", "star", "line"]
SS = 4  # supersampling factor


def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _jitter(rng: random.Random, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, c + rng.randint(-15, 15))) for c in rgb)
    return r, g, b


def _draw(draw: Any, shape: str, cx: float, cy: float, s: float, fill: tuple[int, int, int], rng) -> None:
    """Draw `shape` centred at (cx, cy) with half-size s (supersampled pixels)."""
    if shape == "circle":
        draw.ellipse([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - s * 0.85, cy - s * 0.85, cx + s * 0.85, cy + s * 0.85], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - s), (cx + s, cy + s * 0.8), (cx - s, cy + s * 0.8)], fill=fill)
    elif shape == "heart":
        pts = []
        for i in range(48):
            t = 2 * math.pi * i / 48
            x = 16 * math.sin(t) ** 3
            y = 13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)
            pts.append((cx + x * s / 17, cy - y * s / 17))
        draw.polygon(pts, fill=fill)
    elif shape == "star":
        pts = []
        for i in range(10):
            r = s if i % 2 == 0 else s * 0.42
            t = -math.pi / 2 + math.pi * i / 5
            pts.append((cx + r * math.cos(t), cy + r * math.sin(t)))
        draw.polygon(pts, fill=fill)
    else:  # line: a thick stroke at a random angle
        t = rng.uniform(0, math.pi)
        dx, dy = s * math.cos(t), s * math.sin(t)
        draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=fill, width=max(SS * 2, int(s * 0.25)))


def draw_image(rng: random.Random) -> tuple[Any, dict[str, Any]]:
    """(RGB Pillow image, facts {"background", "shapes": [(colour, shape)]})."""
    from PIL import Image, ImageDraw

    w, h = rng.randint(16, 256), rng.randint(16, 256)
    if rng.random() < 0.35:
        h = w  # square images are common
    n = 1 if rng.random() < 0.65 else 2
    names = rng.sample(sorted(COLOURS), n + 1)
    bg, colours = names[0], names[1:]
    shapes = rng.sample(SHAPES, n)
    img = Image.new("RGB", (w * SS, h * SS), _jitter(rng, COLOURS[bg]))
    draw = ImageDraw.Draw(img)
    W, H = w * SS, h * SS
    for i, (c, s) in enumerate(zip(colours, shapes)):
        if n == 1:
            cx, cy, room = W / 2, H / 2, min(W, H) / 2
        elif W >= H:  # side by side along the longer side
            cx, cy, room = W * (0.25 + 0.5 * i), H / 2, min(W / 4, H / 2)
        else:
            cx, cy, room = W / 2, H * (0.25 + 0.5 * i), min(W / 2, H / 4)
        half = room * rng.uniform(0.55, 0.9)
        cx += rng.uniform(-1, 1) * (room - half) * 0.8
        cy += rng.uniform(-1, 1) * (room - half) * 0.8
        _draw(draw, s, cx, cy, half, _jitter(rng, COLOURS[c]), rng)
    img = img.resize((w, h), resample=Image.Resampling.LANCZOS)
    return img, {"background": bg, "shapes": list(zip(colours, shapes))}


def _scene(facts: dict[str, Any]) -> str:
    things = " and ".join(_an(f"{c} {s}") for c, s in facts["shapes"])
    return f"{things} on {_an(facts['background'])} background"


def question(rng: random.Random, facts: dict[str, Any]) -> tuple[str, str, str, list[str]]:
    """(question, answer, reasoning, key words the answer must name)."""
    sh = facts["shapes"]
    bg = facts["background"]
    two = len(sh) == 2
    scene = _scene(facts)
    all_keys = [w for c, s in sh for w in (c, s)]
    kind = rng.randrange(6)
    if kind == 0:
        q = chat_data._pick(rng, ["What do you see?", "What is in this image?", "What do you see in this image?",
                                  "What do you see in this image? Answer in one sentence.", "What is this?",
                                  "Look at the image. What is shown?"])
        a, keys = f"I see {scene}.", all_keys
    elif kind == 1:
        q = chat_data._pick(rng, ["Describe the image in one sentence.", "Describe this picture briefly.",
                                  "Give a one-sentence description of the image.", "Describe the image."])
        a, keys = f"The image shows {scene}.", all_keys
    elif kind == 2:
        if two:
            q = chat_data._pick(rng, ["What colours are the shapes?", "What color are the shapes?",
                                      "Which colours do the shapes have?"])
            a = f"The {sh[0][1]} is {sh[0][0]} and the {sh[1][1]} is {sh[1][0]}."
        else:
            q = chat_data._pick(rng, ["What colour is the shape?", "What color is the shape?",
                                      "Which colour is the shape?", "What colour is it?"])
            a = f"The {sh[0][1]} is {sh[0][0]}."
        keys = all_keys
    elif kind == 3:
        if two:
            q = chat_data._pick(rng, ["What shapes are in the image?", "Which shapes do you see?"])
            a, keys = f"{_an(sh[0][1]).capitalize()} and {_an(sh[1][1])}.", [sh[0][1], sh[1][1]]
        else:
            q = chat_data._pick(rng, ["What shape is this?", "What shape do you see?", "Which shape is shown?"])
            a, keys = f"It is {_an(sh[0][1])}.", [sh[0][1]]
    elif kind == 4:
        q = chat_data._pick(rng, ["What colour is the background?", "What color is the background?"])
        a, keys = f"The background is {bg}.", [bg]
    else:
        q = chat_data._pick(rng, ["How many shapes are there?", "How many shapes do you see?"])
        a = f"There are two shapes: {_an(sh[0][0] + ' ' + sh[0][1])} and {_an(sh[1][0] + ' ' + sh[1][1])}." if two \
            else f"There is one shape: {_an(sh[0][0] + ' ' + sh[0][1])}."
        keys = ["two" if two else "one"] + all_keys
    return q, a, f"The image shows {scene}.", keys


def example(rng: random.Random, facts: dict[str, Any]) -> dict[str, Any]:
    """One conversation about an image ({"type": "image"} marks it, as tandem.multimodal.collect_images leaves it),
    in chat_data's example form plus "keys"."""
    q, a, reason, keys = question(rng, facts)
    parts: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": q}]
    if rng.random() < 0.4:
        parts.reverse()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": parts}]
    if rng.random() < 0.15:  # an earlier, unrelated turn
        pq, pa, _ = chat_data._pick(rng, chat_data.PLAIN)(rng)
        msgs = [{"role": "user", "content": pq}, {"role": "assistant", "content": pa}] + msgs
    if rng.random() < 0.1:
        msgs = [{"role": "system", "content": "You are a helpful assistant."}] + msgs
    thinking = rng.random() < 0.5
    target: dict[str, Any] = {"role": "assistant", "content": a}
    if thinking:
        target["reasoning_content"] = reason
    return {"messages": msgs + [target], "tools": None, "thinking": thinking, "kind": "image", "call": None,
            "keys": keys}


def answer_keys_ok(answer: str, keys: list[str]) -> tuple[bool, bool]:
    """(every expected colour named, every expected shape named) in a generated answer, by whole words."""
    words = set(answer.lower().replace(".", " ").replace(",", " ").replace(":", " ").split())
    colours = [k for k in keys if k in COLOURS]
    shapes = [k for k in keys if k in SHAPES]
    return all(c in words for c in colours), all(s in words or s + "s" in words for s in shapes)
