"""The disk tier's signature: what must match for a cached state to be restored into this engine.

A SHA-256 over Tandem's state layout version, the backend ("cpu" / "cuda": their bits differ), the prefix chunk,
the state's buffer specs (names, kinds, shapes, dtypes: ``spec_signature``), on the CPU the BLAS that computes the
bits (NumPy's version, the BLAS library, its runtime configuration and core, the thread setting: a row's bits are
fixed only for one BLAS build and thread count), and the checkpoint: config.json and the
tokenizer files in full, and per ``*.safetensors`` file its size, its header (tensor names, dtypes, shapes, offsets)
and three 64 KiB samples of its bytes (start, middle, end). The samples make the hash cheap on a 50 GB checkpoint
while any re-export, re-quantisation or different tensor still changes it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

LAYOUT_VERSION = 2  # 2: KV views may be bfloat16 (their dtype is in the state signature)
SAMPLE_BYTES = 64 << 10
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def checkpoint_digest(root: Path) -> str:
    """SHA-256 of a checkpoint folder's identity (see the module docstring). Raises OSError on an unreadable file."""
    h = hashlib.sha256()
    for name in _FILES:
        p = root / name
        h.update(name.encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    for p in sorted(root.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}|{size};".encode())
        with open(p, "rb") as f:
            lead = f.read(8)
            h.update(lead)
            if len(lead) == 8:
                (n,) = struct.unpack("<Q", lead)
                h.update(f.read(min(n, 100 << 20)))
            for offset in (0, size // 2, max(0, size - SAMPLE_BYTES)):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def numerics_identity(backend: str) -> str:
    """What fixes the backend's bits besides the weights: for "cpu", NumPy's version and its BLAS (name, version,
    runtime configuration, thread settings, CPU count); "" for other backends (their kernels are Tandem's own)."""
    if backend != "cpu":
        return ""
    import numpy as np

    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]
        blas = deps.get("blas", {})
        blas_text = f"{blas.get('name')}|{blas.get('version')}|{blas.get('openblas configuration')}"
    except Exception:  # an older NumPy without mode="dicts": the version still separates builds
        blas_text = "unknown"
    threads = "|".join(os.environ.get(k, "") for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    return f"numpy {np.__version__}|{blas_text}|{threads}|cpus {os.cpu_count()}"


def cache_signature(checkpoint: str, backend: str, chunk: int, state_signature: str) -> str:
    """The signature written in and checked against every cache file (``numerics_identity`` of the backend in it)."""
    text = (f"tandem-cache|{LAYOUT_VERSION}|{backend}|{numerics_identity(backend)}|{chunk}|{state_signature}|"
            f"{checkpoint}")
    return hashlib.sha256(text.encode()).hexdigest()
