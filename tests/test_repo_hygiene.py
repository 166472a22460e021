"""The tree holds only product: no patch files, no file names that carry a sitting number (``_s17.json``), and no
text that narrates in which numbered session work was done ("session 12", "sessions 18-25"). Measured figures and
the experiments that were not kept live in docs/performance.md, with the commits that hold them.

Checks the files git tracks (skipped outside a git checkout, e.g. the scratch copy of the compiled-build pass).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SELF = "tests/test_repo_hygiene.py"
NUMBERED_NAME = re.compile(r"_s[0-9]+[._]")
NARRATION = re.compile(r"\bsessions?[ -][0-9]+", re.IGNORECASE)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (git ls-files failed)")
    files = [f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("git tracks no files here")
    return files


def test_no_patch_files_are_tracked() -> None:
    patches = [f for f in _tracked() if f.endswith(".patch")]
    assert not patches, f"patch files in the tree (git history keeps them): {patches}"


def test_no_file_name_carries_a_sitting_number() -> None:
    named = [f for f in _tracked() if NUMBERED_NAME.search(Path(f).name)]
    assert not named, f"file names with a sitting number: {named}"


def test_no_text_narrates_numbered_sessions() -> None:
    hits: list[str] = []
    for name in _tracked():
        if name == SELF:
            continue
        path = REPO / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (weights, archives)
        for lineno, line in enumerate(text.splitlines(), 1):
            m = NARRATION.search(line)
            if m:
                hits.append(f"{name}:{lineno}: {m.group(0)}")
    assert not hits, "text that narrates numbered sessions:\n" + "\n".join(hits)
