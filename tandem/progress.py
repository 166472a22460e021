"""Progress on stderr: a tqdm bar on a terminal, else throttled log lines (one every `interval_s`, and the last).

A log file or a service manager then records how a long load or quantisation goes, without a line per step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")


class LineProgress:
    """A tqdm-like counter (`update`, `close`, iteration) writing "desc: n/total unit (p%)" lines.

    Args:
        total: the number of steps; desc, unit: the line's words; file: where lines go; interval_s: the least
        time between two lines (the first step and the last always write).
    """

    def __init__(self, total: int, desc: str, unit: str, file: TextIO, interval_s: float = 5.0,
                 items: Iterable[Any] | None = None) -> None:
        self.total, self.desc, self.unit, self.file, self.interval_s = total, desc, unit, file, interval_s
        self.n = 0
        self.items = items
        self.t0 = time.monotonic()
        self.last = -interval_s

    def update(self, n: int = 1) -> None:
        """Count `n` more steps; write a line when due."""
        self.n += n
        now = time.monotonic()
        if self.n == n or self.n >= self.total or now - self.last >= self.interval_s:
            self.last = now
            pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}{pct}, {now - self.t0:.1f} s", file=self.file,
                  flush=True)

    def close(self) -> None:
        """Nothing to tear down (the last step wrote its line)."""

    def __iter__(self) -> Iterator[Any]:
        for item in self.items or ():
            yield item
            self.update(1)


def progress(total: int, desc: str, unit: str, items: Iterable[T] | None = None, file: TextIO | None = None) -> Any:
    """A tqdm bar when `file` (default stderr) is a terminal, else a LineProgress; iterate it when `items` is
    given."""
    out = file or sys.stderr
    if out.isatty():
        from tqdm import tqdm

        return tqdm(items, total=total, desc=desc, unit=unit, file=out, leave=False)
    return LineProgress(total, desc, unit, out, items=items)
