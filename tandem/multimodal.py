"""Images in a request, on the engine's side: find them in chat messages, prepare them, expand the prompt's pads,
key the prefix cache by their pixels, and attach the model's rows to the sequence's state.

The flow (docs/vision.md): the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for each image
part; ``expand_pads`` repeats each image's single pad to its feature count (t·h·w / m², as transformers'
``Qwen3VLProcessor``); the adapter's ``image_rows`` (a ``VisionModel``) runs the vision tower and computes the 3-D
positions; ``cache_key`` gives the prefix cache ids in which every pad of an image carries the image's pixel digest,
so two different images never share a cache entry and the same image hits.

Accepted image parts (the servers turn each API's form into one of these):
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (or "image_url": "<url>"; an
        http(s) URL only with an ``ImageFetcher``: tandem/image_fetch.py, ``--allow-image-urls``)
    {"type": "image", "image": <bytes | data URI | base64 text | PreparedImage>}
    {"type": "input_image", "image_url": "data:..."}
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.image_fetch import URLS_OFF, ImageFetcher, is_image_url
from tandem.models.protocol import vision_model
from tandem.images import ImageError, ImageLimits, ImageSpec, PreparedImage, decode_base64, decode_data_uri, \
    load_image

IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def is_image_part(part: Any) -> bool:
    """Whether a content part is an image (by its type, or an "image" / "image_url" key, as the template checks)."""
    return isinstance(part, Mapping) and (part.get("type") in IMAGE_PART_TYPES or "image" in part
                                          or "image_url" in part)


def collect_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], list[Any]]:
    """The messages with each image part replaced by ``{"type": "image"}`` (what the template needs to write the
    pads), and the image parts in the order the template renders them (message order, then part order).
    Messages without image parts are returned as they are."""
    out: list[Mapping[str, Any]] = []
    found: list[Any] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            parts = []
            for p in content:
                if is_image_part(p):
                    found.append(p)
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            out.append({**m, "content": parts})
        else:
            out.append(m)
    return out, found


def part_bytes(part: Any, limits: ImageLimits, fetcher: ImageFetcher | None = None) -> bytes | PreparedImage:
    """The encoded bytes of an image part (or the PreparedImage it already holds); an http(s) URL is fetched by
    ``fetcher`` (tandem/image_fetch.py), and refused without one.

    Raises: ImageError: no image data, an http(s) URL without a fetcher or whose fetch failed, bad base64, over the
    byte limit.
    """
    value: Any = part
    if isinstance(part, Mapping):
        value = part.get("image") if part.get("image") is not None else part.get("image_url")
        if isinstance(value, Mapping):
            value = value.get("url")
    if isinstance(value, PreparedImage):
        return value
    if isinstance(value, (bytes, bytearray)):
        if len(value) > limits.max_bytes:
            raise ImageError(f"the image has {len(value)} bytes; the limit is {limits.max_bytes}")
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise ImageError("an image part needs its data: a data URI (data:image/png;base64,...) or base64 bytes")
    if is_image_url(value):
        if fetcher is None:
            raise ImageError(URLS_OFF)
        return fetcher.fetch(value, limits.max_bytes)
    if value.startswith("data:"):
        return decode_data_uri(value, limits)
    return decode_base64(value, limits)


def prepare_images(parts: Sequence[Any], spec: ImageSpec, limits: ImageLimits,
                   fetcher: ImageFetcher | None = None) -> list[PreparedImage]:
    """Decode and prepare every image part (tandem/images.py), fetching http(s) URLs with ``fetcher`` (None: URLs
    refused). Raises: ImageError (too many images; the first bad image, prefixed with its index in the request)."""
    if len(parts) > limits.max_images:
        raise ImageError(f"the request has {len(parts)} images; the limit is {limits.max_images}")
    out = []
    for i, part in enumerate(parts):
        try:
            data = part_bytes(part, limits, fetcher)
            out.append(data if isinstance(data, PreparedImage) else load_image(data, spec, limits))
        except ImageError as e:
            raise ImageError(f"image {i}: {e}") from None
    return out


def expand_pads(ids: Sequence[int], images: Sequence[PreparedImage], pad_id: int) -> list[int]:
    """``ids`` with the k-th single ``pad_id`` repeated ``images[k].num_tokens`` times.
    Raises: ValueError: the prompt's pad count differs from the image count."""
    count = sum(1 for t in ids if t == pad_id)
    if count != len(images):
        raise ValueError(f"the prompt has {count} image placeholders for {len(images)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == pad_id:
            out += [pad_id] * images[k].num_tokens
            k += 1
        else:
            out.append(int(t))
    return out


def cache_key(ids: Sequence[int], images: Sequence[PreparedImage], pad_id: int) -> list[int]:
    """The prefix cache's ids of an expanded prompt: each pad of image k replaced by a negative id made from its
    digest and its index in the image (negative ids are never tokens). Text-only prompts: the ids themselves.
    Raises: ValueError: the pad runs do not match the images."""
    out = [int(t) for t in ids]
    k, i = 0, 0
    while i < len(out):
        if out[i] != pad_id:
            i += 1
            continue
        if k >= len(images):
            raise ValueError("the prompt has more image pad tokens than its images fill")
        img = images[k]
        for j in range(img.num_tokens):
            if i + j >= len(out) or out[i + j] != pad_id:
                raise ValueError("an image's pad tokens are not one run of its feature count")
            h = hashlib.blake2b(f"{img.digest}:{j}".encode(), digest_size=7).digest()
            out[i + j] = -1 - int.from_bytes(h, "little")
        i += img.num_tokens
        k += 1
    return out


def set_vision_mode(model: Any, mode: str) -> None:
    """``--vision auto|on|off`` on a loaded host model: "on" loads the tower now. Raises: ValueError (an unknown
    mode; "on" for a model without a vision tower), CheckpointError (the tower's weights)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"vision must be 'auto', 'on' or 'off', got {mode!r}")
    vm = vision_model(model)
    if vm is None:
        if mode == "on":
            raise ValueError(f"--vision on: the {type(model).__name__} adapter reads no images")
        return
    vm.set_vision_mode(mode)


def image_spec_of(model: Any) -> tuple[ImageSpec, int]:
    """(ImageSpec, pad id) of a model that reads images. Raises: ValueError (one line) for a model that does not:
    no vision tower in the checkpoint, ``--vision off``, or a backend without the vision path (a tensor-parallel
    mesh)."""
    vm = vision_model(model)
    if vm is None:
        raise ImageError("this model reads no images (its adapter or backend has no vision path: a tensor-parallel "
                         "mesh reads none yet)" if model.capabilities.synchronize else "this model reads no images")
    got = vm.image_spec()
    if got is None:
        raise ImageError("this model reads no images (its checkpoint has no vision tower, or --vision off)")
    spec, pad = got
    return spec, int(pad)


def encode_with_images(encode: Callable[..., list[int]], model: Any, prompt: Any, limits: ImageLimits,
                       *args: Any, fetcher: ImageFetcher | None = None) -> tuple[list[int], list[PreparedImage]]:
    """A prompt's ids with its images' pads expanded, and the prepared images.

    Args: encode: the engine's ``encode_prompt`` (called with the messages and ``args``); model: the engine's model;
        prompt: text, ids or chat messages (only messages carry images); limits: the request's image limits;
        fetcher: fetches http(s) image URLs (None: they are refused).
    Raises: ImageError / ValueError (one line: a bad image, a model that reads none, too many).
    """
    if isinstance(prompt, str) or not prompt or not all(isinstance(m, Mapping) for m in prompt):
        return encode(prompt, *args), []
    messages, parts = collect_images(prompt)
    if not parts:
        return encode(prompt, *args), []
    spec, pad = image_spec_of(model)
    images = prepare_images(parts, spec, limits, fetcher)
    return expand_pads(encode(messages, *args), images, pad), images


def attach_images(model: Any, state: Any, ids: Sequence[int], images: Sequence[PreparedImage]) -> list[int]:
    """Run the vision tower for a sequence: set ``state.multimodal`` to the model's rows for ``ids`` (pads
    expanded) and return the prefix cache's key ids. Raises: ValueError (pads and images disagree, no vision)."""
    _, pad = image_spec_of(model)
    vm = vision_model(model)
    assert vm is not None
    state.multimodal = vm.image_rows(ids, images)
    return cache_key(ids, images, pad)
