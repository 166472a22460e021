"""The Qwen3.5 NumPy model over N simulated tensor-parallel ranks: the reference of the mesh's arithmetic.

Each rank is a ``Qwen3_5Model`` of the rank's hyper-parameters (``ShardPlan.rank_hparams``) over its slices of the
weights (``ShardedCheckpoint``) with its own state (its heads' K/V rows, GDN states and conv tails). A layer runs
as on one device, the ranks in lockstep:

    h = rms_norm(x)                        replicated: every rank has x, so every rank computes the same h
    x = x + exact_sum(mixer_r(h))          attention / GDN over the rank's heads, its o_proj / out_proj slice
    x = x + exact_sum(mlp_r(rms_norm(x)))  gate / up columns, the down_proj rows that read them
    logits = concat(head_r(rms_norm(x)))   the head by vocabulary rows (an all-gather)

``exact_sum`` adds the partial sums in rank order, so every rank computes the same bits whatever order the
partials arrive in (the device mesh gathers them and sums in the same order). The embedding is split by vocabulary
rows too: a token's row lives on one rank, and a sum with the other ranks' zeros is exact, so the gather equals the
row. The row-parallel sums change the rounding against one rank (a dot product over K is cut into n partial dot
products), so N ranks give one rank's tokens, not its bits: within float32 rounding of the logits.
Source: Shoeybi et al. 2019 (Megatron-LM) §3; tandem/parallel/plan.py for the splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from tandem.backend import numpy_ops as ops
from tandem.checkpoint import Checkpoint
from tandem.config import read_config
from tandem.dtypes import KV_DTYPES
from tandem.models.protocol import Capabilities
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.host import MatMul
from tandem.models.qwen3_5.model import Qwen3_5Model, decode_token, prefill_pieces
from tandem.models.qwen3_5 import verify as _verify
from tandem.models.qwen3_5.state_layout import check_ids, check_tree
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights, load_weights
from tandem.models.state import BufferSpec, spec_signature
from tandem.parallel.checkpoint import ShardedCheckpoint
from tandem.parallel.plan import ShardPlan

F32 = np.float32


def exact_sum(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The all-reduce every rank computes: float32 partial sums [..] added in rank order, ((p0 + p1) + p2) + ...,
    so the result's bits do not depend on which rank computes it or when the partials arrive.
    Raises: ValueError for no parts."""
    if not parts:
        raise ValueError("exact_sum needs at least one partial sum")
    out = np.array(parts[0], dtype=F32, copy=True)
    for p in parts[1:]:
        out += p
    return out


def rank_specs(specs: Sequence[Sequence[BufferSpec]]) -> list[BufferSpec]:
    """The buffer specs of a state over ranks: rank r's specs named ``rank<r>.<name>``, rank by rank (what a prefix
    cache stores and signs: a mesh's cache is not a one-rank model's)."""
    return [dataclasses.replace(spec, name=f"rank{r}.{spec.name}") for r, rs in enumerate(specs) for spec in rs]


class MeshState:
    """One sequence over the ranks: ``ranks[r]`` is rank r's state (its heads' K/V views, GDN sections; a
    ModelState on the host, a DeviceState on rank r's GPU), all of one length.

    ``specs`` / ``buffers`` / ``signature`` present every rank's buffers as one state's (``rank_specs`` names), so
    the prefix cache snapshots and restores a mesh's sequence as any other."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks
        self.max_len: int = ranks[0].max_len
        self.specs = rank_specs([r.specs for r in ranks])
        self.buffers: dict[str, Any] = {f"rank{r}.{name}": buf for r, rs in enumerate(ranks)
                                        for name, buf in rs.buffers.items()}
        self.decode_plan: Any = None  # a device mesh's recorded decode (cuda_mesh.MeshPlan) over these buffers

    @property
    def length(self) -> int:
        """Tokens in the sequence (every rank's)."""
        return int(self.ranks[0].length)

    @length.setter
    def length(self, value: int) -> None:
        for s in self.ranks:
            s.length = value

    @property
    def signature(self) -> str:
        """``spec_signature`` of the specs."""
        return spec_signature(self.specs)

    def nbytes(self) -> int:
        """Bytes held by every rank's buffers."""
        return sum(int(s.nbytes()) for s in self.ranks)

    def reset(self) -> None:
        """Empty the sequence on every rank (buffers zeroed in place)."""
        for s in self.ranks:
            s.reset()

    def copy_from(self, other: "MeshState") -> None:
        """Every rank's buffers and the length from ``other`` (a state of the same specs)."""
        for s, o in zip(self.ranks, other.ranks):
            s.copy_from(o)


class MeshScratch:
    """Verify / commit buffers of one sequence over the ranks: ``ranks[r]`` is rank r's tree scratch (its heads'
    K/V rows, GDN rows and states of a tree), all for trees of ``max_nodes`` nodes."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks
        self.max_nodes: int = ranks[0].max_nodes

    def nbytes(self) -> int:
        """Bytes held by every rank's scratch buffers."""
        return sum(int(r.nbytes()) for r in self.ranks)


class RankKVStorage:
    """A mesh's ``KVStorage``: ``kv_dtype`` is every rank's (``ranks``: objects with a ``kv_dtype``)."""

    ranks: Sequence[Any]

    @property
    def kv_dtype(self) -> str:
        """Every rank's KV storage ("float32" / "bfloat16"; set before states are made)."""
        return str(self.ranks[0].kv_dtype)

    @kv_dtype.setter
    def kv_dtype(self, value: str) -> None:
        for rank in self.ranks:
            rank.kv_dtype = value


class NumpyMeshModel(RankKVStorage):
    """The NumPy Qwen3.5 model over ``plan.n`` simulated ranks: the Model verbs prefill / decode, the tree verbs
    (``new_tree_scratch``, ``verify_tree``, ``commit``: speculation by prompt lookup; no MTP head) and the choice of
    KV storage.

    Args:
        hp: the full model's hyper-parameters; plan: the layout; ranks: one Qwen3_5Model a rank, built by ``load``.
    """

    # prefill computes decode's bits for every token (each rank's layer ops do; the reductions are per row)
    capabilities = Capabilities(tree_verify=True, prefill_matches_decode=True, kv_dtypes=KV_DTYPES)

    ranks: list[Qwen3_5Model]

    def __init__(self, hp: HParams, plan: ShardPlan, ranks: list[Qwen3_5Model]) -> None:
        self.hp, self.plan, self.ranks = hp, plan, ranks

    @classmethod
    def load(cls, path: str | Path, n: int) -> "NumpyMeshModel":
        """Load the checkpoint at ``path`` split over ``n`` ranks, each rank reading only its slices.

        Raises: ConfigError (a bad config, or a dimension n does not divide), CheckpointError (bad tensors, or a
        slice off its format's block grid)."""
        raw = read_config(path)
        hp = HParams.from_config(raw)
        plan = ShardPlan(hp, n)
        rank_hp = plan.rank_hparams()
        base = Checkpoint.open(path)
        ranks = [Qwen3_5Model(rank_hp, load_weights(ShardedCheckpoint(base, plan, r), rank_hp), raw)
                 for r in range(n)]
        return cls(hp, plan, ranks)

    def state_specs(self, max_len: int) -> list[BufferSpec]:
        """Every rank's buffer specs (``rank_specs``)."""
        return rank_specs([r.state_specs(max_len) for r in self.ranks])

    def new_state(self, max_len: int) -> MeshState:
        """A zeroed state for a sequence of at most ``max_len`` tokens on every rank."""
        return MeshState([r.new_state(max_len) for r in self.ranks])

    def prefill(self, state: MeshState, ids: Sequence[int], all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> np.ndarray:
        """``Qwen3_5Model.prefill`` over the mesh (``prefill_pieces``: pieces on absolute multiples of
        ``ops.GDN_CHUNK``, every token with decode's arithmetic). Returns logits [V] (or [T, V]). Raises: ValueError
        (bad ids, a full state)."""
        return prefill_pieces(self, state, ids, all_logits, hidden_out)

    def decode(self, state: MeshState, token: int, hidden_out: list[np.ndarray] | None = None) -> np.ndarray:
        """One token at position state.length on every rank. Returns logits [V] float32. Raises: ValueError."""
        return decode_token(self, state, token, hidden_out)

    def new_tree_scratch(self, max_nodes: int) -> MeshScratch:
        """Every rank's verify / commit buffers for trees of at most ``max_nodes`` nodes (allocated once)."""
        return MeshScratch([r.new_tree_scratch(max_nodes) for r in self.ranks])

    def verify_tree(self, state: MeshState, scratch: MeshScratch, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> np.ndarray:
        """Run a draft tree after the committed tokens on every rank (tandem/models/qwen3_5/verify.py's contract,
        its per-node layer ops on each rank, the reductions of ``_forward``). Returns logits [N, V] float32, row i
        with the bits of the mesh's plain decode of node i after its path. Raises: ValueError on a malformed
        tree, a bad id, too many nodes or a tree past the state's end."""
        depths = check_tree(self.hp, state.ranks[0], scratch.max_nodes, token_ids, parent_ids)
        for sc in scratch.ranks:
            sc.parent_ids, sc.depths, sc.start = list(parent_ids), depths, state.length
        def mixer(r: int, i: int, weights: AttnWeights | GDNWeights, h: np.ndarray) -> np.ndarray:
            rank, s, sc = self.ranks[r], state.ranks[r], scratch.ranks[r]
            if isinstance(weights, AttnWeights):
                return _verify._attention_tree(rank, weights, h, s, sc, i)
            return _verify._gdn_tree(rank, weights, h, s, sc, i)

        x = self._layers(self._embed(token_ids), mixer, _verify.decode_matmul)
        return self._head(self._normed(x), _verify.decode_matmul)

    def commit(self, state: MeshState, scratch: MeshScratch, path: Sequence[int]) -> None:
        """Append the accepted ``path`` of the last verify on every rank (no reduction: each rank keeps its own
        heads' rows and states), with the bits of decoding its tokens one by one. Raises: ValueError for a bad
        path or a state moved since verify (the first rank's check, before any rank changes)."""
        for rank, s, sc in zip(self.ranks, state.ranks, scratch.ranks):
            _verify.commit(rank, s, sc, path)

    def _check_ids(self, state: MeshState, ids: Sequence[int]) -> None:
        check_ids(self.hp, state.ranks[0], ids)

    def _embed(self, ids: Sequence[int]) -> np.ndarray:
        """Rows [T, E] of the vocabulary-split embedding: each id's row from the rank holding it (the others add
        zeros, exactly)."""
        x = np.zeros((len(ids), self.hp.hidden_size), F32)
        for r, rank in enumerate(self.ranks):
            lo, hi = self.plan.vocab_range(r)
            for t, tok in enumerate(ids):
                if lo <= tok < hi:
                    x[t] = rank.weights.embed[tok - lo]
        return x

    def _forward(self, state: MeshState, ids: Sequence[int], start: int, mm: MatMul) -> np.ndarray:
        """Hidden states [T, E] (before the final norm) of ``ids`` at start.., the ranks' states taking them."""
        def mixer(r: int, i: int, weights: AttnWeights | GDNWeights, h: np.ndarray) -> np.ndarray:
            rank, s = self.ranks[r], state.ranks[r]
            if isinstance(weights, AttnWeights):
                return rank._attention(weights, h, s, i, start, mm)
            return rank._gdn(weights, h, s, i, mm)

        return self._layers(self._embed(ids), mixer, mm)

    def _layers(self, x: np.ndarray, mixer: Callable[[int, int, AttnWeights | GDNWeights, np.ndarray], np.ndarray],
                mm: MatMul) -> np.ndarray:
        """Rows x [T, E] through every layer, the ranks in lockstep, one reduction a mixer and an MLP;
        ``mixer(r, i, weights, h)`` is rank r's mixer rows of layer i. Returns the hidden [T, E] before the final
        norm."""
        eps = self.hp.rms_norm_eps
        for i in range(len(self.hp.layer_types)):
            lw = self.ranks[0].weights.layers[i]  # norms are replicated: rank 0's equal every rank's
            h = ops.rms_norm(x, lw.input_norm, eps)
            x = x + exact_sum([mixer(r, i, rank.weights.layers[i].mixer, h) for r, rank in enumerate(self.ranks)])
            h = ops.rms_norm(x, lw.post_norm, eps)
            x = x + exact_sum([rank._mlp(rank.weights.layers[i], h, mm) for rank in self.ranks])
        return x

    def _normed(self, x: np.ndarray) -> np.ndarray:
        """The final RMSNorm (replicated: rank 0's weight is every rank's)."""
        return self.ranks[0]._normed(x)

    def _head(self, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """Logits [T, V] of normed hidden h [T, E]: each rank's vocabulary rows, gathered in rank order."""
        return np.concatenate([rank._head(h, mm) for rank in self.ranks], axis=-1)
