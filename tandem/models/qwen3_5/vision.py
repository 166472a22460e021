"""The Qwen3.5 vision tower (``model.visual.*``): patches in, text-width features out, on the host (NumPy, the
reference) or on the GPU (the same code over CuPy arrays: ``VisionTower.to_device``).

Implements transformers' ``Qwen3_5VisionModel`` (models/qwen3_5/modeling_qwen3_5.py; facts with sources in
docs/vision.md), in fp32 with plain BLAS GEMMs (the tower runs once per image, outside the row-invariance contract of
decode: its bits depend on the image alone, so a cached image and a fresh one agree). On the GPU the GEMMs are
CuPy's (cuBLAS, fp32, no TF32), the attention batched over heads in blocks of query rows, the exact GELU's erf
CuPy's (cupyx.scipy.special); the small tables (rotary angles, position-embedding taps) are computed on the host as
for NumPy and uploaded. Deterministic on one device; not NumPy's bits (tests/test_cuda_vision.py bounds the
difference):

    x   = patches · W_patchᵀ + b                      (the Conv3d with kernel = stride = (T, P, P))
    x  += bilinear(pos_embed grid, align_corners)     (the √n × √n learned table resampled to the image's h × w)
    per block:  x += proj(attn(rope2d(qkv(LN1(x)))))   (full attention within each frame, 2-D rotary on h, w)
                x += fc2(gelu_tanh(fc1(LN2(x))))
    merger:     y = fc2(gelu(fc1(LN(x) viewed as [N/m², m²·C])))   (exact erf GELU; m×m neighbours to one token)

Patches arrive in merge-block order (tandem/images.py), so each m² consecutive rows form one merged token.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.config import ConfigError, RawConfig, require
from tandem.images import ImageSpec, PreparedImage
from tandem.models.qwen3_5.mrope import MultimodalRows, mrope_positions

F32 = np.float32
PREFIX = "model.visual."
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_erf = np.frompyfunc(math.erf, 1, 1)
# The GPU attention's scores a block: query rows × frame keys × heads fp32 values up to this many bytes (a 1024 ×
# 1024 image at patch 16 is one frame of 4096 patches: 16 heads × 2048 rows a block at 512 MiB).
DEVICE_SCORE_BYTES = 512 << 20


def _module_of(a: Any) -> Any:
    """numpy, or cupy for a CuPy array (imported only then)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


@dataclass(frozen=True)
class VisionHParams:
    """The vision config (``vision_config``) and the prompt's vision token ids (top-level config).

    C hidden width, F MLP width, heads (head dim C / heads), P patch, T temporal patch, m spatial merge,
    out_hidden_size (the text width E), num_position_embeddings (a square table), rope_theta.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, raw: RawConfig) -> "VisionHParams | None":
        """The tower's hyper-parameters, or None when config.json has no ``vision_config``.

        Raises: ConfigError (a missing or bad field, named)."""
        v = raw.top.get("vision_config")
        if not isinstance(v, dict) or raw.top.get("image_token_id") is None:
            return None
        ints = {name: require(v, name, int, positive=True) for name in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
            "out_hidden_size", "num_position_embeddings")}
        side = int(math.isqrt(ints["num_position_embeddings"]))
        if side * side != ints["num_position_embeddings"]:
            raise ConfigError("config field 'vision_config.num_position_embeddings' must be a square")
        if ints["hidden_size"] % ints["num_heads"] or (ints["hidden_size"] // ints["num_heads"]) % 4:
            raise ConfigError("config field 'vision_config.num_heads' must split hidden_size into heads of a "
                              "multiple of 4")
        rope = v.get("rope_parameters") or {}
        act = str(v.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"config field 'vision_config.hidden_act' {act!r} is not supported")
        return cls(in_channels=require(v, "in_channels", int, positive=True, default=3),
                   temporal_patch_size=require(v, "temporal_patch_size", int, positive=True, default=2),
                   hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)),
                   image_token_id=require(raw.top, "image_token_id", int),
                   vision_start_token_id=require(raw.top, "vision_start_token_id", int),
                   vision_end_token_id=require(raw.top, "vision_end_token_id", int), **ints)


@dataclass
class _Block:
    norm1: tuple[np.ndarray, np.ndarray]
    qkv: tuple[np.ndarray, np.ndarray]
    proj: tuple[np.ndarray, np.ndarray]
    norm2: tuple[np.ndarray, np.ndarray]
    fc1: tuple[np.ndarray, np.ndarray]
    fc2: tuple[np.ndarray, np.ndarray]


class VisionTower:
    """The loaded tower (fp32 weights). ``encode`` turns one image's patches into its text-width features.

    Attributes: hp; nbytes (the weights' bytes in memory).
    """

    def __init__(self, hp: VisionHParams, ckpt: Checkpoint | None,
                 tensors: Mapping[str, Any] | None = None) -> None:
        self.hp = hp
        c, f, p, t = hp.hidden_size, hp.intermediate_size, hp.patch_size, hp.temporal_patch_size
        patch_in = hp.in_channels * t * p * p
        merged = c * hp.spatial_merge_size ** 2
        self._ckpt = ckpt
        self._tensors = tensors
        self.xp: Any = np  # the array module of the weights: numpy, or cupy after ``to_device``
        self.patch = (self._get("patch_embed.proj.weight", (c, hp.in_channels, t, p, p)).reshape(c, patch_in),
                      self._get("patch_embed.proj.bias", (c,)))
        self.pos_embed = self._get("pos_embed.weight", (hp.num_position_embeddings, c))
        self.blocks = [_Block(self._pair(f"blocks.{j}.norm1", c, None), self._pair(f"blocks.{j}.attn.qkv", 3 * c, c),
                              self._pair(f"blocks.{j}.attn.proj", c, c), self._pair(f"blocks.{j}.norm2", c, None),
                              self._pair(f"blocks.{j}.mlp.linear_fc1", f, c),
                              self._pair(f"blocks.{j}.mlp.linear_fc2", c, f)) for j in range(hp.depth)]
        self.merger_norm = self._pair("merger.norm", c, None)
        self.merger_fc1 = self._pair("merger.linear_fc1", merged, merged)
        self.merger_fc2 = self._pair("merger.linear_fc2", hp.out_hidden_size, merged)
        d = hp.head_dim // 2  # the rotary table: h and w angles share these frequencies
        self.inv_freq = (1.0 / (F32(hp.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(F32) / F32(d))
                                )).astype(F32)
        self.nbytes = sum(int(a.nbytes) for a in self._arrays())
        del self._ckpt, self._tensors

    @classmethod
    def load(cls, ckpt: Checkpoint, hp: VisionHParams) -> "VisionTower":
        """Read ``model.visual.*`` from the checkpoint.

        Raises: CheckpointError: a tensor is missing or mis-shaped, or stored quantised (one line: the tower is
        read only from BF16 / F16 / F32 weights)."""
        return cls(hp, ckpt)

    @classmethod
    def from_tensors(cls, hp: VisionHParams, tensors: Mapping[str, Any]) -> "VisionTower":
        """A tower over given float32 arrays named as in the checkpoint without the ``model.visual.`` prefix
        (``tensor_shapes``), NumPy or CuPy (all of one kind; used as they are: bench/vision.py builds random weights
        on the device). Raises: CheckpointError (a name missing, a shape or dtype wrong)."""
        tower = cls(hp, None, tensors)
        tower.xp = _module_of(tower.pos_embed)
        return tower

    @staticmethod
    def tensor_shapes(hp: VisionHParams) -> dict[str, tuple[int, ...]]:
        """Every tensor the tower reads (names without ``model.visual.``) and its shape."""
        c, f, p, t = hp.hidden_size, hp.intermediate_size, hp.patch_size, hp.temporal_patch_size
        merged = c * hp.spatial_merge_size ** 2
        out: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (c, hp.in_channels, t, p, p),
                                           "patch_embed.proj.bias": (c,),
                                           "pos_embed.weight": (hp.num_position_embeddings, c)}
        pairs = [("merger.norm", c, None), ("merger.linear_fc1", merged, merged),
                 ("merger.linear_fc2", hp.out_hidden_size, merged)]
        for j in range(hp.depth):
            pairs += [(f"blocks.{j}.norm1", c, None), (f"blocks.{j}.attn.qkv", 3 * c, c),
                      (f"blocks.{j}.attn.proj", c, c), (f"blocks.{j}.norm2", c, None),
                      (f"blocks.{j}.mlp.linear_fc1", f, c), (f"blocks.{j}.mlp.linear_fc2", c, f)]
        for name, o, i in pairs:
            out[name + ".weight"] = (o,) if i is None else (o, i)
            out[name + ".bias"] = (o,)
        return out

    def to_device(self) -> "VisionTower":
        """This tower with every weight copied to the current GPU (CuPy float32 arrays): ``encode`` then runs there
        and returns device features. Raises: ImportError without CuPy."""
        import copy

        import cupy

        tower = copy.copy(self)
        tower.xp = cupy

        def up(pair: tuple[Any, Any]) -> tuple[Any, Any]:
            return cupy.asarray(pair[0]), cupy.asarray(pair[1])

        tower.patch, tower.pos_embed = up(self.patch), cupy.asarray(self.pos_embed)
        tower.merger_norm, tower.merger_fc1, tower.merger_fc2 = (up(self.merger_norm), up(self.merger_fc1),
                                                                 up(self.merger_fc2))
        tower.blocks = [_Block(up(b.norm1), up(b.qkv), up(b.proj), up(b.norm2), up(b.fc1), up(b.fc2))
                        for b in self.blocks]
        return tower

    def _get(self, name: str, shape: tuple[int, ...]) -> Any:
        if self._tensors is not None:
            a = self._tensors.get(name)
            if a is None or tuple(a.shape) != shape or a.dtype != F32:
                raise CheckpointError(f"vision tensor {name!r}: expected {list(shape)} float32, got "
                                      f"{None if a is None else (list(a.shape), str(a.dtype))}")
            return a
        assert self._ckpt is not None
        full = PREFIX + name
        if not self._ckpt.has(full):
            raise CheckpointError(f"the checkpoint has no vision tensor {full!r} (serve with --vision off)")
        dtype = self._ckpt.dtype(full)
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"vision tensor {full!r} is stored as {dtype}: the vision tower is read from "
                                  f"BF16/F16/F32 weights only (serve with --vision off)")
        return np.ascontiguousarray(self._ckpt.get(full, shape), dtype=F32)

    def _pair(self, name: str, out: int, inp: int | None) -> tuple[np.ndarray, np.ndarray]:
        w = self._get(name + ".weight", (out,) if inp is None else (out, inp))
        return w, self._get(name + ".bias", (out,))

    def _arrays(self) -> list[Any]:
        arrays = [*self.patch, self.pos_embed, *self.merger_norm, *self.merger_fc1, *self.merger_fc2]
        for b in self.blocks:
            arrays += [*b.norm1, *b.qkv, *b.proj, *b.norm2, *b.fc1, *b.fc2]
        return arrays

    # ------------------------------------------------------------------------------------------------- forward
    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> Any:
        """Features of one image (or one clip).

        Args: pixels: [N, C·T·P·P] float32 (host), N = t·h·w patches in merge-block order (tandem/images.py).
            grid: (t, h, w) in patches; h and w multiples of the merge size.
        Returns: [N / m², E] float32, one row per ``<|image_pad|>`` token, in prompt order: a NumPy array, or a
        CuPy one for a tower on the device.
        Raises: ValueError: the pixels do not match the grid or the patch size.
        """
        hp, xp = self.hp, self.xp
        t, h, w = grid
        m = hp.spatial_merge_size
        if tuple(pixels.shape) != (t * h * w, self.patch[0].shape[1]) or h % m or w % m:
            raise ValueError(f"pixels {tuple(pixels.shape)} do not match grid {grid} (patch row "
                             f"{self.patch[0].shape[1]}, merge {m})")
        x = _linear(xp.asarray(pixels).astype(F32, copy=False), self.patch)
        x = x + self._positions(t, h, w)
        cos, sin = (xp.asarray(a) for a in self._rotary(t, h, w))
        for b in self.blocks:
            x = x + _linear(self._attention(_layer_norm(x, b.norm1), b, cos, sin, h * w), b.proj)
            y = _linear(_layer_norm(x, b.norm2), b.fc1)
            x = x + _linear(_gelu_tanh(y) if hp.hidden_act == "gelu_pytorch_tanh" else _gelu(y), b.fc2)
        y = _layer_norm(x, self.merger_norm).reshape(-1, hp.hidden_size * m * m)
        return _linear(_gelu(_linear(y, self.merger_fc1)), self.merger_fc2)

    def _order(self, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(row, col) of each patch of one frame, in merge-block order: [h·w] int64 each."""
        m = self.hp.spatial_merge_size
        rows = np.arange(h).reshape(h // m, 1, m, 1)
        cols = np.arange(w).reshape(1, w // m, 1, m)
        shape = (h // m, w // m, m, m)
        return np.broadcast_to(rows, shape).reshape(-1), np.broadcast_to(cols, shape).reshape(-1)

    def _positions(self, t: int, h: int, w: int) -> Any:
        """The learned position table resampled to h × w (bilinear, align_corners=True, border taps clamped):
        [t·h·w, C] float32 (every frame the same; taps and weights computed on the host)."""
        xp = self.xp
        side = math.isqrt(self.hp.num_position_embeddings)
        row, col = self._order(h, w)
        acc = xp.zeros((h * w, self.hp.hidden_size), F32)
        taps_h = _taps(row, h, side)
        taps_w = _taps(col, w, side)
        for ih, wh in taps_h:
            for iw, ww in taps_w:
                acc += self.pos_embed[xp.asarray(ih * side + iw)] * xp.asarray(wh * ww)[:, None]
        return xp.tile(acc, (t, 1))

    def _rotary(self, t: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [t·h·w, head_dim] float32: angles (row·f, col·f) concatenated, then repeated twice."""
        row, col = self._order(h, w)
        ang = np.concatenate([row.astype(F32)[:, None] * self.inv_freq, col.astype(F32)[:, None] * self.inv_freq],
                             axis=1)
        ang = np.tile(np.concatenate([ang, ang], axis=1), (t, 1))
        return np.cos(ang).astype(F32), np.sin(ang).astype(F32)

    def _attention(self, x: Any, b: _Block, cos: Any, sin: Any, frame: int) -> Any:
        """Multi-head attention, bidirectional within each frame of ``frame`` patches: [N, C] → [N, C]."""
        n, heads, d = x.shape[0], self.hp.num_heads, self.hp.head_dim
        qkv = _linear(x, b.qkv).reshape(n, 3, heads, d)
        q, k, v = (_rope(qkv[:, 0], cos, sin), _rope(qkv[:, 1], cos, sin), qkv[:, 2])
        if self.xp is not np:
            return _attention_device(self.xp, q, k, v, frame)
        out = np.empty((n, heads, d), F32)
        scale = F32(d ** -0.5)
        for s in range(0, n, frame):
            for head in range(heads):
                scores = (q[s:s + frame, head] @ k[s:s + frame, head].T) * scale
                scores = np.exp(scores - scores.max(axis=1, keepdims=True))
                out[s:s + frame, head] = (scores / scores.sum(axis=1, keepdims=True)) @ v[s:s + frame, head]
        return out.reshape(n, heads * d)


def _attention_device(xp: Any, q: Any, k: Any, v: Any, frame: int) -> Any:
    """``VisionTower._attention`` on the GPU: per frame, every head at once (batched GEMMs) over blocks of query rows
    (DEVICE_SCORE_BYTES of scores a block): q, k, v [N, heads, D] → [N, heads·D] float32. The softmax is the host's
    formula (max-subtracted exp, then the row sum)."""
    n, heads, d = q.shape
    out = xp.empty((n, heads, d), F32)
    scale = F32(d ** -0.5)
    rows = max(1, min(frame, DEVICE_SCORE_BYTES // (4 * frame * heads)))
    for s in range(0, n, frame):
        kt = xp.ascontiguousarray(k[s:s + frame].transpose(1, 2, 0))  # [heads, D, frame]
        vh = xp.ascontiguousarray(v[s:s + frame].transpose(1, 0, 2))  # [heads, frame, D]
        for r in range(s, s + frame, rows):
            e = min(r + rows, s + frame)
            qh = xp.ascontiguousarray(q[r:e].transpose(1, 0, 2))  # [heads, rows, D]
            scores = xp.matmul(qh, kt) * scale
            scores = xp.exp(scores - scores.max(axis=2, keepdims=True))
            out[r:e] = xp.matmul(scores / scores.sum(axis=2, keepdims=True), vh).transpose(1, 0, 2)
    return out.reshape(n, heads * d)


def _taps(index: np.ndarray, size: int, side: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Bilinear taps (table index, weight) along one axis for target positions ``index`` of an axis of ``size``
    (align_corners=True: the ends map to 0 and side-1), as transformers' vision_utils interpolation."""
    src = index.astype(F32) * F32(side - 1) / F32(max(size - 1, 1))
    floor = np.floor(src)
    out = []
    for off in (0, 1):
        tap = np.clip(floor.astype(np.int64) + off, 0, side - 1)
        weight = np.clip(F32(1) - np.abs(src - floor - F32(off)), 0, None).astype(F32)
        out.append((tap, weight))
    return out


def _linear(x: Any, wb: tuple[Any, Any]) -> Any:
    return _module_of(x).asarray(x @ wb[0].T + wb[1], dtype=F32)


def _layer_norm(x: Any, wb: tuple[Any, Any], eps: float = 1e-6) -> Any:
    xp = _module_of(x)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return xp.asarray((x - mu) / xp.sqrt(var + F32(eps)) * wb[0] + wb[1], dtype=F32)


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half RoPE over the whole head: x [N, heads, D], cos/sin [N, D]."""
    xp = _module_of(x)
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return xp.asarray(x * cos[:, None] + rotated * sin[:, None], dtype=F32)


def _gelu_tanh(x: Any) -> Any:
    xp = _module_of(x)
    c = F32(math.sqrt(2.0 / math.pi))
    return xp.asarray(F32(0.5) * x * (F32(1) + xp.tanh(c * (x + F32(0.044715) * x * x * x))), dtype=F32)


def _gelu(x: Any) -> Any:
    """The exact GELU, 0.5·x·(1 + erf(x/√2)), with erf in float64 (math.erf on the host, CuPy's on the GPU)."""
    xp = _module_of(x)
    if xp is np:
        e = np.asarray(_erf(x.astype(np.float64) / math.sqrt(2.0)), dtype=np.float64)
    else:
        from cupyx.scipy.special import erf

        e = erf(x.astype(np.float64) / math.sqrt(2.0))
    return xp.asarray(0.5 * x.astype(np.float64) * (1.0 + e), dtype=F32)


def vision_nbytes(tower: Any) -> int:
    """Bytes of a loaded tower's weights (0 for None)."""
    return int(tower.nbytes) if tower is not None else 0


class VisionSide:
    """The adapter's images-in side: the checkpoint's vision config, its tower loaded on first use, the rows.

    Args: path: the checkpoint directory (None: no vision). raw: its config. text_hidden: the text width E.
    Attributes: hp (None when the checkpoint has no vision config); mode: "auto" (load the tower when the first
    image arrives), "on" (load it now: ``start``), "off" (refuse images); device: "cpu" (the tower in host memory,
    NumPy features) or "cuda" (its weights on the current GPU, CuPy features: ``on_device``).
    Raises (constructor): ConfigError: a bad vision config, or an output width that is not the text width.
    """

    def __init__(self, path: Path | None, raw: RawConfig | None, text_hidden: int) -> None:
        self.device = "cpu"
        self.path = path
        self.hp = VisionHParams.from_config(raw) if raw is not None and path is not None else None
        if self.hp is not None and path is not None and not Checkpoint.open(path).has(PREFIX + "patch_embed.proj.weight"):
            self.hp = None  # a vision config without the tower's weights (a text-only export): no images
        if self.hp is not None and self.hp.out_hidden_size != text_hidden:
            raise ConfigError(f"config field 'vision_config.out_hidden_size' ({self.hp.out_hidden_size}) must equal "
                              f"the text hidden_size ({text_hidden})")
        self.mode = "auto"
        self._tower: VisionTower | None = None
        self._lock = threading.Lock()

    def set_mode(self, mode: str) -> None:
        """``--vision on|off|auto``. "on" loads the tower now. Raises: ValueError (an unknown mode; "on" for a
        checkpoint without a vision config), CheckpointError (the tower's weights)."""
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"vision must be 'on', 'off' or 'auto', got {mode!r}")
        if mode == "on" and self.hp is None:
            raise ValueError("--vision on: this checkpoint has no vision tower (no vision_config in config.json)")
        self.mode = mode
        if mode == "on":
            self.tower()
        elif mode == "off":
            self._tower = None

    def spec(self) -> tuple[ImageSpec, int] | None:
        """(preprocessing spec, image pad token id), or None (no tower, or vision off)."""
        if self.hp is None or self.mode == "off" or self.path is None:
            return None
        hp = self.hp
        return ImageSpec.from_dir(self.path, hp.patch_size, hp.temporal_patch_size, hp.spatial_merge_size), \
            hp.image_token_id

    def tower(self) -> VisionTower:
        """The loaded tower (read from the checkpoint once, under a lock). Raises: ValueError (no vision),
        CheckpointError."""
        with self._lock:
            if self._tower is None:
                if self.hp is None or self.path is None or self.mode == "off":
                    raise ValueError("this model reads no images (no vision tower, or --vision off)")
                tower = VisionTower.load(Checkpoint.open(self.path), self.hp)
                self._tower = tower.to_device() if self.device == "cuda" else tower
            return self._tower

    def on_device(self, device: str) -> "VisionSide":
        """This side for a model on ``device`` ("cpu" or "cuda"): a new side of the same checkpoint and mode whose
        tower loads there (fp32 weights on the GPU: ``nbytes`` of device memory, read when the first image arrives
        or at ``--vision on``). A tower this side already loaded moves with it (its host copy let go). Raises:
        ValueError for another device, ImportError without CuPy for "cuda" with a loaded tower."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r} (expected 'cpu' or 'cuda')")
        side = VisionSide.__new__(VisionSide)
        side.device, side.path, side.hp, side.mode = device, self.path, self.hp, self.mode
        side._lock = threading.Lock()
        with self._lock:
            tower, self._tower = self._tower, None
        side._tower = tower.to_device() if tower is not None and device == "cuda" and tower.xp is np else tower
        return side

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded tower's weights (0 before it is loaded), in host memory or on the device
        (``device``)."""
        return vision_nbytes(self._tower)

    def rows(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> MultimodalRows:
        """The multimodal rows of a prompt whose pads are expanded (mrope.py). Raises: ValueError (pads and images
        disagree, no vision), CheckpointError (the tower)."""
        tower = self.tower()
        hp = tower.hp
        for img in images:
            if img.merge_size != hp.spatial_merge_size or img.pixels.shape[1] != tower.patch[0].shape[1]:
                raise ValueError("an image was prepared for another vision tower")
        positions, delta, pads = mrope_positions(ids, [img.grid for img in images], hp.spatial_merge_size,
                                                 hp.image_token_id)
        xp = tower.xp
        features = xp.concatenate([tower.encode(img.pixels, img.grid) for img in images]) if images else \
            xp.zeros((0, hp.out_hidden_size), F32)
        return MultimodalRows(positions, delta, pads, features)
