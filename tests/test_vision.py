"""Images in, on the CPU: preprocessing, the vision tower and image prompts against transformers (test-only torch).

The checkpoint is written by transformers itself (``hf_reference.write_hf_vl_checkpoint``: a tiny random Qwen3.5
VLM, float32, the embedded model's tokenizer). Checked:
- preprocessing equals ``Qwen2VLImageProcessorPil`` bit for bit (grid and pixel rows), for RGB, RGBA, palette
  with transparency and grayscale images of non-square sizes;
- the tower's features equal ``get_image_features`` within 1e-5 relative error (fp32);
- image prompts (one image; two images of other shapes; an image in an earlier turn): the expanded ids equal the
  processor's (pads repeated t·h·w/4 times in the text, then tokenized), prefill logits within 1e-4 relative
  error, greedy tokens equal transformers' argmax along the whole sequence; the smallest top-1 margin is printed;
- speculation (prompt lookup) gives the plain tokens with images in the prompt; the prefix cache: the same image
  hits, another image does not share its rows; text-only keys are the ids;
- the bad-image corpus is refused with ImageError (a ValueError: the server's 400), never a crash.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.engine import Engine
from tandem.images import ImageError, ImageLimits, ImageSpec, decode_image, load_image
from tandem.multimodal import attach_images, cache_key, part_bytes
from tandem.sampling import SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # the image path has no compiled module: the interpreted pass only
Image = pytest.importorskip("PIL.Image")
from hf_reference import DEFAULT_TOKENS, hf_image_processor, load_hf_vl, write_hf_vl_checkpoint  # noqa: E402
from image_corpus import bad_images, png  # noqa: E402

PAD = DEFAULT_TOKENS["image"]
SPEC = ImageSpec(8, 2, 2, 1024, 16384, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Any, Path]:
    path = write_hf_vl_checkpoint(tmp_path_factory.mktemp("vl"))
    return Engine.from_pretrained(path, kv_dtype="fp32", max_context=1024), load_hf_vl(path), path


def _palette_png() -> bytes:
    img = Image.new("P", (45, 70))
    img.putpalette([i % 256 for i in range(768)])
    img.putdata([i % 7 for i in range(45 * 70)])
    buf = io.BytesIO()
    img.save(buf, "PNG", transparency=3)
    return buf.getvalue()


@pytest.mark.parametrize("data", [png(60, 44), png(100, 36, 1, "RGBA"), png(17, 300, 2, "L"), _palette_png(),
                                  png(16, 16, 3), png(400, 300, 4)], ids=["rgb", "rgba", "gray", "palette", "tiny",
                                                                          "large"])
def test_preprocessing_matches_the_reference_bitwise(data: bytes) -> None:
    ours = load_image(data, SPEC)
    ref = hf_image_processor()(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert [list(ours.grid)] == ref["image_grid_thw"].tolist()
    np.testing.assert_array_equal(ours.pixels, ref["pixel_values"])
    assert ours.pixels.dtype == np.float32 and ours.num_tokens == ours.grid[1] * ours.grid[2] // 4


def test_tower_matches_the_reference(pair: tuple[Engine, Any, Path]) -> None:
    engine, hf, _ = pair
    tower = engine.model.vision.tower()  # type: ignore[attr-defined]
    for grid in [(1, 4, 6), (1, 8, 8), (1, 2, 10), (1, 12, 4)]:
        pixels = np.random.default_rng(sum(grid)).normal(size=(grid[1] * grid[2], 3 * 2 * 8 * 8)).astype(np.float32)
        ours = tower.encode(pixels, grid)
        with torch.no_grad():
            ref = hf.model.get_image_features(torch.tensor(pixels), torch.tensor([grid])).pooler_output[0].numpy()
        assert ours.shape == ref.shape
        assert float(np.abs(ours - ref).max() / np.abs(ref).max()) < 1e-5


def _conversations() -> dict[str, tuple[list[dict[str, Any]], list[bytes]]]:
    a, b, c = png(60, 44, 10), png(100, 36, 11), png(40, 90, 12)
    one = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri(a)}},
                                        {"type": "text", "text": "What is this?"}]}]
    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                        {"type": "image_url", "image_url": {"url": uri(b)}},
                                        {"type": "text", "text": "with"},
                                        {"type": "image", "image": c}]}]
    earlier = [{"role": "user", "content": [{"type": "image_url", "image_url": uri(c)},
                                            {"type": "text", "text": "Describe it."}]},
               {"role": "assistant", "content": "A picture of noise."},
               {"role": "user", "content": "And its colours?"}]
    return {"one": (one, [a]), "two": (two, [b, c]), "earlier_turn": (earlier, [c])}


@pytest.mark.parametrize("case", ["one", "two", "earlier_turn"])
def test_image_prompts_match_transformers(pair: tuple[Engine, Any, Path], case: str) -> None:
    engine, hf, _ = pair
    messages, raw = _conversations()[case]
    ids, images = engine.encode_prompt_images(messages)
    ref = hf_image_processor()(images=[Image.open(io.BytesIO(d)) for d in raw], return_tensors="pt")
    # the processor's expansion: each pad written t·h·w/m² times in the text, then tokenized
    assert engine.tokenizer is not None and engine.chat_template is not None
    text = engine.chat_template.render([{**m, "content": [p if p.get("type") == "text" else {"type": "image"}
                                                          for p in m["content"]]} if isinstance(m["content"], list)
                                        else m for m in messages], add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    counts = (ref["image_grid_thw"].prod(-1) // 4).tolist()
    expanded = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    assert ids == engine.tokenizer.encode(expanded)
    done = engine.complete(messages, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    seq = ids + done.token_ids
    inp = torch.tensor([seq])
    with torch.no_grad():
        logits = hf(input_ids=inp, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                    mm_token_type_ids=(inp == PAD).int(), use_cache=False).logits[0].float()
    path = logits[len(ids) - 1:len(seq) - 1]
    assert done.token_ids == torch.argmax(path, dim=-1).tolist()
    top = torch.topk(path, 2, dim=-1).values
    state = engine.model.new_state(len(ids))
    attach_images(engine.model, state, ids, images)
    ours = engine.model.prefill(state, ids, all_logits=True)
    rel = float(np.abs(ours - logits[:len(ids)].numpy()).max() / np.abs(logits[:len(ids)].numpy()).max())
    assert rel < 1e-4, f"prefill logits differ: relative error {rel:.2e}"
    print(f"\n[{case}] {len(images)} image(s), {len(ids)} prompt tokens: greedy parity over 24 tokens, prefill "
          f"relative error {rel:.1e}, smallest top-1 margin {float((top[:, 0] - top[:, 1]).min()):.4g} logits")


def test_speculation_and_cache_keep_their_promises(pair: tuple[Engine, Any, Path]) -> None:
    _, _, path = pair
    messages, _ = _conversations()["two"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = Engine.from_pretrained(path, max_context=1024, cache="off").complete(messages, params).token_ids
    spec = Engine.from_pretrained(path, max_context=1024, spec="lookup", cache="off")
    assert spec.complete(messages, params).token_ids == plain
    cached = Engine.from_pretrained(path, max_context=1024, prefix_chunk=64)
    assert cached.complete(messages, params).token_ids == plain
    assert cached.complete(messages, params).token_ids == plain and cached.last_cached_tokens > 0
    other = [{**messages[0], "content": [*messages[0]["content"][:3], {"type": "image", "image": png(40, 90, 99)}]}]
    ids, images = cached.encode_prompt_images(other)
    first_pad = ids.index(PAD)
    fresh = Engine.from_pretrained(path, max_context=1024, cache="off").complete(other, params).token_ids
    assert cached.complete(other, params).token_ids == fresh
    assert cached.last_cached_tokens <= ids.index(PAD, first_pad + images[0].num_tokens)  # up to the new image
    key = cache_key(ids, images, PAD)
    assert all(k < 0 for k, t in zip(key, ids) if t == PAD) and len(set(key[first_pad:first_pad + 3])) == 3
    assert cache_key([1, 2, 3], [], PAD) == [1, 2, 3]


def test_text_only_prompts_and_models_without_vision() -> None:
    engine = Engine.from_pretrained(cache="off", vision="off")  # the embedded model with its tower left out
    with pytest.raises(ImageError, match="reads no images"):
        engine.encode_prompt_images([{"role": "user", "content": [{"type": "image", "image": png(32, 32)}]}])
    ids, images = engine.encode_prompt_images([{"role": "user", "content": "hi"}])
    assert images == [] and ids == engine.encode_prompt([{"role": "user", "content": "hi"}])
    # with its tower (vision "auto", the default) the embedded model reads an image: 64x64 pixels, 4 merged tokens
    ids, images = Engine.from_pretrained(cache="off").encode_prompt_images(
        [{"role": "user", "content": [{"type": "image", "image": png(32, 32)}, {"type": "text", "text": "What?"}]}])
    assert [im.num_tokens for im in images] == [4] and ids.count(PAD) == 4


@pytest.mark.parametrize("data,match", [(data, match) for _, data, match in bad_images()]
                         + [(png(64, 64) * 2, None)], ids=[name for name, _, _ in bad_images()] + ["trailing-bytes"])
def test_bad_images_are_refused(data: bytes, match: str | None) -> None:
    if match is None:  # trailing bytes after a whole PNG: Pillow reads the first image
        assert load_image(data, SPEC).grid[0] == 1
        return
    with pytest.raises(ImageError, match=match):
        load_image(data, SPEC)


def test_limits_and_parts() -> None:
    small = ImageLimits(max_bytes=100)
    with pytest.raises(ImageError, match="limit"):
        decode_image(png(64, 64), small)
    with pytest.raises(ImageError, match="not fetched unless the server runs with --allow-image-urls"):
        part_bytes({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, ImageLimits())
    with pytest.raises(ImageError, match="base64"):
        part_bytes({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, ImageLimits())
    with pytest.raises(ImageError, match="data URI"):
        part_bytes({"type": "image_url", "image_url": {"url": "data:text/plain;base64,AAAA"}}, ImageLimits())
    with pytest.raises(ImageError, match="needs its data"):
        part_bytes({"type": "image_url", "image_url": {}}, ImageLimits())


def test_a_quantised_tower_is_refused_in_one_line(pair: tuple[Engine, Any, Path], tmp_path: Path) -> None:
    """A checkpoint whose vision weights are stored quantised (an FP8 tool's output) is refused when the tower
    loads, in one line naming the tensor; ``--vision off`` serves its text."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tandem.checkpoint import CheckpointError

    src = pair[2]
    dst = tmp_path / "fp8-vision"
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        name = next((n for n in tensors if n.startswith("model.visual.") and n.endswith("attn.qkv.weight")), None)
        if name is not None:
            tensors[name] = tensors[name].to(torch.float8_e4m3fn)
            save_file(tensors, shard, metadata={"format": "pt"})
            break
    else:
        pytest.fail("no vision qkv weight in the checkpoint")
    with pytest.raises(CheckpointError) as err:
        Engine.from_pretrained(dst, max_context=512, cache="off", vision="on")
    assert "\n" not in str(err.value) and "model.visual." in str(err.value) and "F8_E4M3" in str(err.value)
    text = Engine.from_pretrained(dst, max_context=512, cache="off", vision="off")
    assert text.complete("hi", SamplingParams(temperature=0.0, max_tokens=2)).token_ids
