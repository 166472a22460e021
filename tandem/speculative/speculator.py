"""The speculation side of a round: drafters → one tree → StairCut prefix; bookkeeping after commit.

The engine's loop (tandem/engine.py) owns verify, the accept walk and emission; this object owns everything that
decides *what* to verify: the drafters (each ``reset``/``extend`` with committed tokens and, when it needs them,
the target's post-final-norm hidden states; ``propose(root, max_nodes, max_depth) -> Fragment``), the acceptance
estimates, the price curve and the per-sequence verify scratch (allocated once, reused every round).

Modes: ``lookup`` (prompt lookup), ``mtp`` (the checkpoint's MTP head), ``auto`` (both when the head exists).
Policies: ``staircut`` (price the tree) or ``all`` (verify every proposed node, up to ``max_nodes``).
"""

from __future__ import annotations

import json
import platform
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.models.protocol import Model, SpeculativeModel, draft_head_source, plan_recordings, tree_verifier
from tandem.speculative.acceptance import AcceptanceStats
from tandem.speculative.lookup import LookupDrafter
from tandem.speculative.mtp_drafter import MTPDrafter
from tandem.speculative.staircut import PriceCurve, stair_cut
from tandem.speculative.tree import DraftTree, Fragment

MODES = ("off", "lookup", "mtp", "auto")
# The `--spec default` of each device, where it was measured (docs/performance.md, "Speculation on the embedded
# model"): on the CPU prompt lookup pays on every prompt of bench/spec.py (embedded model, greedy, 128 tokens:
# 96-98 -> 127-136 tok/s), MTP does not (80-92); on the H200 every mode loses on the embedded model (plain 2772-3012
# tok/s, lookup 1863-2205: a verify costs several launch-bound steps and speculative rounds do not run a step
# ahead), and the 27B shape is measured with oracle drafts only (bench/spec_scale.py), not with its drafters on
# real prompts, so the GPU stays off until that figure exists.
DEFAULT_MODES = {"cpu": "lookup", "cuda": "off"}


def default_mode(device: str) -> str:
    """The speculation mode `--spec default` picks on ``device`` ("cpu" / "cuda"): DEFAULT_MODES, "off" elsewhere."""
    return DEFAULT_MODES.get(device, "off")
PROFILES = Path(__file__).resolve().parents[2] / "profiles"


class Drafter(Protocol):
    """A source of guesses (see the module docstring)."""

    name: str
    needs_hidden: bool

    def reset(self, ids: list[int], hidden: Any = None, max_len: int = 0) -> None: ...

    def extend(self, ids: list[int], hidden: Any = None) -> None: ...

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment: ...


def device_name() -> str:
    """The CPU's profile key, e.g. ``cpu-amd-epyc-9654`` (lower case, non-alphanumerics as dashes)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    except OSError:
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    return "cpu-" + (slug or "unknown")


# A GPU without a profile of its own starts from this one's shape (a GPU's verify is a staircase, far from the
# built-in CPU-shaped line); the engine's online rescaling then fixes the level.
GPU_FALLBACK_PROFILE = "cuda-nvidia-h200"


def load_curve(model_name: str, max_nodes: int, device: str | None = None) -> PriceCurve:
    """The price curve of ``model_name`` from profiles/<device>.json (its ``curves[model_name]``, else its first
    curve); for a GPU (``cuda-*``) without a file, from GPU_FALLBACK_PROFILE's; else the built-in fallback line."""
    device = device or device_name()
    path = PROFILES / f"{device}.json"
    if not path.is_file() and device.startswith("cuda-"):
        path = PROFILES / f"{GPU_FALLBACK_PROFILE}.json"
    points: list[tuple[int, float]] = []
    if path.is_file():
        curves = json.loads(path.read_text()).get("curves", {})
        curve = curves.get(model_name) or (next(iter(curves.values())) if curves else None)
        if curve:
            points = [(int(n), float(ms)) for n, ms in curve["verify_ms"]]
    return PriceCurve(points, max_nodes)


PROBE_START, PROBE_MAX, PROBE_NODES = 4, 64, 4


class Speculator:
    """Drafters, acceptance estimates, price curve and verify scratch of one engine (one sequence at a time).

    Args:
        model: the adapter (``new_tree_scratch``; ``draft_heads`` for MTP).
        drafters: the sources of guesses (index = source id in the tree).
        max_nodes: the largest tree verified (root included).
        policy: "staircut" or "all".
        curve: the price curve (default: ``load_curve``).
        fallback_from: drafters from this index on run only when the earlier ones proposed nothing this round
            (default: all drafters always run).
    """

    def __init__(self, model: SpeculativeModel[Any, Any], drafters: Sequence[Drafter], max_nodes: int = 32,
                 policy: str = "staircut", curve: PriceCurve | None = None, model_name: str = "model",
                 fallback_from: int | None = None) -> None:
        if policy not in ("staircut", "all"):
            raise ValueError(f"policy must be 'staircut' or 'all', got {policy!r}")
        self.model = model
        self.drafters = list(drafters)
        self.max_nodes = max_nodes
        self.policy = policy
        # a device model names its own price profile (profile_device, e.g. cuda-nvidia-h200); else this CPU's
        self.curve = curve if curve is not None else load_curve(model_name, max_nodes,
                                                                model.capabilities.profile_device)
        routing = model.capabilities.expert_routing  # rows that read routed experts: distinct experts priced
        if curve is None and routing is not None:
            self.curve.with_routing(*routing)
        self.acceptance = AcceptanceStats(len(self.drafters))
        self.scratch = model.new_tree_scratch(max_nodes)
        self.needs_hidden = any(d.needs_hidden for d in self.drafters)
        self.draft_ms = 0.0
        self.commit_ms = 0.0
        self.backoff = 0  # rounds to skip drafting after StairCut chose plain steps (costly drafters only)
        # the most nodes a tree may keep now (None: max_nodes): an engine's slots in joint rounds share a pass's rows
        self.node_cap: Callable[[], int] | None = None
        self.skip = 0
        # Exploration: acceptance estimates learn only from verified guesses, so when StairCut keeps choosing
        # plain steps, every ``probe_every`` such rounds the best PROBE_NODES guesses are verified anyway
        # (the interval doubles while probes do not pay, and resets when StairCut speculates on its own).
        self.probe_every = PROBE_START
        self.since_probe = 0
        self.fallback_from = fallback_from if fallback_from is not None else len(self.drafters)

    @classmethod
    def for_mode(cls, model: Model[Any], mode: str, max_nodes: int = 32, model_name: str = "model"
                 ) -> Speculator | None:
        """The speculator of a ``--spec`` mode; None for "off". Raises ValueError for an unknown mode, or "mtp"
        on a checkpoint without an MTP head or a model without ``capabilities.tree_verify``."""
        if mode not in MODES:
            raise ValueError(f"spec must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "off":
            return None
        target = tree_verifier(model)
        if target is None:
            if mode == "auto":
                return None
            raise ValueError("this model's adapter has no verify_tree; use --spec off")
        drafters: list[Drafter] = []
        if mode in ("lookup", "auto"):
            drafters.append(LookupDrafter())
        if mode in ("mtp", "auto"):
            source = draft_head_source(model)
            head = source.draft_heads() if source is not None else None
            if head is not None:
                drafters.append(MTPDrafter(head))
            elif mode == "mtp":
                raise ValueError("this checkpoint has no MTP layer (mtp.*); use --spec lookup")
        # auto: prompt lookup first (nearly free); the MTP head drafts only when lookup finds nothing
        return cls(target, drafters, max_nodes, model_name=model_name, fallback_from=1 if mode == "auto" else None)

    # ------------------------------------------------------------------------------------------- per sequence
    def reset(self, ids: list[int], hidden: np.ndarray | None, max_len: int) -> None:
        """A new sequence with committed prompt ``ids`` (hidden [T, E] when ``needs_hidden``)."""
        self.skip = self.backoff = self.since_probe = 0
        self.probe_every = PROBE_START
        for d in self.drafters:
            d.reset(ids, hidden, max_len)

    def extend(self, ids: list[int], hidden: np.ndarray | None) -> None:
        """Tokens just committed to the state (hidden [k, E] when ``needs_hidden``)."""
        for d in self.drafters:
            d.extend(ids, hidden)

    def draft(self, root: int, max_depth: int, valid_prefix: Callable[[list[int]], int] | None = None) -> DraftTree:
        """The tree to verify after the pending ``root``: every drafter's guesses, cut by the policy.

        ``max_depth`` bounds the guesses' depth (tokens left in the budget minus the bonus token);
        ``valid_prefix`` (a grammar's) prunes guesses it would never allow before the policy prices the tree.
        """
        t0 = time.perf_counter()
        recorded = self.recordings()
        tree = DraftTree(root)
        if self.skip > 0:
            self.skip -= 1
            return tree
        if self.node_cap is not None and self.node_cap() <= 1:  # the joint round allows no tree: no drafting
            return tree
        if max_depth > 0:
            for source, d in enumerate(self.drafters):
                if source >= self.fallback_from and len(tree) > 1:
                    break  # the cheap drafters already guessed: skip the costly fallback ones
                frag = d.propose(root, self.max_nodes - 1, max_depth)
                depths = [0] * len(frag)
                for j in range(len(frag)):
                    p = frag.parents[j]
                    depths[j] = 1 if p < 0 else depths[p] + 1
                probs = [self.acceptance.edge_prob(source, depths[j], frag.confidences[j]) for j in range(len(frag))]
                tree.merge(frag, source, probs, max_depth, 4 * self.max_nodes)
        if valid_prefix is not None and len(tree) > 1:
            tree = tree.pruned(valid_prefix)
        if self.policy == "all":
            num = self.max_nodes
        else:
            ranked = [tree.probs[i] for i in tree.ranked()]
            num = stair_cut(ranked, self.curve, self.draft_ms, self.commit_ms)
            num = self._recorded_size(self._explore(num, len(tree)), len(tree))
        if self.node_cap is not None:  # the slots' joint round: a share of the pass's rows
            num = max(1, min(num, self.node_cap()))
        tree = tree.prefix(num) if len(tree) > num else tree
        if self.recordings() == recorded:  # a drafter's plan recording (the device MTP head's) is not its price
            self.draft_ms = 0.8 * self.draft_ms + 0.2 * (time.perf_counter() - t0) * 1e3
        if len(tree) > 1:
            self.backoff = 0
        elif self.draft_ms > 0.1 * self.curve.price(1):  # drafting costs and did not pay: probe less often
            self.backoff = min(16, max(1, 2 * self.backoff))
            self.skip = self.backoff
        return tree

    def _recorded_size(self, num: int, tree_size: int) -> int:
        """A tree size the model verifies from a recorded plan (its ``capabilities.verify_sizes``, e.g. the CUDA
        model's: each size is recorded once, at a host-time cost far above a replay's), near ``num``: the smallest
        one ≥ num that the tree fills, else the largest one the tree fills. ``num`` where the model has none, or for
        a plain step."""
        sizes: Sequence[int] = self.model.capabilities.verify_sizes
        if not sizes or num <= 1:
            return num
        fits = [s for s in sizes if 1 < s <= tree_size]
        if not fits:
            return num
        return next((s for s in fits if s >= num), fits[-1])

    def _explore(self, num: int, tree_size: int) -> int:
        """StairCut's node count, or a probe of the best guesses when it has chosen plain steps for a while."""
        if num > 1:
            self.since_probe, self.probe_every = 0, PROBE_START
            return num
        if tree_size <= 1:
            return num
        self.since_probe += 1
        if self.since_probe < self.probe_every:
            return num
        self.since_probe = 0
        self.probe_every = min(PROBE_MAX, 2 * self.probe_every)
        return min(tree_size, 1 + PROBE_NODES)

    def observe(self, tree: DraftTree, path: list[int], verify_ms: float, commit_ms: float,
                priced: bool = True, commit_priced: bool = True) -> None:
        """After a verified round: acceptance estimates, the price curve and the commit cost. ``priced`` /
        ``commit_priced`` False (the verify / the commit recorded a launch plan, see ``recordings``) keep that time
        out of the prices."""
        self.acceptance.observe_round(tree, path)
        if priced:
            self.curve.observe(len(tree), verify_ms)
        if len(tree) > 1 and commit_priced:
            self.commit_ms = 0.8 * self.commit_ms + 0.2 * commit_ms

    def recordings(self) -> int:
        """The model's launch-plan recordings so far (``capabilities.plan_recordings``; 0 for a model without plans).
        A round whose count moved paid for a recording once (several times the replay it prices,
        docs/performance.md); priced with it, StairCut would take verifies for that much dearer and keep choosing
        plain steps long after (the engine compares the count around each round's timed work)."""
        return plan_recordings(self.model)
