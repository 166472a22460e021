"""Split generated text into reasoning (inside <think>...</think>) and content, incrementally.

The Qwen3.5 template opens the think block in the prompt (spec/qwen3_5.md §11.2), so the split starts from the
template's state: `in_reasoning=True` when the rendered prompt ends inside an open think block. An output that
itself opens with `<think>` (earlier Qwen templates) enters reasoning too. Text cut off before `</think>` is
reasoning. Whitespace around the reasoning and at the start of the content is dropped (the template trims both).
Streaming and whole-text use the same object, so a streamed split concatenates to the non-streamed one.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Incremental reasoning/content splitter.

    Args:
        in_reasoning: the prompt ends inside an open think block.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.reasoning_started = False
        self.content_started = False

    def push(self, text: str) -> tuple[str, str]:
        """Add generated text; return (reasoning delta, content delta) safe to send now."""
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_START):
                self.state, self.buf = "reasoning", head[len(THINK_START):]
            elif THINK_START.startswith(head):
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buf.find(THINK_END)
            if end < 0:
                return self._reasoning_safe(), ""
            reasoning = self._reasoning_text(self.buf[:end].rstrip())
            self.state, self.buf = "content", self.buf[end + len(THINK_END):]
        if self.state == "content":
            content, self.buf = self._content_text(self.buf), ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of generation: (reasoning, content) still held back."""
        text, self.buf = self.buf, ""
        if self.state == "reasoning":
            return self._reasoning_text(text.rstrip()), ""
        return "", self._content_text(text)

    def _reasoning_safe(self) -> str:
        # Hold back a possible start of "</think>" and trailing whitespace (dropped if </think> follows).
        keep = _partial_suffix(self.buf, THINK_END)
        safe = self.buf[:len(self.buf) - keep]
        body = safe.rstrip()
        self.buf = safe[len(body):] + self.buf[len(safe):]
        return self._reasoning_text(body)

    def _reasoning_text(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _content_text(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text
