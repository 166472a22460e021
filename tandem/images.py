"""Images in: decode (Pillow), check, resize and cut into the vision tower's patches, as the reference processor does.

The reference is transformers' ``Qwen2VLImageProcessorPil`` (models/qwen2_vl/image_processing_pil_qwen2_vl.py), the
image processor the Qwen3.5 family names (models/auto/image_processing_auto.py maps ``qwen3_5`` to it; the processor
is ``Qwen3VLProcessor``). docs/vision.md lists the facts with their sources. In order:

1. decode with Pillow; convert to RGB, compositing any transparency onto white (``convert_to_rgb``);
2. ``smart_resize``: round each side to a multiple of ``patch_size · merge_size``, then scale into
   [min_pixels, max_pixels] keeping the aspect ratio; resize with Pillow's bicubic filter on the uint8 image;
3. rescale by 1/255 (in float64, stored float32), normalise ``(x - mean) / std`` in float32;
4. patches: [C, H, W] → (h/m, w/m, m, m, C, P, P) blocks (merge-block order), each patch repeated
   ``temporal_patch_size`` times along time, flattened to rows of C·T·P·P; the grid is (1, H/P, W/P).

Every failure of a request's image is an ``ImageError`` (a ValueError: the server's 400) with one line saying why:
undecodable or truncated data, a zero or huge size, too many pixels (checked from the header, before any pixel is
decoded: a decompression bomb never allocates), an animated image, an aspect ratio past 200.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

F32 = np.float32
# transformers' image_utils OPENAI_CLIP_MEAN / OPENAI_CLIP_STD: the processor's class defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # still images only; an animated one is refused


class ImageError(ValueError):
    """A request's image cannot be used (bad data, bad size, over a limit); the message is one line for the client."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send. ``max_images`` per request; ``max_bytes`` per encoded image; ``max_pixels`` per
    decoded image (width · height before resizing); ``max_side`` the longest decoded side in pixels."""

    max_images: int = 16
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_side: int = 16384


@dataclass(frozen=True)
class ImageSpec:
    """The processor's parameters (preprocessor_config.json, else the class defaults with the vision config's
    patch sizes).

    Attributes: patch_size P (pixels), temporal_patch_size T (frames a patch spans; an image repeats its one
    frame), merge_size m (patches merged per side into one text token), min_pixels / max_pixels (the resized
    area's bounds, in pixels), image_mean / image_std (per RGB channel, on values in [0, 1]).
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_dir(cls, root: str | Path, patch_size: int, temporal_patch_size: int, merge_size: int) -> "ImageSpec":
        """The spec of a checkpoint directory: its preprocessor_config.json where present (``size.shortest_edge`` /
        ``size.longest_edge`` or ``min_pixels`` / ``max_pixels``, ``image_mean``, ``image_std``, the patch sizes),
        else the reference class's defaults with the given patch sizes. Raises: ImageError (an unreadable file)."""
        path = Path(root) / "preprocessor_config.json"
        if not path.is_file():
            return cls(patch_size, temporal_patch_size, merge_size)
        try:
            cfg: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ImageError(f"preprocessor_config.json: {e}") from None
        size = cfg.get("size") or {}
        return cls(int(cfg.get("patch_size", patch_size)), int(cfg.get("temporal_patch_size", temporal_patch_size)),
                   int(cfg.get("merge_size", merge_size)),
                   int(size.get("shortest_edge", cfg.get("min_pixels", 56 * 56))),
                   int(size.get("longest_edge", cfg.get("max_pixels", 28 * 28 * 1280))),
                   _triple(cfg.get("image_mean", CLIP_MEAN)), _triple(cfg.get("image_std", CLIP_STD)))


def _triple(v: Any) -> tuple[float, float, float]:
    vals = [float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3)]
    if len(vals) != 3:
        raise ImageError("image_mean / image_std must have 3 values")
    return vals[0], vals[1], vals[2]


@dataclass(frozen=True)
class PreparedImage:
    """One image as the vision tower reads it.

    Attributes:
        pixels: [N, C·T·P·P] float32, N = h·w patches in merge-block order (``ImageSpec`` docstring step 4).
        grid: (t, h, w) in patches (t = 1 for an image).
        merge_size: m; the text sees t·h·w / m² tokens.
        digest: SHA-256 hex over the grid and the pixel bytes: the prefix cache's key for this image.
    """

    pixels: np.ndarray
    grid: tuple[int, int, int]
    merge_size: int
    digest: str

    @property
    def num_tokens(self) -> int:
        """The ``<|image_pad|>`` tokens the image takes in the prompt: t·h·w / m²."""
        t, h, w = self.grid
        return t * h * w // (self.merge_size * self.merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized (height, width) in pixels: multiples of ``factor`` (= P·m), area within [min_pixels,
    max_pixels], aspect ratio kept as closely as possible (the reference's ``smart_resize``).

    Raises: ImageError when the aspect ratio exceeds 200 or a side is zero."""
    if height <= 0 or width <= 0:
        raise ImageError(f"the image is {width}x{height} pixels; it needs at least one pixel")
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height} pixels: its aspect ratio is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("this server cannot read images: Pillow is not installed (pip install pillow)") from None
    return Image


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Any:
    """Decode encoded image bytes to a Pillow RGB image, checking the limits before the pixels are decoded.

    Args: data: PNG / JPEG / WEBP / GIF / BMP bytes (a still image). limits: the request's limits.
    Returns: a loaded ``PIL.Image.Image`` in mode "RGB" (transparency composited onto white, as the reference).
    Raises: ImageError (too many bytes, not an image, another format, animated, zero or huge size, truncated).
    """
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image has {len(data)} bytes; the limit is {limits.max_bytes}")
    image_mod = _pil()
    try:
        img = image_mod.open(io.BytesIO(data), formats=list(FORMATS))
    except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ValueError ...
        if isinstance(e, image_mod.DecompressionBombError):
            raise ImageError(f"the image declares too many pixels; the limits are {limits.max_pixels} pixels and "
                             f"{limits.max_side} a side") from None
        raise ImageError(f"the image could not be read ({type(e).__name__}); send PNG, JPEG, WEBP, GIF or BMP") \
            from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageError(f"the image is {width}x{height} pixels; it needs at least one pixel")
    if max(width, height) > limits.max_side or width * height > limits.max_pixels:
        raise ImageError(f"the image is {width}x{height} pixels; the limits are {limits.max_pixels} pixels and "
                         f"{limits.max_side} a side")
    if getattr(img, "n_frames", 1) > 1:
        raise ImageError("animated images are not supported; send one still frame")
    try:
        img.load()
        return to_rgb(img)
    except Exception as e:  # truncated data, a bad chunk, a decoder error
        raise ImageError(f"the image data is broken ({type(e).__name__}: {str(e)[:80]})") from None


def to_rgb(img: Any) -> Any:
    """``img`` in mode RGB, transparency (an alpha band or a palette's transparent entry) composited onto white:
    transformers' ``convert_to_rgb`` for a Pillow image."""
    image_mod = _pil()
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = image_mod.new("RGBA", rgba.size, (255, 255, 255, 255))
        return image_mod.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def decode_data_uri(uri: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URI. Raises: ImageError (another scheme, not base64, too big)."""
    if not uri.startswith("data:"):
        raise ImageError("the image URL must be a data URI (data:image/png;base64,...)")
    head, sep, payload = uri.partition(",")
    if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise ImageError("the data URI must be 'data:image/<type>;base64,<data>'")
    return decode_base64(payload, limits)


def decode_base64(payload: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """Base64 text to bytes, refusing more than ``limits.max_bytes`` before decoding. Raises: ImageError."""
    if len(payload) > (limits.max_bytes * 4) // 3 + 8:
        raise ImageError(f"the image is over the {limits.max_bytes}-byte limit")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None


def prepare_image(img: Any, spec: ImageSpec) -> PreparedImage:
    """Resize, normalise and patch an RGB Pillow image (module docstring steps 2-4).

    Returns: a PreparedImage (pixels [h·w, 3·T·P·P] float32, grid (1, h, w), digest).
    Raises: ImageError (aspect ratio over 200).
    """
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    width, height = img.size
    new_h, new_w = smart_resize(height, width, p * m, spec.min_pixels, spec.max_pixels)
    resized = img.resize((new_w, new_h), resample=_pil().Resampling.BICUBIC)
    u8 = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
    x = (u8.astype(np.float64) * (1 / 255)).astype(F32)
    mean = np.asarray(spec.image_mean, dtype=F32)[:, None, None]
    std = np.asarray(spec.image_std, dtype=F32)[:, None, None]
    x = ((x - mean) / std).astype(F32)
    gh, gw = new_h // p, new_w // p
    blocks = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, P, P)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    pixels = np.ascontiguousarray(frames.reshape(gh * gw, 3 * tp * p * p), dtype=F32)
    grid = (1, gh, gw)
    digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes() + pixels.tobytes()).hexdigest()
    return PreparedImage(pixels, grid, m, digest)


def load_image(data: bytes, spec: ImageSpec, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    """``decode_image`` then ``prepare_image``. Raises: ImageError."""
    return prepare_image(decode_image(data, limits), spec)
