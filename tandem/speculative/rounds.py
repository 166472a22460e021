"""The speculative loop: draft → price → verify → accept → commit, one round at a time (DESIGN.md, one round).

Exactness: each token is chosen by ``tandem.choose`` from the verified row of its node, which holds a plain
decode's bits at its absolute position, with the committed path's penalty history, and pushed through the same
``Output`` as a plain round; so speculative output equals plain output token for token, finish reason included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tandem import choose
from tandem.generation import Constraint, GenerationChunk, GenerationStats, RoundStats
from tandem.models.protocol import SpeculativeModel
from tandem.output import Output
from tandem.sampling import PenaltyState, SamplingParams
from tandem.speculative.speculator import Speculator


def speculative_rounds(model: SpeculativeModel[Any, Any], spec: Speculator, ids: list[int], state: Any,
                       params: SamplingParams, seed: int, penalties: PenaltyState, out: Output, stats: GenerationStats,
                       cancelled: Callable[[], bool] | None, constraint: Constraint | None,
                       sync: Callable[[], None]) -> Iterator[GenerationChunk]:
    """Speculative rounds. Each round: the pending root token (chosen, emitted, not yet run) plus the
    drafters' guesses are verified in one pass; the walk from the root chooses each next token from the
    verified logits exactly as a plain decode would, accepting a guess when it equals the choice; the
    accepted path is committed and the last choice (the bonus token) becomes the next root. A constraint
    masks every choice as in a plain round, and prunes guesses it would never allow.

    ``model`` is the target model's adapter (``prefill``, ``decode``, ``verify_tree``, ``commit``); ``state`` a fresh
    state of it; ``out`` collects and stops the tokens; ``sync`` waits for a device model's queued work (so the
    round's clocks measure it). Yields a chunk per round, the last with its finish reason.
    Raises: ValueError when no token is left to choose (every logit -inf, NaN or masked).
    """
    pen = penalties if penalties.active else None
    valid_prefix = getattr(constraint, "valid_prefix", None)
    hidden: list[np.ndarray] | None = [] if spec.needs_hidden else None
    logits = model.prefill(state, ids, hidden_out=hidden) if hidden is not None else model.prefill(state, ids)
    spec.reset(list(ids), np.concatenate(hidden) if hidden is not None else None, state.max_len)
    token = choose.constraint_choose(logits, constraint, params, pen, seed, state.length)
    penalties.add(token)
    finish = out.push(token, logits)
    round_stats: RoundStats | None = None
    while True:
        if finish is None and cancelled is not None and cancelled():
            finish = out.abort()
        yield out.chunk(finish, round_stats)
        if finish is not None:
            return
        t0 = time.perf_counter()
        tree = spec.draft(token, out.budget - out.count - 1, valid_prefix)
        t1 = time.perf_counter()
        recorded = spec.recordings()  # work that records a launch plan is left out of the prices
        if len(tree) == 1:  # StairCut (or the drafters) chose a plain step
            hid: list[np.ndarray] | None = [] if hidden is not None else None
            logits = model.decode(state, token, hidden_out=hid) if hid is not None else model.decode(state, token)
            sync()
            t2 = time.perf_counter()
            spec.extend([token], np.concatenate(hid) if hid is not None else None)
            if spec.recordings() == recorded:
                spec.curve.observe(1, (t2 - t1) * 1e3)
            token = choose.constraint_choose(logits, constraint, params, pen, seed, state.length)
            penalties.add(token)
            finish = out.push(token, logits)
            round_stats = RoundStats(1, 1, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
            stats.rounds.append(round_stats)
            continue
        all_logits = model.verify_tree(state, spec.scratch, tree.token_ids, tree.parent_ids)
        sync()
        t2 = time.perf_counter()
        chosen: list[int] | None = None  # device rows without masks or penalties: every node's choice at once
        if constraint is None and pen is None and not isinstance(all_logits, np.ndarray):
            chosen = choose.device_choose_rows(all_logits[:len(tree)], params, seed,
                                         [state.length + d + 1 for d in tree.depths])
        node, path, num = 0, [0], 0
        while True:  # the accept walk
            row = all_logits[node]
            token = choose.checked_id(chosen[node]) if chosen is not None else \
                choose.constraint_choose(row, constraint, params, pen, seed, state.length + tree.depths[node] + 1)
            penalties.add(token)
            num += 1
            finish = out.push(token, row)
            child = tree.child_with(node, token)
            if finish is not None or child < 0:
                break
            node = child
            path.append(node)
        t3 = time.perf_counter()
        verify_priced = spec.recordings() == recorded  # the verify's own recording (a new tree size)
        recorded = spec.recordings()
        if finish is None:  # a finished generation needs no commit
            model.commit(state, spec.scratch, path)
            sync()
            spec.extend([tree.token_ids[n] for n in path],
                        spec.scratch.hidden[np.asarray(path)] if hidden is not None else None)
        t4 = time.perf_counter()
        # the price of a verify is what the round spends on the tree: the pass and the accept walk (its rows'
        # choices: on a device one launch and a read), next to a plain step's decode
        spec.observe(tree, path, (t3 - t1) * 1e3, (t4 - t3) * 1e3, priced=verify_priced,
                     commit_priced=spec.recordings() == recorded)  # the commit's (a new path length)
        round_stats = RoundStats(num, len(tree), (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t4 - t3) * 1e3)
        stats.rounds.append(round_stats)
