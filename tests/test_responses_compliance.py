"""The Open Responses compliance suite (openresponses/openresponses at a pinned commit, run unchanged under a pinned
bun by tools/responses_compliance.sh) against `tandem serve` with the embedded model and --responses-events
open-responses, thinking on and off: no test may fail on what the server sends (the script's verdicts: passed,
model, expected, failed), and at least as many tests pass in each mode as MIN_PASSED says. The embedded model (chat
and image tuned) passed 17, 16, 16, 16 of 17 with thinking on and 17, 16, 17, 16 with it off in four runs: a test
that did not pass was a sampled answer that did not end inside the 384-token context. The floors leave room for that
spread.

Runs with TANDEM_COMPLIANCE=1: tools/test.sh sets it for its background session beside the interpreted pass (about two
minutes on a small CPU). Skipped when bun or the suite cannot be had (no npm, no network and no OPENRESPONSES_DIR)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from server_fixtures import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.compliance, pytest.mark.skipif(
    os.environ.get("TANDEM_COMPLIANCE") != "1", reason="runs with TANDEM_COMPLIANCE=1 (tools/test.sh sets it)")]

MIN_PASSED = {"thinking-on": 15, "thinking-off": 15}
_COUNT = re.compile(r"^responses_compliance: (\S+): (\d+) of (\d+) passed", re.M)


def test_open_responses_compliance_suite() -> None:
    # a 384-token context bounds an answer that would not end, so a run takes minutes at most and a WebSocket turn
    # ends inside the suite's 30 s
    run = subprocess.run(["bash", str(REPO_ROOT / "tools" / "responses_compliance.sh"), "--max-context", "384"],
                         capture_output=True, text=True, timeout=3000, cwd=REPO_ROOT)
    print(run.stdout)
    if run.returncode == 77:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    counts = {mode: (int(passed), int(total)) for mode, passed, total in _COUNT.findall(run.stdout)}
    assert set(counts) == {"thinking-on", "thinking-off"}, run.stdout
    for mode, (passed, total) in counts.items():
        least = MIN_PASSED[mode]
        assert passed >= least, f"{mode}: {passed} of {total} passed, at least {least} expected\n{run.stdout}"
