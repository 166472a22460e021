"""GPU greedy == CPU greedy with images on tests/test_vision.py's checkpoint: the tiny random Qwen3.5 VLM that
transformers writes (hf_reference.write_hf_vl_checkpoint with 32-dim GDN heads; float32 weights, so the GPU engine runs its fp32 Linears and
the fallback prefill with decode's arithmetic), through chat messages with image parts (one image; two images of
other shapes; an image in an earlier turn), the GPU tower encoding them. The CPU engine's tokens equal transformers'
(tests/test_vision.py), so this is also the GPU engine's parity with transformers. Checked: the same expanded ids,
the same greedy tokens over 24 tokens, the prompt's last logits within 1e-3 relative; the smallest top-1 margin of
the CPU's logits along the output is printed and recorded. Needs torch and transformers (to write the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

from hf_reference import write_hf_vl_checkpoint  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.multimodal import attach_images  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from test_vision import _conversations  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    path: Path = write_hf_vl_checkpoint(tmp_path_factory.mktemp("vl"), linear_head_dim=32)  # the CUDA GDN's least
    kw: dict[str, Any] = dict(kv_dtype="fp32", max_context=1024, cache="off")
    return Engine.from_pretrained(path, device="cuda", **kw), Engine.from_pretrained(path, device="cpu", **kw)


@pytest.mark.parametrize("case", ["one", "two", "earlier_turn"])
def test_gpu_greedy_equals_cpu_greedy_with_images(engines: tuple[Engine, Engine], case: str) -> None:
    gpu, cpu = engines
    messages, _ = _conversations()[case]
    ids, images = gpu.encode_prompt_images(messages)
    cpu_ids, _ = cpu.encode_prompt_images(messages)
    assert ids == cpu_ids
    want = cpu.complete(messages, GREEDY).token_ids
    got = gpu.complete(messages, GREEDY).token_ids
    cpu_model: Any = cpu.model
    state = cpu_model.new_state(len(ids) + len(want))
    attach_images(cpu_model, state, ids, images)
    logits = np.asarray(cpu_model.prefill(state, ids + want[:-1], all_logits=True))
    top = np.sort(logits[len(ids) - 1:], axis=1)[:, -2:]
    margin = float((top[:, 1] - top[:, 0]).min())
    gpu_model: Any = gpu.model
    dev_state = gpu_model.new_state(len(ids) + 1)
    attach_images(gpu_model, dev_state, ids, images)
    last = cp.asnumpy(gpu_model.prefill(dev_state, ids))
    rel = float(np.abs(last - logits[len(ids) - 1]).max() / np.abs(logits[len(ids) - 1]).max())
    print(f"\n[{case}] {len(images)} image(s), {len(ids)} prompt tokens: GPU == CPU greedy over 24 tokens, last prompt "
          f"row relative error {rel:.2e}, smallest top-1 margin {margin:.4g} logits")
    record(f"vision_parity[{case}]", margin=margin, last_row_rel=rel)
    assert got == want, f"GPU greedy differs from CPU greedy (smallest CPU margin {margin:.4g})"
    assert rel < 1e-3, f"the prompt's last logits differ: relative error {rel:.2e}"
