"""Reasoning split: follows the template's state, cut-off reasoning stays reasoning, streamed == whole."""

from __future__ import annotations

import pytest

from tandem.server.reasoning import ReasoningSplitter

CASES = [
    # (text, prompt ends inside <think>, reasoning, content)
    ("Let me think.\nStep 2.\n</think>\n\nThe answer is 4.", True, "Let me think.\nStep 2.", "The answer is 4."),
    ("\nhalf a thought, cut off by max_tok", True, "half a thought, cut off by max_tok", ""),
    ("cut right at </thi", True, "cut right at </thi", ""),
    ("Plain answer.", False, "", "Plain answer."),
    ("<think>\nold style\n</think>\n\nanswer", False, "old style", "answer"),
    ("  <think>x</think>y", False, "x", "y"),
    ("</think>\n\nno reasoning at all", True, "", "no reasoning at all"),
    ("a < b and <thin", False, "", "a < b and <thin"),
    ("<thinking is not a tag", False, "", "<thinking is not a tag"),
    ("r </think> c </think> d", True, "r", "c </think> d"),
]


def split(pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    s = ReasoningSplitter(in_reasoning)
    out = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_split_whole_and_streamed(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    assert split([text], in_reasoning) == (reasoning, content)
    for i in range(len(text) + 1):
        assert split([text[:i], text[i:]], in_reasoning) == (reasoning, content)
    assert split(list(text), in_reasoning) == (reasoning, content)


def test_streamed_reasoning_is_sent_early() -> None:
    s = ReasoningSplitter(True)
    assert s.push("thinking hard") == ("thinking hard", "")
    assert s.push(" still </thi") == (" still", "")  # the space and "</thi" wait: they may close the block
    assert s.push("nk>\n\nok") == ("", "ok")
