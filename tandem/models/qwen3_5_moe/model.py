"""The Qwen3.5-MoE text model on the NumPy reference backend.

The dense adapter (tandem/models/qwen3_5/model.py) with one difference, declared here: each layer's
feed-forward is its ``MoELayerWeights.ffn`` (the sparse MoE of spec/qwen3_5.md §7, or a dense MLP). The GDN and
attention layers, the state (same sections and views), prefill/decode and the speculation verbs
(``verify_tree`` / ``commit``, tandem/models/qwen3_5/verify.py) are the dense model's own: they call ``_mlp``,
which this adapter overrides, so verify keeps decode's bits row by row. ``on_device("cuda")`` gives the CUDA twin
(tandem/models/qwen3_5_moe/cuda_model.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tandem.checkpoint import Checkpoint
from tandem.config import read_config
from tandem.dtypes import KV_DTYPES
from tandem.models.qwen3_5.host import MatMul
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.protocol import Capabilities, DeviceLimitError
from tandem.models.qwen3_5.weights import LayerWeights, load_gdn
from tandem.models.qwen3_5_moe.hparams import MoEHParams
from tandem.models.qwen3_5_moe.weights import MoELayerWeights, load_moe_weights


class Qwen3_5MoeModel(Qwen3_5Model):
    """Qwen3.5-MoE text model (``Qwen3_5MoeForConditionalGeneration`` release layout with nested
    ``text_config``, vision tower skipped by name; or ``Qwen3_5MoeForCausalLM``).

    Class attributes an adapter subclass may replace: ``hparams_class`` (how config.json is read) and
    ``load_gdn_layer`` (how a GDN layer's tensors are named).
    """

    hparams_class: type[MoEHParams] = MoEHParams
    load_gdn_layer = staticmethod(load_gdn)
    backend_name = "Qwen3.5-MoE"
    capabilities = Capabilities(tree_verify=True, draft_heads=True, devices=("cpu", "cuda"),
                                prefill_matches_decode=True, kv_dtypes=KV_DTYPES)
    tensor_parallel_layout = None  # tandem/parallel/plan.py has no split of the experts

    @classmethod
    def load(cls, path: str | Path, progress: Callable[[int], None] | None = None) -> "Qwen3_5MoeModel":
        """Load config and text weights from a checkpoint directory.

        Raises: ConfigError (bad config.json, e.g. top-k larger than the expert count), CheckpointError
        (missing / mis-shaped experts or other tensors, truncated files).
        """
        raw = read_config(path)
        hp = cls.hparams_class.from_config(raw)
        model = cls(hp, load_moe_weights(Checkpoint.open(path), hp, cls.load_gdn_layer, progress), raw)
        model.path = Path(path)
        return model

    def on_device(self, device: str) -> Any:
        """This model for "cpu"; for "cuda" its CUDA twin (tandem/models/qwen3_5_moe/cuda_model.py, weights copied
        to the device). Raises DeviceLimitError (before any upload) when a dimension is outside the dense CUDA
        kernels' limits (tandem/models/qwen3_5/cuda_limits.py), ImportError without CuPy, ValueError for experts
        the CUDA GEMVs cannot take and unknown device names."""
        if device == "cpu":
            return self
        if device == "cuda":
            from tandem.models.qwen3_5.cuda_limits import cuda_limit

            limit = cuda_limit(self.hp)
            if limit is not None:
                raise DeviceLimitError(limit)
            from tandem.models.qwen3_5_moe.cuda_model import CudaQwen3_5MoeModel

            return CudaQwen3_5MoeModel(self)
        raise ValueError(f"unknown device {device!r} (expected 'cpu' or 'cuda')")

    @staticmethod
    def _mlp(lw: LayerWeights, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """The layer's feed-forward on h [T, E] float32 -> [T, E] (sparse MoE or dense MLP)."""
        assert isinstance(lw, MoELayerWeights)
        return lw.ffn(h, mm)

    def draft_heads(self) -> Any:
        """The checkpoint's MTP drafter head (``mtp.*``; its layer's MLP as stored), loaded on first use; None if
        absent. Raises CheckpointError for a malformed MTP layer."""
        if self._draft_heads is None and self.path is not None:
            from tandem.models.qwen3_5_moe.mtp import load_moe_mtp

            self._draft_heads = load_moe_mtp(self) or False
        return self._draft_heads or None
