"""The Qwen3.5 dense model over N CUDA ranks: ``numpy_mesh.NumpyMeshModel``'s arithmetic on GPUs.

Rank r is a ``CudaQwen3_5Model`` of the rank's hyper-parameters (``ShardPlan.rank_hparams``) on ``devices[r]``,
uploaded from its ``ShardedCheckpoint`` (each rank reads only its slices of the file), with its own state (its
heads' K/V rows, GDN states and conv tails). The ranks run each layer in lockstep, as the NumPy mesh does:

    h = rms_norm(x)                          every rank holds x (the same bits), so every rank computes h
    x += rank_order_sum(all_gather(mixer_r(h)))   the rank's heads and its o_proj / out_proj rows
    x += rank_order_sum(all_gather(mlp_r(rms_norm(x))))   gate|up columns and the down_proj rows that read them
    logits = concat_r(head_r(rms_norm(x)))   the head by vocabulary rows, all-gathered onto devices[0]

Each rank runs the single-GPU model's layer ops (``CudaLayerOps``: the GDN scan, the attention prefill with
decode's bits, the row-invariant GEMVs) outside its fused residual epilogues, because the residual add waits for
the reduction. The embedding is split by vocabulary rows: every rank embeds the ids it holds (row 0 for the
others), the rows are all-gathered and each token takes its owner's row (a copy, exact). So N = 1 gives the
single-GPU model's bits (its unfused layer loop computes the fused one's bits), every rank of a mesh holds the same
residual bits, the mesh's logits are ``NumpyMeshModel``'s of the same N within the GPU / CPU tolerance of the
single model, and N ranks give the single GPU's tokens (the row-parallel sums round differently from one rank's).
Source: Shoeybi et al. 2019 (Megatron-LM) §3; tandem/parallel/plan.py for the splits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import checked_once
from tandem.backend.cuda.attention_decode import decode_scratch
from tandem.backend.cuda.embed import embed
from tandem.backend.cuda.gdn_seq import tree_plan
from tandem.backend.cuda.loader import cupy
from tandem.backend.cuda.plan import LaunchPlan
from tandem.backend.cuda.rms_norm import add_rms_norm
from tandem.backend.numpy_ops import GDN_CHUNK
from tandem.checkpoint import Checkpoint
from tandem.config import read_config
from tandem.dtypes import KV_DTYPES
from tandem.models.state import BufferSpec
from tandem.models.protocol import Capabilities, DeviceLimitError
from tandem.models.qwen3_5.cuda_layers import _Attn, _Layer
from tandem.models.qwen3_5.cuda_limits import cuda_limit
from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model, check_commit_path
from tandem.models.qwen3_5.hparams import FULL, HParams
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.qwen3_5.state_layout import check_ids, check_tree, state_specs
from tandem.models.qwen3_5.weights import load_weights
from tandem.parallel.checkpoint import ShardedCheckpoint
from tandem.parallel.collective import Collective, LocalCollective, make_collective, rank_order_sum, sum_parts
from tandem.parallel.numpy_mesh import MeshScratch, MeshState, RankKVStorage, rank_specs
from tandem.parallel.plan import ShardPlan


PLANNED = True  # decode through a recorded MeshPlan (False: the layer loop's launches every step; the same bits)


class MeshPlan:
    """A mesh's recorded decode step: stages (one rank's LaunchPlan between two reductions, replayed on its GPU)
    and calls (the embedding, the reductions, the logits' gather), in the recording's order. ``vars`` holds what
    the calls read at each replay (the token, the position); ``keep`` the buffers the recorded launches point
    into; ``outputs`` what the recording step returned (its buffers, rewritten by every replay)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.steps: list[tuple[int, LaunchPlan] | Callable[[], None]] = []
        self.vars: dict[str, Any] = {}
        self.keep: list[Any] = []
        self.outputs: Any = None

    @contextlib.contextmanager
    def stage(self, device: int) -> Iterator[LaunchPlan]:
        """Record the block's launches on ``device`` as one stage (its LaunchPlan shares ``vars``)."""
        seg = LaunchPlan()
        seg.vars = self.vars
        with cupy().cuda.Device(device), seg.record():
            yield seg
        self.steps.append((device, seg))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now and at every replay."""
        fn()
        self.steps.append(fn)

    def replay(self) -> None:
        """Every stage and call again, in order."""
        cp = cupy()
        for step in self.steps:
            if isinstance(step, tuple):
                with cp.cuda.Device(step[0]):
                    step[1].replay()
            else:
                step()


class CudaMeshModel(RankKVStorage):
    """The Qwen3.5 dense model split over ``len(devices)`` GPUs: the Model verbs prefill / decode and the tree
    verbs (``new_tree_scratch``, ``verify_tree``, ``commit``: speculation by prompt lookup); no MTP head. Logits are
    device arrays on devices[0] (the engine chooses ids from them as from the single GPU's).

    Args: hp: the full model's hyper-parameters; plan: the layout; ranks: rank r's model, built on devices[r];
    collective: the all-gather between them (``collective.make_collective``).
    Attributes: kv_dtype: the KV rows' storage of every rank ("float32" / "bfloat16"; set before states are made).
    """

    ranks: list[CudaQwen3_5Model]

    def __init__(self, hp: HParams, plan: ShardPlan, ranks: list[CudaQwen3_5Model], collective: Collective) -> None:
        self.hp, self.plan, self.ranks, self.collective = hp, plan, ranks, collective
        self.devices = collective.devices
        self.eps = float(hp.rms_norm_eps)
        self._checked: set[str] = set()  # verbs whose launches ran once with every argument checked
        # tree verify (lookup drafts), priced by the rank GPU's profile (the mesh has none of its own)
        self.capabilities = Capabilities(tree_verify=True, synchronize=True, kv_dtypes=KV_DTYPES,
                                         profile_device=ranks[0].profile_device, prefill_matches_decode=True,
                                         reuses_states=True)  # a state keeps its recorded decode (MeshPlan)

    @classmethod
    def load(cls, path: str | Path, devices: Sequence[int], kv_dtype: str = "bfloat16") -> "CudaMeshModel":
        """Load the checkpoint at ``path`` split over ``len(devices)`` ranks, rank r uploaded to devices[r] from its
        slices only (a device id may repeat only as every rank on one GPU: ``LocalCollective``).

        Raises: ConfigError (a bad config, or a dimension the rank count does not divide), CheckpointError (bad
        tensors, a slice off its format's block grid), DeviceLimitError (a rank dimension the CUDA kernels cannot
        serve, naming it), ValueError (bad devices, or fewer GPUs than ``devices`` names)."""
        cp = cupy()
        devs = [int(d) for d in devices]
        count = int(cp.cuda.runtime.getDeviceCount())
        if not devs or max(devs) >= count or min(devs) < 0:
            raise ValueError(f"tensor parallel over devices {devs}: this machine has {count} GPU(s)")
        raw = read_config(path)
        hp = HParams.from_config(raw)
        plan = ShardPlan(hp, len(devs))
        rank_hp = plan.rank_hparams()
        limit = cuda_limit(rank_hp)
        if limit is not None:
            raise DeviceLimitError(f"{limit} (a rank of tensor parallel size {len(devs)})")
        base = Checkpoint.open(path)
        collective = make_collective(devs)
        ranks = []
        for r, dev in enumerate(devs):
            ckpt = ShardedCheckpoint(base, plan, r)
            host = Qwen3_5Model(rank_hp, load_weights(ckpt, rank_hp), raw)
            host.kv_dtype = kv_dtype
            with cp.cuda.Device(dev):
                ranks.append(CudaQwen3_5Model(host, ckpt=ckpt))
        return cls(hp, plan, ranks, collective)

    # ------------------------------------------------------------------------------------------ verbs
    def state_specs(self, max_len: int) -> list[BufferSpec]:
        """Every rank's buffer specs (``numpy_mesh.rank_specs``)."""
        return rank_specs([state_specs(rank.hp, max_len, rank.kv_dtype) for rank in self.ranks])

    def new_state(self, max_len: int) -> MeshState:
        """A zeroed state for a sequence of at most ``max_len`` tokens on every rank."""
        states = []
        for rank, dev in zip(self.ranks, self.devices):
            with cupy().cuda.Device(dev):
                states.append(rank.new_state(max_len))
        return MeshState(states)

    def synchronize(self) -> None:
        """Wait for every rank's queued work."""
        for dev in self.devices:
            with cupy().cuda.Device(dev):
                cupy().cuda.get_current_stream().synchronize()

    def prefill(self, state: MeshState, ids: Sequence[int], all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> Any:
        """Run ``ids`` at positions state.length.. on every rank, in pieces ending at absolute multiples of
        GDN_CHUNK (as the single-GPU prefill). Returns logits [V] float32 on devices[0] of the last token ([T, V]
        with ``all_logits``); appends host post-final-norm hidden [piece, E] to ``hidden_out`` when given.
        Raises: ValueError for no ids, an id outside the vocabulary or a full state."""
        check_ids(self.hp, state.ranks[0], ids)
        outs: list[Any] = []
        base = pos = state.length
        end = base + len(ids)
        normed: list[Any] = []
        while pos < end:
            stop = min(end, (pos // GDN_CHUNK + 1) * GDN_CHUNK)
            with self._launch_checks("prefill"):
                normed = self._forward(state, ids[pos - base:stop - base], pos, decode=False)
            if all_logits:
                outs.append(self._head(normed))
            if hidden_out is not None:
                hidden_out.append(cupy().asnumpy(normed[0]))
            pos = state.length = stop
        if all_logits:
            with cupy().cuda.Device(self.devices[0]):
                return cupy().concatenate(outs)
        return self._head([h[-1:] for h in normed])[0]

    def decode(self, state: MeshState, token: int, hidden_out: list[np.ndarray] | None = None) -> Any:
        """One token at position state.length on every rank. Returns logits [V] float32 on devices[0]; appends its host
        hidden [1, E] to ``hidden_out`` when given. Raises: ValueError on a bad id or a full state."""
        tid = int(token)
        check_ids(self.hp, state.ranks[0], [tid])
        pos = state.length
        if PLANNED:
            normed, logits = self._decode_planned(state, tid, pos)
        else:
            with self._launch_checks("decode"):
                normed = self._forward(state, [tid], pos, decode=True)
            logits = self._head(normed)[0]
        state.length = pos + 1
        if hidden_out is not None:
            hidden_out.append(cupy().asnumpy(normed[0]))
        return logits

    def _decode_planned(self, state: MeshState, tid: int, pos: int) -> tuple[list[Any], Any]:
        """One decode step through the state's ``MeshPlan``: the first step runs ``_forward``'s arithmetic and
        records it, rank by rank and stage by stage (a stage: one rank's launches between two reductions, a
        LaunchPlan); later steps replay the stages and run the embedding, the attention positions and the
        reductions as calls. Same launches, same arguments, same bits as ``_forward``.
        Returns (every rank's normed [1, E], logits [V] on devices[0]): the plan's buffers, overwritten by the next
        step."""
        mp: MeshPlan | None = state.decode_plan
        if mp is not None and mp.model is self:
            mp.vars["token"], mp.vars["pos"] = tid, pos
            mp.replay()
            normed, logits = mp.outputs
            return normed, logits
        cp, hp, n = cupy(), self.hp, self.plan.n
        mp = MeshPlan(self)
        vars_ = mp.vars
        vars_["token"], vars_["pos"] = tid, pos
        step = hp.vocab_size // n

        def on(r: int, shape: tuple[int, ...]) -> Any:
            with cp.cuda.Device(self.devices[r]):
                return cp.zeros(shape, dtype=cp.float32)

        xs = [on(r, (1, hp.hidden_size)) for r in range(n)]  # the residual streams, updated in place
        shared = isinstance(self.collective, LocalCollective)  # one GPU: one sum serves every rank
        deltas = [on(0, (1, hp.hidden_size))] * n if shared else [on(r, (1, hp.hidden_size)) for r in range(n)]
        rows = [on(r, (1, hp.hidden_size)) for r in range(n)]  # each rank's embedding row of the token
        mp.keep += [xs, deltas, rows]

        def embed_rows() -> None:
            t = int(vars_["token"])
            for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
                lo, hi = self.plan.vocab_range(r)
                with cp.cuda.Device(dev):
                    local = [t - lo if lo <= t < hi else 0]
                    if rank.embed_bits is not None:
                        embed(rank.embed_bits, local, out=rows[r])
                    else:
                        rows[r][...] = rank._embed(local)
            for g, x, dev in zip(self.collective.all_gather(rows), xs, self.devices):
                with cp.cuda.Device(dev):
                    x[...] = g[t // step]

        def reduce_into(parts: list[Any]) -> Callable[[], None]:
            if shared:  # the parts side by side on one GPU: sum them in rank order, no gather
                def local() -> None:
                    with cp.cuda.Device(self.devices[0]):
                        sum_parts(parts, out=deltas[0])
                return local

            def call() -> None:
                for g, d, dev in zip(self.collective.all_gather(parts), deltas, self.devices):
                    with cp.cuda.Device(dev):
                        rank_order_sum(g, out=d)
            return call

        scratch = []
        for rank, s, dev in zip(self.ranks, state.ranks, self.devices):
            with cp.cuda.Device(dev):
                kc = next(s.buffers[f"layers.{i}.k"] for i, k in enumerate(hp.layer_types) if k == FULL)
                scratch.append(decode_scratch(kc, rank.hp.num_attention_heads))
        mp.keep.append(scratch)
        with self._launch_checks("decode"):
            mp.call(embed_rows)
            for i in range(len(hp.layer_types)):
                parts = []
                for r, (rank, s, dev) in enumerate(zip(self.ranks, state.ranks, self.devices)):
                    with mp.stage(dev) as seg:
                        lw = rank.layers[i]
                        h = rank._norm(xs[r], deltas[r] if i else None, lw.input_norm, lw.mixer.proj)
                        if isinstance(lw.mixer, _Attn):
                            kc, vc = s.buffers[f"layers.{i}.k"], s.buffers[f"layers.{i}.v"]
                            parts.append(rank._attn_decode_planned(seg, lw.mixer, h, kc, vc, scratch[r]))
                        else:
                            parts.append(rank._gdn_decode(i, lw.mixer, h, s))
                mp.call(reduce_into(parts))
                parts = []
                for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
                    with mp.stage(dev):
                        lw = rank.layers[i]
                        parts.append(rank._mlp(lw, rank._norm(xs[r], deltas[r], lw.post_norm, lw.gate_up)))
                mp.call(reduce_into(parts))
            normed, heads = [], []
            for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
                with mp.stage(dev):
                    normed.append(add_rms_norm(xs[r], deltas[r], rank.norm, self.eps))
                    heads.append(rank.head.matmul(normed[-1]))
            with cp.cuda.Device(self.devices[0]):
                logits = cp.empty((hp.vocab_size,), dtype=cp.float32)

            def gather_logits() -> None:
                g = self.collective.all_gather(heads)[0]  # [n, 1, V / n] on devices[0]
                with cp.cuda.Device(self.devices[0]):
                    logits.reshape(n, -1)[...] = g.reshape(n, -1)

            mp.call(gather_logits)
        mp.outputs = (normed, logits)
        state.decode_plan = mp
        return normed, logits

    def _launch_checks(self, verb: str) -> contextlib.AbstractContextManager[None]:
        """Every launcher's argument checks on the first call of ``verb``, none after (``arrays.checked_once``, as
        the single-GPU model's ``_launch_checks``); the verbs' own input checks always run."""
        return checked_once(self._checked, verb)

    # ------------------------------------------------------------------------------------------ the layer loop
    def _all_reduce(self, parts: list[Any]) -> list[Any]:
        """Every rank's sum of the ranks' partial rows, in rank order (the same bits on every rank)."""
        gathered = self.collective.all_gather(parts)
        sums = []
        for g, dev in zip(gathered, self.devices):
            with cupy().cuda.Device(dev):
                sums.append(rank_order_sum(g))
        return sums

    def _embed(self, ids: Sequence[int]) -> list[Any]:
        """Every rank's copy of the embedding rows [T, E] float32: each id's row from the rank holding it."""
        cp = cupy()
        step = self.hp.vocab_size // self.plan.n
        parts = []
        for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
            lo, hi = self.plan.vocab_range(r)
            with cp.cuda.Device(dev):
                parts.append(cp.ascontiguousarray(rank._embed([t - lo if lo <= t < hi else 0 for t in ids])))
        owner = np.asarray([t // step for t in ids], dtype=np.int64)
        rows = np.arange(len(ids), dtype=np.int64)
        xs = []
        for g, dev in zip(self.collective.all_gather(parts), self.devices):
            with cp.cuda.Device(dev):
                xs.append(cp.ascontiguousarray(g[cp.asarray(owner), cp.asarray(rows)]))
        return xs

    def _forward(self, state: MeshState, ids: Sequence[int], start: int, decode: bool) -> list[Any]:
        """Every rank's post-final-norm hidden [T, E] float32 of ``ids`` at start.. (rank r's on devices[r]); the
        ranks' states take the tokens' K/V rows and GDN steps. ``decode``: one token through the decode ops."""
        def mixer(r: int, i: int, lw: _Layer, h: Any) -> Any:
            rank, s = self.ranks[r], state.ranks[r]
            if isinstance(lw.mixer, _Attn):
                return rank._attn_decode(i, lw.mixer, h, s, start) if decode else \
                    rank._attn_tokens(i, lw.mixer, h, s, start)
            return rank._gdn_decode(i, lw.mixer, h, s) if decode else rank._gdn_tokens(i, lw.mixer, h, s)

        return self._layers(self._embed(ids), mixer)

    def _layers(self, xs: list[Any], mixer: Callable[[int, int, _Layer, Any], Any]) -> list[Any]:
        """Every rank's residual rows xs[r] [T, E] float32 (updated in place) through every layer, each mixer's and
        MLP's partial rows reduced in rank order; ``mixer(r, i, layer, h)`` is rank r's mixer rows of layer i.
        Returns every rank's post-final-norm hidden [T, E]."""
        cp = cupy()
        deltas: list[Any] = [None] * self.plan.n
        for i in range(len(self.hp.layer_types)):
            parts = []
            for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
                with cp.cuda.Device(dev):
                    lw = rank.layers[i]
                    parts.append(mixer(r, i, lw, rank._norm(xs[r], deltas[r], lw.input_norm, lw.mixer.proj)))
            deltas = self._all_reduce(parts)
            parts = []
            for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
                with cp.cuda.Device(dev):
                    lw = rank.layers[i]
                    parts.append(rank._mlp(lw, rank._norm(xs[r], deltas[r], lw.post_norm, lw.gate_up)))
            deltas = self._all_reduce(parts)
        normed = []
        for r, (rank, dev) in enumerate(zip(self.ranks, self.devices)):
            with cp.cuda.Device(dev):
                normed.append(add_rms_norm(xs[r], deltas[r], rank.norm, self.eps))
        return normed

    # ------------------------------------------------------------------------------------------ speculation
    def new_tree_scratch(self, max_nodes: int) -> MeshScratch:
        """Every rank's verify / commit buffers for trees of at most ``max_nodes`` nodes (allocated once)."""
        out = []
        for rank, dev in zip(self.ranks, self.devices):
            with cupy().cuda.Device(dev):
                out.append(rank.new_tree_scratch(max_nodes))
        return MeshScratch(out)

    def verify_tree(self, state: MeshState, scratch: MeshScratch, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> Any:
        """Run a draft tree after the committed tokens on every rank (verify.py's contract: attention rows ≥ P are
        scratch until commit, sections are read only). Returns logits [N, V] float32 on devices[0], row i with the bits of
        the mesh's plain decode of node i after its path. Raises: ValueError on a malformed tree, a bad id, too
        many nodes or a tree past the state's end."""
        cp = cupy()
        depths = check_tree(self.hp, state.ranks[0], scratch.max_nodes, token_ids, parent_ids)
        order = tree_plan(parent_ids)
        rows = np.asarray([list(parent_ids), order.order, order.restore, order.save, depths], dtype=np.int32)
        for sc, s, dev in zip(scratch.ranks, state.ranks, self.devices):
            with cp.cuda.Device(dev):
                sc.begin(list(parent_ids), depths, s.length)
                table = cp.asarray(rows)  # every index table of the round in one copy a rank
                sc.tables = (order, table[:4], table[4], table[0])

        def mixer(r: int, i: int, lw: _Layer, h: Any) -> Any:
            rank, s, sc = self.ranks[r], state.ranks[r], scratch.ranks[r]
            if isinstance(lw.mixer, _Attn):
                return rank._attn_tree(i, lw.mixer, h, s, sc)
            return rank._gdn_tree(i, lw.mixer, h, s, sc)

        with self._launch_checks("verify"):
            return self._head(self._layers(self._embed(token_ids), mixer))

    def commit(self, state: MeshState, scratch: MeshScratch, path: Sequence[int]) -> None:
        """Append the accepted ``path`` (root-to-node chain of the last verify) on every rank (no reduction: each
        rank keeps its own heads' rows and states), with the bits of decoding its tokens one by one.
        Raises: ValueError for a bad path or a state moved since verify (before any rank changes)."""
        check_commit_path(state.length, scratch.ranks[0], path)
        for rank, s, sc, dev in zip(self.ranks, state.ranks, scratch.ranks, self.devices):
            with cupy().cuda.Device(dev):
                rank._commit_layers(s, sc, path)
        state.length += len(path)

    def _head(self, normed: Sequence[Any]) -> Any:
        """Logits [T, V] float32 on devices[0]: each rank's vocabulary rows of its normed hidden [T, E],
        all-gathered and laid side by side in rank order (copies: exact)."""
        cp = cupy()
        parts = []
        for rank, h, dev in zip(self.ranks, normed, self.devices):
            with cp.cuda.Device(dev):
                parts.append(cp.ascontiguousarray(rank.head.matmul(h)))
        gathered = self.collective.all_gather(parts)[0]  # [n, T, V / n] on devices[0]
        with cp.cuda.Device(self.devices[0]):
            return cp.ascontiguousarray(cp.moveaxis(gathered, 0, 1)).reshape(int(gathered.shape[1]), -1)
