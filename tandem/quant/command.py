"""`tandem quantize`: calibrate (optional), quantise with a progress bar, print the summary."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.quant.calib import activation_mean_squares, calibration_tokens
from tandem.quant.quantize import quantize_checkpoint
from tandem.quant.search import DEFAULT_CLIPS


def run_quantize(src: str, dst: str, fmt: str, targets: Sequence[str], keep: Sequence[str] = (),
                 calib: str | None = None, calib_tokens: int = 4096, head_fp8: bool = False,
                 rtn: bool = False) -> int:
    """Quantise `src` into `dst` (see `quantize_checkpoint`); with `calib`, run the source model on that text
    first and search clips on its activations (unless `rtn`). Prints progress to stderr and a summary to stdout.

    Raises: ValueError (bad arguments, no tokenizer for calibration), ConfigError / CheckpointError.
    """
    act = None
    if calib is not None and not rtn:
        try:
            text = Path(calib).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{calib}: cannot read the calibration text ({e})") from e
        model, ids = calibration_tokens(src, text, calib_tokens)
        print(f"calibrating on {len(ids)} tokens of {calib}", file=sys.stderr)
        act = activation_mean_squares(model, ids)
        del model
    report = quantize_checkpoint(src, dst, fmt, targets, keep, head_fp8, act, DEFAULT_CLIPS, _bar)
    print(report.summary())
    return 0


def _bar(items: Sequence[str]) -> Any:
    from tandem.progress import progress

    return progress(len(items), "quantising", "module", items)
