"""The Engine `constraint` of one server sequence: reasoning budget, then an llguidance grammar, min_tokens, closing.

Phases, in token order:
1. reasoning (the prompt ends inside an open think block): free, until `reasoning_limit` reasoning tokens have been
   written; then the mask holds only `</think>` (the thinking budget, and room kept for a forced answer). While
   an answer the grammar must hold is pending (a forced tool call or a response format: a grammar with no
   trigger), eos is not legal inside the reasoning, so the reasoning closes by `</think>` and the answer follows;
2. the answer: the grammar's mask at every position (None: free). With a `trigger_id` (tool_choice "auto") the
   answer is free until the model writes that token (`<tool_call>`); from there the grammar holds the call;
3. closing: once at most `close_tokens` of the budget are left while a grammar is active, the answer is steered to
   an end: eos when the grammar allows it, else the first of `closers` (token sequences such as
   `\\n</parameter>\\n`, `"`, `]`) the grammar accepts in full is forced token by token; when none fits, the
   grammar's own mask. A forced call therefore ends inside the budget unless the schema itself needs more.
`min_tokens` removes the eos ids from every mask until that many tokens are written (a grammar that is complete
still ends).

Every choice, plain or speculative, goes through the same chooser with `allowed()`, so speculation stays exact;
`valid_prefix` only prunes draft guesses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from tandem.server.grammar import GrammarCompiler

BoolMask = npt.NDArray[np.bool_]


class GrammarConstraint:
    """Reasoning budget + grammar + min_tokens + closing for one sequence (see the module docstring).

    Args:
        matcher: a fresh llguidance matcher for the answer, or None (no grammar).
        compiler: gives V and the eos ids.
        in_reasoning: the prompt ends inside an open think block.
        think_end_id: the `</think>` token id (None: the tokenizer has none; reasoning then ends only by text).
        budget_tokens: tokens this generation may write; reserve_tokens: kept for the answer when a grammar (or a
            trigger) is set, so reasoning is closed at budget_tokens - reserve_tokens at the latest.
        reasoning_budget: the thinking budget in tokens (None: unbounded but for the reserve).
        min_tokens: eos is masked until this many tokens are written.
        trigger_id: the grammar starts when this token is written (None: from the first answer token).
        closers: token sequences tried in order in the closing phase; close_tokens: its length in tokens.
    """

    def __init__(self, matcher: llguidance.LLMatcher | None, compiler: GrammarCompiler, *, in_reasoning: bool,
                 think_end_id: int | None, budget_tokens: int, reserve_tokens: int,
                 reasoning_budget: int | None = None, min_tokens: int = 0, trigger_id: int | None = None,
                 closers: Sequence[Sequence[int]] = (), close_tokens: int = 0) -> None:
        self.matcher = matcher
        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = list(compiler.eos_token_ids)
        self.in_reasoning = in_reasoning and think_end_id is not None
        self.think_end_id = think_end_id
        limit = budget_tokens - reserve_tokens if matcher is not None else budget_tokens
        if reasoning_budget is not None:
            limit = min(limit, reasoning_budget)
        self.reasoning_limit = max(0, limit)
        self.num_reasoning_tokens = 0
        self.budget_tokens = budget_tokens
        self.min_tokens = min_tokens
        self.trigger_id = trigger_id
        self.grammar_on = matcher is not None and trigger_id is None
        # a forced answer is pending: the reasoning may not end the sequence (eos masked until `</think>`)
        self.no_eos: BoolMask | None = None
        if self.grammar_on and self.in_reasoning:
            self.no_eos = np.ones(self.vocab_size, dtype=np.bool_)
            self.no_eos[self.eos_token_ids] = False
        self.closers = [list(c) for c in closers if c]
        self.close_tokens = close_tokens
        self.num_tokens = 0
        self.forced: list[int] = []

    def _only(self, ids: Sequence[int]) -> BoolMask:
        mask = np.zeros(self.vocab_size, dtype=np.bool_)
        mask[list(ids)] = True
        return mask

    def allowed(self) -> BoolMask | None:
        """[V] bool: the tokens allowed next (None: no restriction)."""
        mask = self._phase_mask()
        if self.num_tokens < self.min_tokens:
            if mask is None:
                mask = np.ones(self.vocab_size, dtype=np.bool_)
            without = mask.copy()
            without[self.eos_token_ids] = False
            if without.any():
                mask = without
        return mask

    def _phase_mask(self) -> BoolMask | None:
        if self.in_reasoning:
            if self.num_reasoning_tokens < self.reasoning_limit:
                return self.no_eos
            return self._only([self.think_end_id]) if self.think_end_id is not None else None
        if not self.grammar_on or self.matcher is None:
            return None
        if self.forced:
            return self._only(self.forced[:1])
        mask = self._grammar_mask(self.matcher)
        if self.num_tokens >= self.budget_tokens - self.close_tokens:
            ends = [t for t in self.eos_token_ids if mask[t]]
            if ends:
                return self._only(ends)
            for seq in self.closers:
                if self.matcher.validate_tokens(seq) == len(seq):
                    self.forced = list(seq)
                    return self._only(seq[:1])
        return mask

    def _grammar_mask(self, matcher: llguidance.LLMatcher) -> BoolMask:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(np.bool_)
        if matcher.is_error() or not mask.any():
            mask[:] = False
            mask[self.eos_token_ids] = True
        return mask

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` (a draft path) this constraint would accept from its current state, without
        consuming them (speculation prunes the rest). Exact for the reasoning and grammar phases; stops at the
        closing phase, at a trigger and at min_tokens (guesses there are pruned, never wrongly kept)."""
        n, in_reasoning, count = 0, self.in_reasoning, self.num_reasoning_tokens
        while n < len(tokens) and in_reasoning:
            if count >= self.reasoning_limit and tokens[n] != self.think_end_id:
                return n
            if self.no_eos is not None and not self.no_eos[tokens[n]]:
                return n
            count += 1
            in_reasoning = tokens[n] != self.think_end_id
            n += 1
        if self.matcher is None:
            return n if self.num_tokens + n < self.min_tokens else len(tokens)
        stop = min(len(tokens), max(n, self.budget_tokens - self.close_tokens - self.num_tokens))
        if self.forced or n >= stop:
            return n
        if not self.grammar_on:
            k = n
            while k < stop and tokens[k] != self.trigger_id:
                k += 1
            return k
        if self.matcher.is_error():
            return n
        return n + int(self.matcher.validate_tokens(tokens[n:stop]))

    def advance(self, token_id: int) -> None:
        """Consume the chosen token."""
        self.num_tokens += 1
        if self.in_reasoning:
            self.num_reasoning_tokens += 1
            self.in_reasoning = token_id != self.think_end_id
            return
        if self.matcher is None:
            return
        if not self.grammar_on:
            if token_id != self.trigger_id:
                return
            self.grammar_on = True
        if self.forced:
            self.forced = self.forced[1:] if self.forced[0] == token_id else []
        self.matcher.consume_token(token_id)
