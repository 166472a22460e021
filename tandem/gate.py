"""The quality gate: a quantised (candidate) model against its unquantised base on held-out texts.

Figures, all in one process with both models loaded by the engine:
- teacher-forced NLL (nats/token) of each text under both models, and the delta (candidate − base);
- top-1 agreement of the two models' next-token choices at every position, and at confident positions (base
  top-1 minus top-2 ≥ 1 logit), where a disagreement is a real change rather than a near tie;
- a free greedy generation from each text's opening: distinct 4-gram share and longest repeated span (tokens),
  which catch the loops that a quantised model can fall into while its NLL still looks fine.
Thresholds come from a profile (profiles/gate.json); the gate passes when every check holds on every text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CONFIDENT_MARGIN = 1.0  # logits between the base model's top-1 and top-2
CHUNK_TOKENS = 512
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "gate.json"
HELDOUT_NAME = "heldout_prompts.json"


class GateInputError(ValueError):
    """Bad gate input: no texts, unreadable files, a text too short, mismatched vocabularies, a bad profile."""


@dataclass
class TextFigures:
    """Teacher-forced figures of one text (over `num_tokens` − 1 predicted positions)."""

    name: str
    num_tokens: int
    nll_base: float
    nll_cand: float
    top1_agree: float
    confident_agree: float
    num_confident: int

    @property
    def nll_delta(self) -> float:
        return self.nll_cand - self.nll_base


@dataclass
class GenFigures:
    """Greedy generation of `num_tokens` tokens from a text's opening, for base and candidate."""

    name: str
    num_tokens: int
    distinct4_base: float
    distinct4_cand: float
    repeat_base: int
    repeat_cand: int
    first_divergence: int  # index of the first generated token that differs (num_tokens when none)


@dataclass
class GateResult:
    """All figures and the checks against the profile's thresholds."""

    texts: list[TextFigures]
    gens: list[GenFigures]
    checks: list[tuple[str, float, str, bool]] = field(default_factory=list)  # (what, value, bound, ok)

    @property
    def passed(self) -> bool:
        return all(ok for *_, ok in self.checks)


def next_token_figures(model: Any, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-force `ids` through `model` (adapter with `new_state` / `prefill`).

    Returns: nll [T-1] float64 (−log p(ids[t+1] | ids[..t])), top1 [T-1] int64, margin [T-1] float32
    (top-1 minus top-2 logit).
    Raises: GateInputError when the logits hold NaN or inf.
    """
    state = model.new_state(len(ids))
    nll, top1, margin = [], [], []
    for start in range(0, len(ids) - 1, CHUNK_TOKENS):
        piece = list(ids[start:min(start + CHUNK_TOKENS, len(ids) - 1)])
        logits = np.asarray(model.prefill(state, piece, all_logits=True), dtype=np.float64)  # [t, V]
        if not np.isfinite(logits).all():
            raise GateInputError(f"the model's logits are not finite (NaN or inf) from token {start} on: its "
                                 "weights (or block scales) are broken")
        target = np.asarray(ids[start + 1:start + 1 + len(piece)])
        top = logits.max(axis=1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll.append(lse - logits[np.arange(len(piece)), target])
        part = np.partition(logits, -2, axis=1)[:, -2:]
        top1.append(logits.argmax(axis=1))
        margin.append((part[:, 1] - part[:, 0]).astype(np.float32))
    return np.concatenate(nll), np.concatenate(top1), np.concatenate(margin)


def greedy(model: Any, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """`num_tokens` argmax tokens after `prompt` (no stop ids: loops must show)."""
    state = model.new_state(len(prompt) + num_tokens)
    logits = model.prefill(state, list(prompt))
    out: list[int] = []
    for i in range(num_tokens):
        out.append(int(np.argmax(logits)))
        if i + 1 < num_tokens:
            logits = model.decode(state, out[-1])
    return out


def distinct4(tokens: Sequence[int]) -> float:
    """Share of distinct 4-grams among all 4-grams (1.0 for fewer than 4 tokens)."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_repeat(tokens: Sequence[int]) -> int:
    """Length of the longest token span that occurs twice (occurrences may overlap), O(n²)."""
    n, best = len(tokens), 0
    for shift in range(1, n):
        run = 0
        for i in range(n - shift):
            run = run + 1 if tokens[i] == tokens[i + shift] else 0
            best = max(best, run)
    return best


def compare(base: Any, cand: Any, texts: Sequence[tuple[str, list[int]]], gen_prompt_tokens: int = 32,
            gen_tokens: int = 64) -> tuple[list[TextFigures], list[GenFigures]]:
    """Figures of `cand` against `base` (both adapters) on tokenised texts [(name, ids)]."""
    figs, gens = [], []
    for name, ids in texts:
        nb, tb, mb = next_token_figures(base, ids)
        nc, tc, _ = next_token_figures(cand, ids)
        confident = mb >= CONFIDENT_MARGIN
        agree = tb == tc
        figs.append(TextFigures(name, len(ids), float(nb.mean()), float(nc.mean()), float(agree.mean()),
                                float(agree[confident].mean()) if confident.any() else 1.0, int(confident.sum())))
        if gen_tokens > 0:
            prompt = ids[:min(gen_prompt_tokens, len(ids))]
            gb, gc = greedy(base, prompt, gen_tokens), greedy(cand, prompt, gen_tokens)
            diverge = next((i for i, (x, y) in enumerate(zip(gb, gc)) if x != y), gen_tokens)
            gens.append(GenFigures(name, gen_tokens, distinct4(gb), distinct4(gc), longest_repeat(gb),
                                   longest_repeat(gc), diverge))
    return figs, gens


def load_profile(path: str | Path | None) -> dict[str, float | None]:
    """Read gate thresholds (profiles/gate.json by default). Raises GateInputError on a bad file."""
    p = Path(path) if path is not None else DEFAULT_PROFILE
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        thresholds = data["thresholds"]
        return {str(k): (None if v is None else float(v)) for k, v in thresholds.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GateInputError(f"{p}: not a gate profile with a 'thresholds' object ({e})") from e


def check(figs: list[TextFigures], gens: list[GenFigures], thr: dict[str, float | None]) -> GateResult:
    """Apply thresholds (a None or absent threshold is not checked): the worst text of each figure, except the
    distinct 4-gram drop, taken as the mean over texts."""
    res = GateResult(figs, gens)

    def add(what: str, value: float, key: str, upper: bool) -> None:
        bound = thr.get(key)
        if bound is not None:
            ok = value <= bound if upper else value >= bound
            res.checks.append((what, value, f"{'≤' if upper else '≥'} {bound:g}", ok))

    add("NLL delta, worst text (nats/token)", max(f.nll_delta for f in figs), "max_nll_delta_nats", True)
    add("top-1 agreement, worst text", min(f.top1_agree for f in figs), "min_top1_agreement", False)
    add("top-1 agreement at confident positions, worst text", min(f.confident_agree for f in figs),
        "min_confident_top1_agreement", False)
    if gens:
        # Mean over texts: one greedy continuation wanders after its first divergence, so a single text's
        # share is noisy; a collapsed model (one phrase on repeat) drops it on every text.
        add("distinct 4-gram share drop vs base, mean over texts",
            sum(g.distinct4_base - g.distinct4_cand for g in gens) / len(gens), "max_distinct4_drop", True)
        add("longest repeat growth vs base (tokens), worst text",
            max(g.repeat_cand - g.repeat_base for g in gens), "max_longest_repeat_growth", True)
    return res


def format_result(res: GateResult, base: str, cand: str) -> str:
    """A plain-text table of the figures and the checks."""
    lines = [f"gate: candidate {cand} vs base {base}",
             f"{'text':<24} {'tokens':>6} {'NLL base':>9} {'NLL cand':>9} {'delta':>8} {'top-1':>7} "
             f"{'conf top-1':>10} {'n conf':>6}"]
    for f in res.texts:
        lines.append(f"{f.name[:24]:<24} {f.num_tokens:>6} {f.nll_base:>9.4f} {f.nll_cand:>9.4f} "
                     f"{f.nll_delta:>+8.4f} {f.top1_agree:>7.4f} {f.confident_agree:>10.4f} {f.num_confident:>6}")
    if res.gens:
        lines.append(f"{'greedy generation':<24} {'tokens':>6} {'dist4 b':>9} {'dist4 c':>9} {'rep b':>8} "
                     f"{'rep c':>7} {'diverge@':>10}")
        for g in res.gens:
            lines.append(f"{g.name[:24]:<24} {g.num_tokens:>6} {g.distinct4_base:>9.4f} {g.distinct4_cand:>9.4f} "
                         f"{g.repeat_base:>8} {g.repeat_cand:>7} {g.first_divergence:>10}")
    for what, value, bound, ok in res.checks:
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}: {value:.4f} (need {bound})")
    lines.append(f"gate {'PASSED' if res.passed else 'FAILED'}")
    return "\n".join(lines)


def _prose_share(text: str) -> float:
    return sum(c.isalpha() or c == " " for c in text) / max(len(text), 1)


def read_texts(files: Sequence[str], base_dir: Path, default_dir: Path) -> list[tuple[str, str]]:
    """Texts to gate on: each --text file (a .json list of strings gives one text per item); with none, the
    held-out prompts (`heldout_prompts.json` of the base, else of the embedded model) split by their share of
    letters and spaces into a prose-like text and a code text.

    Raises: GateInputError when a file cannot be read or there is nothing to gate on.
    """
    texts: list[tuple[str, str]] = []
    for f in files:
        try:
            raw = Path(f).read_text(encoding="utf-8")
            items = json.loads(raw) if f.endswith(".json") else raw
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise GateInputError(f"{f}: cannot read text ({e})") from e
        if isinstance(items, list) and all(isinstance(t, str) for t in items):
            texts += [(f"{Path(f).stem}[{i}]", t) for i, t in enumerate(items)]
        elif isinstance(items, str):
            texts.append((Path(f).name, items))
        else:
            raise GateInputError(f"{f}: a .json text file must hold a list of strings")
    if files:
        return texts
    for d in (base_dir, default_dir):
        held = d / HELDOUT_NAME
        if held.is_file():
            prompts = sorted(json.loads(held.read_text(encoding="utf-8")), key=_prose_share)
            half = len(prompts) // 2
            return [("heldout-prose", "\n".join(prompts[half:])), ("heldout-code", "\n".join(prompts[:half]))]
    raise GateInputError(f"no --text given and no {HELDOUT_NAME} next to the base model or the embedded model")


def run_gate(base_dir: str | Path, cand_dir: str | Path, text_files: Sequence[str] = (),
             profile: str | Path | None = None, max_tokens: int = 2048, gen_tokens: int = 64,
             as_json: bool = False) -> int:
    """`tandem gate`: load both models, compute figures, print a table (or JSON), return 0 pass / 1 fail.

    Raises: GateInputError (bad texts, profile or vocabularies), ConfigError / CheckpointError (bad models).
    """
    from tandem.engine import DEFAULT_MODEL, Engine

    thresholds = load_profile(profile)
    raw_texts = read_texts(text_files, Path(base_dir), DEFAULT_MODEL)
    base = Engine.from_pretrained(base_dir, device="cpu")
    cand = Engine.from_pretrained(cand_dir, device="cpu")
    if base.tokenizer is None:
        raise GateInputError(f"{base_dir}: the base model has no tokenizer.json to encode the texts")
    if base.vocab_size != cand.vocab_size:
        raise GateInputError(f"vocabularies differ: base {base.vocab_size}, candidate {cand.vocab_size}")
    texts = []
    for name, text in raw_texts:
        ids = base.tokenizer.encode(text)[:max_tokens]
        if len(ids) < 2:
            raise GateInputError(f"text {name!r} has {len(ids)} token(s); the gate needs at least 2")
        texts.append((name, ids))
    figs, gens = compare(base.model, cand.model, texts, gen_tokens=gen_tokens)
    res = check(figs, gens, thresholds)
    if as_json:
        print(json.dumps({"base": str(base_dir), "candidate": str(cand_dir), "passed": res.passed,
                          "texts": [vars(f) | {"nll_delta": f.nll_delta} for f in figs],
                          "generation": [vars(g) for g in gens],
                          "checks": [{"what": w, "value": v, "bound": b, "ok": ok} for w, v, b, ok in res.checks]},
                         indent=2))
    else:
        print(format_result(res, str(base_dir), str(cand_dir)))
    return 0 if res.passed else 1
