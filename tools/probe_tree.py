"""Make a timing probe: a copy of the tree (cuda/, tandem/, bench/) with named edits applied to cuda/gemv.cu that keep a
kernel's work but not its bits (other addresses, a skipped step), so one lease can time base and probe alternately
before anything is built properly (bench/results/cuda_notes.md, session 10: the tile-major NVFP4 scales were found
this way). Never merge a probe: its outputs are wrong.

python3 tools/probe_tree.py DEST PROBE[,PROBE...]; then e.g. (cd DEST && python3 bench/decode.py ...)

Probes:
  no_tail      the residual + norm GEMVs skip the ticket and the last block's norm (the bound on removing the tail)
  half_fold    warpgroup verify launches of 2 or 4 class groups write and fold only the even classes' sums (the
               class-group workspace traffic a pairwise pre-fold would save, about half)
  x_coalesced  the one-row GEMV's x loads: a quad's lanes read 64 contiguous bytes an instruction (session 10: no
               gain)
  glu_waves    the one-row GLU GEMV skips its last partial wave (blocks past the last multiple of 528 = 4 blocks an SM
               × 132 SMs) when that wave holds at most 1/16 of the blocks (27B gate|up: 64 of 2176): a drop well
               beyond that share of the work is what the partial wave costs
  row_waves    the one-row fp32-output GEMVs of 320 blocks (27B out = 5120: gdn_out / down without the tail, as
               bench/gemv.py times them) run 264 (2 an SM): a drop near 17.5 % means the work, near 33 % the SMs
               that held 3 blocks
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EDITS: dict[str, list[tuple[str, str]]] = {
    "no_tail": [(
        "  const unsigned int tk = ticket_acq_rel(counter);\n",
        "  return;  // probe no_tail\n  const unsigned int tk = ticket_acq_rel(counter);\n")],
    "half_fold": [(
        "        for (int e = 0; e < 4; ++e) __stcg(wc + (j * 4 + e) * 32, acc[j][e]);\n",
        "        for (int e = 0; e < 4; ++e)\n"
        "          if (cg_n > 4 || (cw & 1) == 0) __stcg(wc + (j * 4 + e) * 32, acc[j][e]);  // probe half_fold\n"), (
        "    for (int cw = 1; cw < MMA_WARPS; ++cw) {\n      const float* wc = ws",
        "    for (int cw = cg_n > 4 ? 1 : 2; cw < MMA_WARPS; cw += cg_n > 4 ? 1 : 2) {  // probe half_fold\n"
        "      const float* wc = ws")],
    "glu_waves": [(
        "  load(warp, v0, v1, sraw, fs);\n",
        "  if (EPI == MMA_Y_GLU && gridDim.x - gridDim.x / 528 * 528 <= gridDim.x / 16 &&\n"
        "      blockIdx.x >= gridDim.x / 528 * 528)\n"
        "    return;  // probe glu_waves\n"
        "  load(warp, v0, v1, sraw, fs);\n")],
    "row_waves": [(
        "  load(warp, v0, v1, sraw, fs);\n",
        "  if (EPI == MMA_Y_F32 && gridDim.x == 320 && blockIdx.x >= 264) return;  // probe row_waves\n"
        "  load(warp, v0, v1, sraw, fs);\n")],
    "x_coalesced": [(
        "const uint4 bv = has[j] ? __ldg(xb[j] + (size_t)q * (E / 2) + e)",
        "const uint4 bv = has[j] ? __ldg(xb[j] + (size_t)q * (E / 2) + e * 4 + c - c * (E / 8))")],
}


def apply(text: str, probes: list[str]) -> str:
    """``text`` (cuda/gemv.cu) with ``probes``' edits applied in order. Raises KeyError on an unknown probe,
    ValueError if an edit's anchor is not found exactly once (the source moved on)."""
    for name in probes:
        for old, new in EDITS[name]:
            if text.count(old) != 1:
                raise ValueError(f"probe {name}: anchor found {text.count(old)} times")
            text = text.replace(old, new)
    return text


def make(dest: Path, probes: list[str]) -> None:
    """Copy the tree to ``dest`` (which must not exist) with ``probes`` applied to its cuda/gemv.cu. The edits are
    checked (``apply``) before anything is copied."""
    text = apply((REPO / "cuda" / "gemv.cu").read_text(), probes)
    shutil.copytree(REPO / "cuda", dest / "cuda")
    shutil.copytree(REPO / "tandem", dest / "tandem", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copytree(REPO / "bench", dest / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    (dest / "tandem" / "assets").symlink_to(REPO / "tandem" / "assets")
    (dest / "cuda" / "gemv.cu").write_text(text)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    make(Path(sys.argv[1]), [p for p in sys.argv[2].split(",") if p])
    print(f"probe tree {sys.argv[1]}: {sys.argv[2]}")
