"""Device buffers of tree verify and commit for ``CudaQwen3_5Model`` (the GPU twin of verify.TreeScratch).

Layout (float32, device, allocated once per sequence for ``max_nodes`` = N):
- per GDN layer ``{i}.pre`` [N, C] pre-conv rows (commit replays them), and the tree kernel's per-node rows
  (``gdn_rows``: q, k, v, g, beta, made on first use);
- per attention layer ``{i}.k``/``{i}.v`` [N, Hkv, D]: the nodes' normed, rotated K and V rows, in the KV cache's
  storage (``kv_dtype``: float32, or bfloat16 bits as uint16), so a commit copies them as stored;
- the per-token reference composition only (``per_node_states``): per GDN layer ``{i}.a``/``{i}.b`` [N, Hv] and
  ``{i}.z`` [N, Hv·dv], and, shared by all GDN layers, ``tails`` [N, K-1, C] and ``ssm`` [N, Hv, dk, dv] (each
  node's conv tail and state after its step); ``gdn_y`` [N, Hv·dv] and ``attn_y`` [N, H·D] shared by all layers.
  The tree kernel needs no state per node: it keeps a stack of state tiles in shared memory.
- ``hidden`` (a property): the last verify's post-final-norm hidden states as a host array [N, E] (the MTP
  drafter is host code); copied from the device on first read after a verify.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.gdn_seq import GDNRows, new_rows
from tandem.backend.cuda.loader import cupy, persistent
from tandem.dtypes import storage_dtype
from tandem.models.qwen3_5.hparams import FULL, HParams


class CudaTreeScratch:
    """Per-sequence verify/commit device buffers for trees of at most ``max_nodes`` nodes.

    Attributes: max_nodes; buffers (name -> cupy array, see the module docstring); tails, ssm, gdn_y, attn_y;
    parent_ids, depths, start (P) of the last verify; attn_partials (the verify plans' attention partials, made by
    the model on first use).
    Raises: ValueError if max_nodes < 1; ImportError without CuPy.
    """

    def __init__(self, hp: HParams, max_nodes: int, per_node_states: bool = True, kv_dtype: str = "float32") -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        cp = cupy()
        n = self.max_nodes = max_nodes
        hv, dk, dv = hp.linear_num_value_heads, hp.linear_key_head_dim, hp.linear_value_head_dim

        def zeros(*shape: int) -> Any:
            return cp.zeros(shape, dtype=cp.float32)

        self.buffers: dict[str, Any] = {}
        self.attn_partials: Any = None  # attention_tree.TreePartials the verify plans' attention layers share
        for i, kind in enumerate(hp.layer_types):
            if kind == FULL:
                kv_shape = (n, hp.num_key_value_heads, hp.head_dim)  # node rows in the cache's storage
                self.buffers[f"{i}.k"] = cp.zeros(kv_shape, dtype=storage_dtype(kv_dtype))
                self.buffers[f"{i}.v"] = cp.zeros(kv_shape, dtype=storage_dtype(kv_dtype))
            else:
                self.buffers[f"{i}.pre"] = zeros(n, hp.conv_dim)
                if per_node_states:  # the per-token composition keeps the gates and z of each node too
                    self.buffers[f"{i}.a"] = zeros(n, hv)
                    self.buffers[f"{i}.b"] = zeros(n, hv)
                    self.buffers[f"{i}.z"] = zeros(n, hv * dv)
        # per-node conv tails and states: only the per-token reference composition needs them (the tree kernel
        # keeps states in a shared-memory stack); GDNRows per GDN layer: the tree kernel's rows for commit
        m = n if per_node_states else 1
        self.tails = zeros(m, hp.linear_conv_kernel_dim - 1, hp.conv_dim)
        self.ssm = zeros(m, hv, dk, dv)
        self._gdn_rows: dict[int, GDNRows] = {}
        self.tables: Any = None  # the round's (DFS plan, GDN table [4, N], depths [N], parents [N]) on the device
        self._shape = (hp.linear_num_key_heads, hv, dk, dv)
        self.gdn_y = zeros(n, hv * dv)
        self.attn_y = zeros(n, hp.num_attention_heads * hp.head_dim)
        self.hidden_device = zeros(n, hp.hidden_size)
        self.logits_device: Any = None  # [max_nodes, V] float32: the verify plans' logits (made on first use)
        self._hidden_host = np.zeros((n, hp.hidden_size), np.float32)
        self._num_nodes = 0
        self._host_fresh = True
        self.parent_ids: list[int] = []
        self.depths: list[int] = []
        self.start = 0  # P, the root's position, of the last verify

    def gdn_rows(self, layer: int, n: int) -> GDNRows:
        """The tree kernel's per-node rows of GDN layer ``layer`` (q, k, v, g, beta; views of its first n rows)."""
        rows = self._gdn_rows.get(layer)
        if rows is None:
            with persistent():
                rows = self._gdn_rows[layer] = new_rows(self.max_nodes, *self._shape)
        return GDNRows(*(f[:n] for f in rows))

    def begin(self, parent_ids: list[int], depths: list[int], start: int) -> None:
        """Record a new verify's tree (parents, depths) and its root position P."""
        self.parent_ids, self.depths, self.start = parent_ids, depths, start
        self._num_nodes = len(parent_ids)

    def hidden_written(self, n: int) -> None:
        """The verify wrote its post-final-norm hidden states straight into hidden_device[:n]."""
        self._num_nodes = n
        self._host_fresh = False

    def set_hidden(self, normed: Any) -> None:
        """Keep the verify's post-final-norm hidden states [N, E] (device)."""
        self.hidden_device[:normed.shape[0]] = normed
        self._host_fresh = False

    @property
    def hidden(self) -> np.ndarray:
        """Host [max_nodes, E] float32: rows 0..N-1 are the last verify's hidden states."""
        if not self._host_fresh:
            self._hidden_host[:self._num_nodes] = cupy().asnumpy(self.hidden_device[:self._num_nodes])
            self._host_fresh = True
        return self._hidden_host

    def logits(self, vocab: int) -> Any:
        """The verify plans' logits buffer [max_nodes, vocab] float32 (device; allocated at the first call, shared
        by the plans of every tree size, so a verify overwrites the previous one's logits)."""
        if self.logits_device is None:
            self.logits_device = cupy().empty((self.max_nodes, vocab), dtype=cupy().float32)
        return self.logits_device

    def nbytes(self) -> int:
        """Device bytes held by the scratch buffers."""
        shared = tuple(a for a in (self.tails, self.ssm, self.gdn_y, self.attn_y, self.hidden_device,
                                   self.logits_device) if a is not None)
        rows = sum(int(f.nbytes) for r in self._gdn_rows.values() for f in r)
        return sum(int(b.nbytes) for b in self.buffers.values()) + sum(int(b.nbytes) for b in shared) + rows
