"""SASS census of CUDA kernels without the device: build a cuda/<stem>.cu the way the loader sends it to NVRTC
(includes inlined), compile it for sm_90a with the local nvcc, disassemble with cuobjdump, and count each kernel's
instructions by opcode and by pipe (ALU: LOP3 / SHF / IADD3 / PRMT ...; FMA: IMAD / FFMA / HMUL2 ...; MMA; memory),
for the whole kernel and for each loop (the span between a backward branch's target and the branch).

cuobjdump is not in this machine's CUDA; Triton's wheel carries one that reads sm_90a cubins:
  pip download triton --no-deps -d /tmp/tri && unzip -q /tmp/tri/triton-*.whl 'triton/backends/nvidia/bin/*' -d /tmp/tri
  CUOBJDUMP=/tmp/tri/triton/backends/nvidia/bin/cuobjdump python3 tools/sass_census.py gemv gemv_mma_nvfp4_n1_glu

python3 tools/sass_census.py STEM KERNEL [KERNEL ...] [--min-loop 40]
(bench/results/cuda_notes.md, session 16: the NVFP4 one-row GLU loop, 331 instructions for 128 weights a lane.)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tandem.backend.cuda import loader  # noqa: E402

PIPES = {
    "fma": ("IMAD", "FFMA", "FMUL", "FADD", "HMUL2", "HFMA2", "HADD2", "IMUL"),
    "alu": ("LOP3", "SHF", "IADD3", "ISETP", "PRMT", "SEL", "LEA", "FSEL", "IMNMX", "FSETP", "PLOP3", "SGXT", "BMSK",
            "VIADD", "MOV", "VIMNMX"),
    "f2fp": ("F2FP",),
    "mma": ("HMMA", "IMMA", "HGMMA"),
    "mem": ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDGSTS", "ATOMG", "RED", "LDC", "ULDC"),
}


def pipe(op: str) -> str:
    """The pipe class of a SASS opcode (its first dotted part), "other:<op>" when not listed."""
    base = op.split(".")[0]
    for name, ops in PIPES.items():
        if base in ops:
            return name
    return "other:" + base


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """{kernel: [(address, instruction text)]} from cuobjdump -sass output."""
    out: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur:
            out[cur].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(ins: str) -> str:
    """The opcode of an instruction, without its predicate."""
    return (ins.split(None, 1)[1] if ins.startswith("@") else ins).split()[0]


def census(body: list[str]) -> str:
    """One line of pipe counts and one of the most common opcodes."""
    ops = collections.Counter(opcode(t) for t in body)
    pipes = collections.Counter(pipe(opcode(t)) for t in body)
    return f"{len(body)} instructions; pipes {dict(pipes)}\n    {dict(ops.most_common(20))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stem")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--min-loop", type=int, default=40, help="loops shorter than this are not listed")
    args = ap.parse_args()
    nvcc = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / f"{args.stem}.cu", Path(tmp) / f"{args.stem}.cubin"
        src.write_text(loader.kernel_source(args.stem))
        subprocess.run([nvcc, "-arch=sm_90a", "-std=c++17", "-cubin", "-o", str(cubin), str(src)], check=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    fns = functions(sass)
    for name in args.kernels:
        ins = fns[name]
        print(f"== {name}: {census([t for _, t in ins])}")
        for addr, text in ins:
            m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
                if len(body) >= args.min_loop:
                    print(f"  loop {int(m.group(1), 16):x}-{addr:x}: {census(body)}")


if __name__ == "__main__":
    main()
