"""Kernel inventory (CPU, runs in CI): every `cuda/<op>.cu` has its launcher `tandem/backend/cuda/<op>.py`, a
NumPy reference in it and a CUDA test `tests/test_cuda_<op>.py` (STYLE.md: four pieces sharing a stem), and the
launcher's KERNELS list names exactly the kernels the source defines. No GPU or CuPy needed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tandem.backend.cuda.loader import CUDA_DIR, kernel_names, kernel_source

REPO = Path(__file__).resolve().parents[1]
STEMS = sorted(p.stem for p in CUDA_DIR.glob("*.cu"))


def test_there_are_kernels() -> None:
    assert STEMS, f"no .cu sources under {CUDA_DIR}"


@pytest.mark.parametrize("stem", STEMS)
def test_kernel_has_launcher_reference_and_test(stem: str) -> None:
    launcher = REPO / "tandem" / "backend" / "cuda" / f"{stem}.py"
    assert launcher.is_file(), f"cuda/{stem}.cu has no launcher {launcher.relative_to(REPO)}"
    module = importlib.import_module(f"tandem.backend.cuda.{stem}")
    refs = [n for n in dir(module) if n.startswith("reference") and callable(getattr(module, n))]
    assert refs, f"tandem/backend/cuda/{stem}.py defines no NumPy reference (a function named reference*)"
    declared = tuple(getattr(module, "KERNELS", ()))
    assert sorted(declared) == sorted(kernel_names(stem)), \
        f"{stem}: launcher KERNELS {declared} != kernels in cuda/{stem}.cu {kernel_names(stem)}"
    test = REPO / "tests" / f"test_cuda_{stem}.py"
    assert test.is_file(), f"cuda/{stem}.cu has no test {test.relative_to(REPO)}"
    text = test.read_text()
    assert "pytest.mark.cuda" in text, f"{test.name} must mark its tests with pytest.mark.cuda"
    assert "reference" in text and "nan" in text.lower(), f"{test.name} must compare with the reference " \
        "on a NaN-poisoned output"


@pytest.mark.parametrize("stem", STEMS)
def test_kernel_source_is_loadable(stem: str) -> None:
    text = kernel_source(stem)
    assert text.startswith(f'#line 1 "cuda/{stem}.cu"'), "the loader must prepend the #line directive"
    local = [line for line in text.splitlines() if line.lstrip().startswith("#include \"")]
    assert not local, f"local headers must be inlined (they are part of the cache key): {local}"


# templates whose kernels are stamped out by a macro or that a kernel calls; each calls pdl_wait() itself
# (cuda/gemv.cu, cuda/attention_decode.cu, cuda/gdn_seq.cu)
PDL_TEMPLATES = ("gemv_bf16<", "gemv_fp8<", "gemv_nvfp4<", "gemv_mma<", "gemv_mma_wide<", "gemv_mma_staged<",
                 "gemv_mma_wg<", "attn_partial_impl<", "tree_partial_impl<", "gdn_decode_head<", "gdn_scan<", "gdn_seq_prep<")


@pytest.mark.parametrize("stem", STEMS)
def test_every_kernel_waits_for_its_predecessor(stem: str) -> None:
    """Launch plans replay every kernel with programmatic dependent launch (plan.py), so each kernel body must call
    pdl_wait() (PDL_ENTER) before it reads an earlier kernel's output: checked on the text of each kernel."""
    import re

    text = (CUDA_DIR / f"{stem}.cu").read_text()
    starts = [m.start() for m in re.finditer(r'extern\s+"C"\s+__global__', text)]
    for i, start in enumerate(starts):
        body = text[start:starts[i + 1] if i + 1 < len(starts) else len(text)]
        head = body.split("(", 1)[0]
        ok = "PDL_ENTER" in body or "pdl_wait()" in body or any(t in body for t in PDL_TEMPLATES)
        assert ok, f"cuda/{stem}.cu: kernel at {head!r} never calls pdl_wait() / PDL_ENTER"
    gemv = (CUDA_DIR / "gemv.cu").read_text()
    assert gemv.count("PDL_ENTER") + gemv.count("pdl_wait();") >= 2  # GEMV_PROLOGUE (v1) and gemv_mma (v2)


def test_launcher_constants_match_the_sources() -> None:
    """Constants a launcher and its kernels must agree on, read from both sides without CuPy: the residual + norm
    GEMV's slot offset in its counter buffer (gemv.RESNORM_SLOT0, cuda/gemv.cu), and the norm block size
    (rms_norm.THREADS, common.cuh NORM_THREADS) whose order the tile sums follow, which is also the GEMV block
    (gemv.THREADS): the residual + norm tail norms NORM_THREADS columns a GEMV block, and gemv.py counts its norming
    blocks by gemv.THREADS. And tree_partial's query-row arrays (TREE_QMAX, cuda/attention_tree.cu) hold the most
    query heads a KV head the launcher accepts (attention_tree.MAX_GROUP), its parent table the most nodes
    (attention_tree.MAX_NODES)."""
    import re

    from tandem.backend.cuda import gemv, rms_norm

    gemv_cu = (CUDA_DIR / "gemv.cu").read_text()
    common = (CUDA_DIR / "common.cuh").read_text()
    slot0 = re.search(r"#define RESNORM_SLOT0 (\d+)", gemv_cu)
    threads = re.search(r"#define NORM_THREADS (\d+)", common)
    assert slot0 is not None and int(slot0.group(1)) == gemv.RESNORM_SLOT0
    assert threads is not None and int(threads.group(1)) == rms_norm.THREADS == gemv.THREADS
    assert gemv.RESNORM_SLOT0 >= 2 and gemv.RESNORM_SLOTS * 16 >= 131072  # the 64-bit count (words 0-1) before the slots
    # tree_partial holds one node's G query rows in TREE_QMAX-row arrays; the launcher rejects G > MAX_GROUP
    from tandem.backend.cuda import attention_tree
    tree_cu = (CUDA_DIR / "attention_tree.cu").read_text()
    qmax = re.search(r"#define TREE_QMAX (\d+)", tree_cu)
    assert qmax is not None and int(qmax.group(1)) == attention_tree.MAX_GROUP
    nmax = re.search(r"#define TREE_MAX_NODES (\d+)", tree_cu)  # its shared copy of parent_ids
    assert nmax is not None and int(nmax.group(1)) == attention_tree.MAX_NODES


def _param_names(params: str) -> list[str]:
    """Parameter names of a C parameter list (the last identifier of each comma-separated item)."""
    import re

    return [re.findall(r"\w+", item)[-1] for item in params.replace("\\\n", " ").split(",")]


def test_relaunch_argument_indices_match_the_sources() -> None:
    """The prebuilt-argument launches (plan.Relaunch) set arguments by index: attention_decode.DecodeStep the
    partial kernel's num_rows and the combine's num_chunks, attention_tree.TreeStep the prep's pos0 and the
    partial's partials and start, CommitStep the start, embed.EmbedNormStep the id by value (1) and the device id's
    pointer (2). The indices match the kernels' parameter lists, read from the sources."""
    import re

    from tandem.backend.cuda import attention_decode

    text = (CUDA_DIR / "attention_decode.cu").read_text()
    macro = re.search(r"#define ATTN_PARTIAL_PARAMS(.*?)\n#define", text, re.S)
    assert macro is not None
    partial = _param_names(macro.group(1))
    assert partial.index("num_rows") == attention_decode.PARTIAL_NUM_ROWS
    combine = re.search(r"attn_combine\((.*?)\)\s*\{", text, re.S)
    assert combine is not None
    assert _param_names(combine.group(1)).index("num_chunks") == attention_decode.COMBINE_NUM_CHUNKS
    from tandem.backend.cuda import attention_tree

    assert partial.index("fused") == attention_decode.PARTIAL_FUSED
    tree_cu = (CUDA_DIR / "attention_tree.cu").read_text()
    tree_macro = re.search(r"#define TREE_PARTIAL_PARAMS\(KV\)(.*?)\ntemplate", tree_cu, re.S)
    assert tree_macro is not None
    lists = {"tree_partial": tree_macro.group(1)}
    for kernel_name, pattern in (("attn_prep_rows", r"attn_prep_rows_impl\((.*?)\)\s*\{"),
                                 ("attn_commit_rows", r"attn_commit_rows##SUF\((.*?)\)\s*\{"),
                                 ("prefill_partial", r"prefill_partial##SUF\((.*?)\)\s*\{")):
        found = re.search(pattern, tree_cu, re.S)
        assert found is not None, kernel_name
        lists[kernel_name] = found.group(1)
    for kernel_name, index in (("attn_prep_rows", {"pos0": attention_tree.PREP_POS0}),
                               ("tree_partial", {"part_acc": attention_tree.PARTIAL_PARTS,
                                                 "part_m": attention_tree.PARTIAL_PARTS + 1,
                                                 "part_l": attention_tree.PARTIAL_PARTS + 2,
                                                 "start": attention_tree.PARTIAL_START,
                                                 "chunk0": attention_tree.PARTIAL_CHUNK0}),
                               ("prefill_partial", {"part_acc": attention_tree.SHARED_PARTS,
                                                    "start": attention_tree.SHARED_START,
                                                    "tile_tokens": attention_tree.SHARED_TILE,
                                                    "chunks_per_split": attention_tree.SHARED_PER_SPLIT,
                                                    "num_chunks": attention_tree.SHARED_CHUNKS}),
                               ("attn_commit_rows", {"start": attention_tree.COMMIT_START})):
        names = _param_names(lists[kernel_name])
        assert all(names.index(name) == i for name, i in index.items()), (kernel_name, names)
    embed_cu = (CUDA_DIR / "embed.cu").read_text()
    one_norm = re.search(r"embed_bf16_one_norm\((.*?)\)\s*\{", embed_cu, re.S)
    assert one_norm is not None
    names = _param_names(one_norm.group(1))
    assert len(names) == 11 and names[1] == "token" and names[2] == "token_ptr", names
