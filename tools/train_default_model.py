#!/usr/bin/env python3
"""Train Tandem's embedded default model: a small Qwen3.5-architecture LM on the CPython standard library.

torch, transformers and tokenizers are used here only (this is a tool, not part of the engine).
Runs on the device machine in one command; everything it produces goes under --out:

  tokenizer (byte-level BPE, trained on the train split), a Qwen3.5 text model (transformers'
  Qwen3_5ForCausalLM) trained jointly with an MTP head (spec/qwen3_5.md section 8), held-out
  evaluation (bits per byte vs a unigram baseline, MTP agreement), and an export in the layout of a
  real Qwen3.5 release (config.json with text_config, model.language_model.* / mtp.* tensors,
  sharded safetensors + index, tokenizer.json, tokenizer_config.json with the chat template,
  generation_config.json), plus heldout_prompts.json and a results file.

Deterministic given --seed (file split by a fixed hash, seeded sampling, seeded init).

Usage (device; the shipped model):
  PYTHONUNBUFFERED=1 python3 tools/train_default_model.py --out /tmp/r --steps 1900 --warmup 100 \
      --source-tar .srcdata/cpython-3.11.7-Lib.tar.gz
  (the tarball holds CPython 3.11.7's Lib/**/*.py; how it was made is in tandem/assets/default/README.md;
  without --source-tar the running interpreter's stdlib is used)
Usage (CPU smoke): python3 tools/train_default_model.py --out /tmp/dm --tiny --steps 20 --device cpu
Usage (chat fine-tune of the shipped model, tools/finetune_chat.py; device):
  PYTHONUNBUFFERED=1 python3 tools/train_default_model.py --finetune tandem/assets/default --out /tmp/ft \
      --source-tar .srcdata/cpython-3.11.7-Lib.tar.gz --steps 900 --warmup 30 --lr 5e-4 --min-lr-frac 0.1 \
      --train-budget-s 180 --eval-before
  CPU smoke: ... --finetune tandem/assets/default --out /tmp/ft --tiny --steps 3 --warmup 1 --max-files 40 \
      --chat-pool 200 --chat-eval 4 --chat-max-new 24 --device cpu
  --vision (with --finetune; tools/finetune_vision.py): adds a tiny vision tower trained on synthetic images; CPU
  smoke: add --vision --vision-images 40 --vision-pool 120 --vision-eval 4 --vision-max-new 16, then check the
  export with Tandem: PYTHONPATH=. python3 tools/check_vision_model.py /tmp/ft/model
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SPECIAL_TOKENS = [
    # (content, special) -- specials are never split by the BPE; "special" False mirrors Qwen's
    # tokenizer.json, where <think>/<tool_call>/... are added tokens that survive skip_special_tokens.
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Qwen3.5 pre-tokenizer split pattern (as in transformers' tokenization_qwen3_5.py).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MINIMAL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# data


def collect_files(root: Path) -> list[tuple[str, str]]:
    """All .py files under the stdlib, excluding site-packages, as (relative path, text); sorted."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or "__pycache__" in rel:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        if not text.strip():
            continue
        out.append((rel, text))
    return out


def is_heldout(rel: str, percent: int) -> bool:
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
    return h % 100 < percent


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import AddedToken

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(c, special=s, normalized=False) for c, s in SPECIAL_TOKENS])
    return tok


def encode_stream(tok, texts: list[str], eot: int) -> np.ndarray:
    """[EOT] doc0 [EOT] doc1 [EOT] ... as int32."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = [np.array([eot], dtype=np.int32)]
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.array([eot], dtype=np.int32))
    return np.concatenate(parts)


# ----------------------------------------------------------------------------------------------
# model


def make_text_config(a, vocab_size: int, bos: int, eos: int, pad: int):
    from transformers import Qwen3_5TextConfig

    L = a.layers
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
    rotary_dim = int(a.head_dim * 0.25)
    half = rotary_dim // 2
    # scale the release's [11, 11, 10] (sum 32) to sum to rotary_dim / 2
    s1 = round(half * 11 / 32)
    mrope = [s1, s1, half - 2 * s1]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=L,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        linear_num_key_heads=a.lin_k_heads,
        linear_num_value_heads=a.lin_v_heads,
        linear_key_head_dim=a.lin_head_dim,
        linear_value_head_dim=a.lin_head_dim,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        max_position_embeddings=a.max_pos,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": a.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        layer_types=layer_types,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


class MTP(nn.Module):
    """Qwen3.5 MTP head (spec section 8): norms, fc(concat[emb, hidden]), one full-attention layer, norm.

    Row t takes (token_{t+1}, h_t = target's post-final-norm hidden at t, position t) and predicts token_{t+2}.
    """

    def __init__(self, text_cfg):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        D = text_cfg.hidden_size
        cfg = copy.deepcopy(text_cfg)
        cfg.num_hidden_layers = 1
        cfg.layer_types = ["full_attention"]
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(D, eps=text_cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(D, eps=text_cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = Qwen3_5RMSNorm(D, eps=text_cfg.rms_norm_eps)
        std = text_cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, Qwen3_5RMSNorm):
                nn.init.zeros_(m.weight)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def forward_all(model, mtp, ids: torch.Tensor):
    """ids [B, T+1]. Returns main logits [B,T,V] for targets ids[:,1:], MTP logits [B,T-1,V] for ids[:,2:]."""
    x = ids[:, :-1]
    out = model.model(input_ids=x, use_cache=False)
    h = out.last_hidden_state  # post final norm
    logits = model.lm_head(h)
    T = x.shape[1]
    # MTP rows t = 0..T-2: (token x[t+1], h[t], position t) -> predicts ids[t+2]
    emb = model.model.embed_tokens(x[:, 1:])
    # text positions for the three mRoPE sections: [3, B, T-1]
    pos = torch.arange(T - 1, device=ids.device)[None, None].expand(3, x.shape[0], -1)
    pe = model.model.rotary_emb(emb, pos)
    mh = mtp(emb, h[:, :-1], pe)
    mlogits = model.lm_head(mh)
    return logits, mlogits


# ----------------------------------------------------------------------------------------------
# export


def export(model, mtp, text_cfg, tok, out: Path, chat_template: str, shard_bytes: int, vision=None) -> dict:
    """Write the release layout. ``vision``: (vision tower state dict, vision_config dict) of a trained tower
    (tools/finetune_vision.py), exported as model.visual.* in bf16; None: the text-only placeholder config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to model.language_model.embed_tokens.weight
        assert k.startswith("model."), k
        tensors["model.language_model." + k[len("model."):]] = v
    for k, v in mtp.state_dict().items():
        tensors["mtp." + k] = v
    if vision is not None:
        for k, v in vision[0].items():
            tensors["model.visual." + k] = v
    for k in list(tensors):
        v = tensors[k].detach().to("cpu")
        if k.endswith("linear_attn.A_log") or k.endswith("linear_attn.norm.weight"):
            v = v.to(torch.float32)
        else:
            v = v.to(torch.bfloat16)
        tensors[k] = v.contiguous()
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {}
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fn), metadata={"format": "pt"})
        for n in group:
            weight_map[n] = fn
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )

    tc = text_cfg.to_dict()
    vocab = tok.get_vocab()
    eot, im_end = vocab["<|endoftext|>"], vocab["<|im_end|>"]
    text_config = {
        "model_type": "qwen3_5_text",
        "vocab_size": tc["vocab_size"],
        "hidden_size": tc["hidden_size"],
        "intermediate_size": tc["intermediate_size"],
        "num_hidden_layers": tc["num_hidden_layers"],
        "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc["head_dim"],
        "linear_num_key_heads": tc["linear_num_key_heads"],
        "linear_num_value_heads": tc["linear_num_value_heads"],
        "linear_key_head_dim": tc["linear_key_head_dim"],
        "linear_value_head_dim": tc["linear_value_head_dim"],
        "linear_conv_kernel_dim": tc["linear_conv_kernel_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": tc["max_position_embeddings"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_parameters": dict(text_cfg.rope_parameters),
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "layer_types": list(tc["layer_types"]),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "output_gate_type": "swish",
        "tie_word_embeddings": True,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "initializer_range": tc["initializer_range"],
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "dtype": "bfloat16",
    }
    import transformers

    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        # without a trained tower: a minimal placeholder config, and the checkpoint carries no vision weights
        "vision_config": vision[1] if vision is not None else {
            "model_type": "qwen3_5_vision",
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": tc["hidden_size"],
            "num_position_embeddings": 64,
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
        },
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "tie_word_embeddings": True,
        "transformers_version": transformers.__version__,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {
        "bos_token_id": eot,
        "pad_token_id": eot,
        "eos_token_id": [im_end, eot],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "transformers_version": transformers.__version__,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(vocab[c]): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for c, s in SPECIAL_TOKENS
    }
    tcfg = {
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": tc["max_position_embeddings"],
        "split_special_tokens": False,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)
    return {"total_bytes": total, "shards": len(shards), "tensors": len(names)}


# ----------------------------------------------------------------------------------------------
# copy augmentation (--copy-prob): sequences that teach copying and one-change edits of text in context

_DEF_RE = None


def _def_re():
    import re

    global _DEF_RE
    if _DEF_RE is None:
        _DEF_RE = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)[ \t]*\(")
    return _DEF_RE


def extract_functions(text: str, min_chars: int, max_chars: int) -> list[str]:
    """Function blocks (def line + deeper-indented body, by indentation), cut to whole lines <= max_chars."""
    lines = text.splitlines(keepends=True)
    out = []
    rx = _def_re()
    for i, ln in enumerate(lines):
        m = rx.match(ln)
        if not m:
            continue
        ind = len(m.group(1).expandtabs())
        j = i + 1
        while j < len(lines):
            s = lines[j]
            if s.strip() and len(s) - len(s.lstrip()) <= ind and not s.lstrip().startswith((")", "]", "}")):
                break
            j += 1
        block = lines[i:j]
        while block and not block[-1].strip():
            block.pop()
        buf = ""
        for b in block:
            if len(buf) + len(b) > max_chars:
                break
            buf += b
        if len(buf) >= min_chars and buf.endswith("\n"):
            out.append(buf)
    return out


def extract_docstrings(text: str, min_chars: int, max_chars: int) -> list[str]:
    import re
    import textwrap

    out = []
    for m in re.finditer(r'"""(.*?)"""', text, flags=re.S):
        body = m.group(1)
        if "\\" in body or "{" in body:
            continue
        first, _, rest = body.partition("\n")
        body = (first.strip() + "\n" + textwrap.dedent(rest)).strip()
        letters = sum(c.isalpha() or c == " " for c in body)
        if min_chars <= len(body) <= max_chars and letters > 0.8 * len(body):
            out.append(body)
    return out


_KEYWORDS = None


def _reserved() -> set[str]:
    global _KEYWORDS
    if _KEYWORDS is None:
        import builtins
        import keyword

        _KEYWORDS = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
    return _KEYWORDS


class CopyAugmenter:
    """Deterministic builder of copy/edit units (text), from a list of source files.

    A unit is [optional "# Original:" line] A [separator comment] A', where A is a whole function (cut at
    max_chars), a line-aligned span or a docstring paragraph, and A' is A, or A with one change that the
    separator names: the function renamed, one identifier renamed consistently, or one string literal changed.
    """

    EXACT_FUNC = ["# An exact copy of the function above:", "# The same function again:", "# Again:",
                  "# The same code, repeated:", "# A copy of the function above:", "# Repeated:"]
    EXACT_SPAN = ["# Again:", "# The same code, repeated:", "# An exact copy of the code above:", "# Repeated:",
                  "# A copy of the lines above:"]
    PROSE = ["\n\nRepeated: ", "\n\nAgain: ", "\n\nThe same text again:\n", "\n\nRepeated:\n"]

    def __init__(self, texts: list[str], rng: np.random.Generator, min_chars: int = 110, max_chars: int = 700):
        import re

        self.rng = rng
        self.min_chars, self.max_chars = min_chars, max_chars
        self.texts = [t for t in texts if len(t) >= min_chars]
        self.funcs = [f for t in texts for f in extract_functions(t, min_chars, max_chars)]
        self.docs = [d for t in texts for d in extract_docstrings(t, min_chars, max_chars)]
        names = set()
        for t in texts:
            names.update(m.group(1) for m in re.finditer(r"def[ \t]+([A-Za-z_]\w*)", t))
        self.func_names = sorted(n for n in names if not n.startswith("__") and len(n) > 2)
        idents = set()
        for f in self.funcs[:: max(1, len(self.funcs) // 4000)]:
            idents.update(re.findall(r"\b([a-z_][a-z0-9_]{2,20})\b", f))
        self.idents = sorted(idents - _reserved())
        lits = set()
        for f in self.funcs:
            lits.update(m.group(2) for m in re.finditer(r"""(['"])([A-Za-z][^'"\\\n{}%]{2,40})\1""", f))
        self.literals = sorted(lits)
        self.words = sorted({w for s in self.literals for w in s.split() if w.isalpha() and len(w) > 2})
        if not (self.funcs and self.func_names and self.idents and self.literals and self.words):
            raise ValueError("copy augmentation: source too small")

    def _pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def _span(self) -> str:
        t = self._pick(self.texts)
        lines = t.splitlines(keepends=True)
        target = int(self.rng.integers(self.min_chars, self.max_chars + 1))
        for _ in range(8):
            s = int(self.rng.integers(len(lines)))
            buf = ""
            for ln in lines[s:]:
                if len(buf) + len(ln) > self.max_chars:
                    break
                buf += ln
                if len(buf) >= target:
                    break
            if len(buf) >= self.min_chars and buf.strip() and buf.endswith("\n"):
                return buf
        return self._pick(self.funcs)

    def _rename_func(self, a: str):
        import re

        m = _def_re().match(a)
        old = m.group(2)
        new = self._pick(self.func_names)
        if new == old or re.search(r"\b%s\b" % re.escape(new), a):
            return None
        # the definition and calls (name followed by "("), not the same word in prose
        return re.sub(r"(?<!\w)%s(?=\s*\()" % re.escape(old), new, a), f"# The same function, renamed to {new}:"

    def _rename_ident(self, a: str, is_func: bool):
        import collections
        import re

        toks = re.findall(r"(?<![.\w])([A-Za-z_]\w*)\b(?!\s*=\s*[^=])", a)
        counts = collections.Counter(t for t in toks if t not in _reserved() and not t.startswith("__"))
        cands = sorted(t for t, c in counts.items() if c >= 2)
        if not cands:
            return None
        old = self._pick(cands)
        new = self._pick(self.idents)
        if new == old or re.search(r"\b%s\b" % re.escape(new), a):
            return None
        b = re.sub(r"(?<![.\w])%s\b" % re.escape(old), new, a)
        what = "function" if is_func else "code"
        sep = self._pick([f"# The same {what}, with {old} renamed to {new}:",
                          f"# The same {what}, with the variable {old} renamed to {new}:"])
        return b, sep

    def _change_string(self, a: str, is_func: bool):
        import re

        ms = list(re.finditer(r"""(['"])([A-Za-z][^'"\\\n{}%]{2,40})\1""", a))
        if not ms:
            return None
        m = self._pick(ms)
        old = m.group(2)
        if self.rng.random() < 0.5:
            new = self._pick(self.literals)
        else:
            w = old.split(" ")
            w[int(self.rng.integers(len(w)))] = self._pick(self.words)
            new = " ".join(w)
        if new == old or "'" in new:
            return None
        q = m.group(1)
        b = a.replace(q + old + q, q + new + q)
        line = a[a.rfind("\n", 0, m.start()) + 1: m.start()]
        what = "function" if is_func else "code"
        if "raise" in line or "Error" in line:
            sep = f"# The same {what}, with the error message changed to '{new}':"
        else:
            sep = f"# The same {what}, with the string '{old}' changed to '{new}':"
        return b, sep

    def unit(self) -> str:
        import textwrap

        r = self.rng.random()
        if r < 0.1 and self.docs:
            a = self._pick(self.docs)
            return a + self._pick(self.PROSE) + a
        is_func = r < 0.75
        a = self._pick(self.funcs) if is_func else self._span()
        if is_func and a[0] in " \t" and self.rng.random() < 0.5:
            a = textwrap.dedent(a)
        e = self.rng.random()
        edit = None
        if e < 0.2 and is_func and _def_re().match(a):
            edit = self._rename_func(a)
        elif e < 0.3:
            edit = self._rename_ident(a, is_func)
        elif e < 0.4:
            edit = self._change_string(a, is_func)
        if edit is None:
            b, sep = a, self._pick(self.EXACT_FUNC if is_func else self.EXACT_SPAN)
        else:
            b, sep = edit
        head = "# Original:\n" if self.rng.random() < (0.5 if edit else 0.15) else ""
        join = "\n\n" if self.rng.random() < 0.6 else "\n"
        return head + a + join + sep + "\n" + b

    def units(self, n: int) -> list[str]:
        return [self.unit() for _ in range(n)]


def encode_units(tok, units: list[str], max_len: int) -> list[np.ndarray]:
    encs = tok.encode_batch(units, add_special_tokens=False)
    return [np.asarray(e.ids[:max_len], dtype=np.int32) for e in encs]


def copy_row(unit: np.ndarray, stream: np.ndarray, start: int, length: int, eot: int, at_start: bool,
             rng: np.random.Generator) -> np.ndarray:
    """A row of `length` tokens: the unit first, or between two pieces of the stream; EOT-separated."""
    u = unit[:length]
    rest = length - len(u)
    if rest < 3 or at_start:
        row = np.concatenate([u, [eot], stream[start: start + max(0, rest - 1)]])
    else:
        p = int(rng.integers(1, rest - 1))  # stream tokens before the unit; rest - p - 2 >= 0 after it
        row = np.concatenate([stream[start: start + p], [eot], u, [eot], stream[start + p: start + rest - 2]])
    return row[:length].astype(np.int32)


@torch.no_grad()
def copy_eval(model, mtp, tok, held_texts: list[str], seed: int, n: int, device, amp_dtype) -> dict:
    """Greedy top-1 on the second copy of held-out units (exact function copies / renames), and MTP agreement."""
    import re

    rng = np.random.Generator(np.random.PCG64(seed + 7))
    aug = CopyAugmenter(held_texts, rng)
    model.eval()
    mtp.eval()
    res = {}
    for kind in ("exact", "rename"):
        hit = tot = agree = nm = 0
        for _ in range(n):
            a = aug._pick(aug.funcs)
            a = a if a[0] not in " \t" else __import__("textwrap").dedent(a)
            if kind == "exact":
                sep, b = "# An exact copy of the function above:", a
            else:
                ed = aug._rename_func(a)
                if ed is None:
                    continue
                b, sep = ed
                if b.split("\n")[0] == a.split("\n")[0]:
                    continue
            prefix = ("# Original:\n" if kind == "rename" else "") + a + "\n\n" + sep + "\n" + b.split("\n")[0] + "\n"
            full = prefix + b[len(b.split("\n")[0]) + 1:]
            pi = tok.encode(prefix, add_special_tokens=False).ids
            fi = tok.encode(full, add_special_tokens=False).ids
            if fi[: len(pi)] != pi or len(fi) - len(pi) < 4:
                continue
            ids = torch.tensor([fi], dtype=torch.long, device=device)
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                logits, mlogits = forward_all(model, mtp, ids)
            g = logits.float().argmax(-1)[0]  # g[t] predicts fi[t+1]
            mg = mlogits.float().argmax(-1)[0]  # mg[t] predicts fi[t+2]
            k = len(pi) - 1  # first predicted copy token is fi[len(pi)] from position len(pi)-1
            tgt = ids[0, k + 1:]
            hit += (g[k:] == tgt).sum().item()
            tot += tgt.numel()
            agree += (mg[k:] == g[k + 1:]).sum().item()
            nm += mg[k:].numel()
        res[kind] = {"top1": hit / max(1, tot), "tokens": tot, "mtp_agree": agree / max(1, nm)}
    model.train()
    mtp.train()
    return res


# ----------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model, mtp, stream: np.ndarray, ctx: int, batch: int, device, amp_dtype):
    """Non-overlapping windows of ctx targets. Returns dict of sums."""
    model.eval()
    mtp.eval()
    n = (len(stream) - 1) // ctx
    rows = [stream[i * ctx: i * ctx + ctx + 1] for i in range(n)]
    rest = stream[n * ctx:]
    nll = 0.0
    ntok = 0
    agree = 0
    mtp_true = 0
    main_true = 0
    nm = 0
    groups = [rows[i: i + batch] for i in range(0, len(rows), batch)]
    if len(rest) >= 3:
        groups.append([rest])
    for g in groups:
        ids = torch.from_numpy(np.stack(g).astype(np.int64)).to(device)
        with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            logits, mlogits = forward_all(model, mtp, ids)
        logits = logits.float()
        mlogits = mlogits.float()
        tgt = ids[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum").item()
        ntok += tgt.numel()
        greedy = logits.argmax(-1)  # greedy[t] = model's choice for token t+1
        mg = mlogits.argmax(-1)  # mg[t] = MTP's guess for token t+2 (row t)
        # compare with the model's own greedy choice of token t+2 given true tokens up to t+1: greedy[t+1]
        agree += (mg == greedy[:, 1:]).sum().item()
        mtp_true += (mg == ids[:, 2:]).sum().item()
        main_true += (greedy == tgt).sum().item()
        nm += mg.numel()
    model.train()
    mtp.train()
    return {
        "nll_nats": nll,
        "tokens": ntok,
        "mtp_agree": agree / nm,
        "mtp_acc": mtp_true / nm,
        "main_acc": main_true / ntok,
    }


def unigram_bits(train: np.ndarray, held: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train[1:], minlength=vocab).astype(np.float64) + 1.0
    p = counts / counts.sum()
    return float(-np.log2(p[held[1:]]).sum())


def pick_prompts(held_texts: list[str], n: int, lo: int = 100, hi: int = 300) -> list[str]:
    """Deterministic prompts: from successive held-out files, whole lines from a third of the way in."""
    prompts = []
    for text in held_texts:
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = len(lines) // 3
        for s in range(start, len(lines)):
            buf = ""
            for ln in lines[s:]:
                if len(buf) + len(ln) > hi:
                    break
                buf += ln
                if len(buf) >= lo and buf.strip():
                    break
            if lo <= len(buf) <= hi and len(buf.strip()) >= lo * 0.8 and buf.isascii():
                prompts.append(buf)
                break
        if len(prompts) == n:
            break
    return prompts


# ----------------------------------------------------------------------------------------------


def source_root(a) -> Path:
    """The stdlib tree: --source-tar unpacked under /tmp, else --source, else this interpreter's."""
    import sysconfig

    if a.source_tar:
        import tarfile

        import tempfile

        dst = Path("/tmp/tandem_default_source")
        if not dst.exists():  # unpacked aside, then renamed: two runs started together never read a partial tree
            part = Path(tempfile.mkdtemp(prefix="tandem_default_source.", dir="/tmp"))
            with tarfile.open(a.source_tar) as tf:
                tf.extractall(part, filter="data")
            try:
                part.rename(dst)
            except OSError:  # another run renamed its copy first
                shutil.rmtree(part, ignore_errors=True)
        log(f"source tarball {a.source_tar} sha256 {hashlib.sha256(Path(a.source_tar).read_bytes()).hexdigest()}")
        return dst / a.source_tar_root
    return Path(a.source or sysconfig.get_paths()["stdlib"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", default=None, help="stdlib folder (default: this Python's)")
    ap.add_argument("--source-tar", default=None, help="tarball of a stdlib tree (carried to the device)")
    ap.add_argument("--source-tar-root", default="python3.11")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--heldout-percent", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=12288)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lin-k-heads", type=int, default=4)
    ap.add_argument("--lin-v-heads", type=int, default=8)
    ap.add_argument("--lin-head-dim", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=10000000.0)
    ap.add_argument("--max-pos", type=int, default=32768)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--shard-mb", type=float, default=15.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test")
    ap.add_argument("--max-files", type=int, default=0, help="limit source files (smoke tests)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--copy-prob", type=float, default=0.0,
                    help="probability that a training row holds a copy/edit unit (0: the shipped model's recipe)")
    ap.add_argument("--copy-pool", type=int, default=0,
                    help="distinct copy units to build (0: one per augmented row, steps x batch x copy-prob)")
    ap.add_argument("--copy-max-chars", type=int, default=700, help="longest copied text A (whole lines)")
    ap.add_argument("--copy-eval", type=int, default=64, help="held-out units per kind for the copy evaluation")
    ap.add_argument("--train-budget-s", type=float, default=0.0,
                    help="if > 0: after step 60, lower --steps so training ends within this many seconds "
                         "(the cosine schedule is set before it starts decaying)")
    ap.add_argument("--chat-template", default=str(Path(__file__).resolve().parent / "qwen3_5_chat_template.jinja"))
    ap.add_argument("--finetune", default=None, metavar="MODEL_DIR",
                    help="fine-tune this release-layout checkpoint (tandem/assets/default) on code + synthetic chat "
                         "(tools/finetune_chat.py) instead of training from scratch")
    ap.add_argument("--chat-frac", type=float, default=0.4, help="--finetune: fraction of rows packed with chat")
    ap.add_argument("--chat-weight", type=float, default=1.0, help="--finetune: weight of the chat loss")
    ap.add_argument("--chat-pool", type=int, default=12000, help="--finetune: synthetic conversations built")
    ap.add_argument("--chat-eval", type=int, default=64, help="--finetune: held-out conversations decoded")
    ap.add_argument("--chat-max-new", type=int, default=64, help="--finetune: greedy tokens per evaluated answer")
    ap.add_argument("--eval-before", action="store_true", help="--finetune: evaluate held-out code before training")
    ap.add_argument("--vision", action="store_true",
                    help="--finetune: add a tiny vision tower and train it on synthetic images (tools/finetune_vision.py)")
    ap.add_argument("--vision-frac", type=float, default=0.25, help="--vision: fraction of rows packed with images")
    ap.add_argument("--vision-weight", type=float, default=1.0, help="--vision: weight of the image-chat loss")
    ap.add_argument("--vision-lr-scale", type=float, default=4.0, help="--vision: the tower's lr / --lr")
    ap.add_argument("--vision-images", type=int, default=2000, help="--vision: synthetic training images drawn")
    ap.add_argument("--vision-pool", type=int, default=8000, help="--vision: image conversations built")
    ap.add_argument("--vision-eval", type=int, default=64, help="--vision: held-out images decoded")
    ap.add_argument("--vision-max-new", type=int, default=48, help="--vision: greedy tokens per evaluated answer")
    a = ap.parse_args()
    if a.finetune:
        from finetune_chat import finetune_main

        return finetune_main(a, sys.modules[__name__])
    if a.tiny:
        a.vocab, a.hidden, a.intermediate, a.heads, a.kv_heads, a.head_dim = 1024, 64, 128, 2, 1, 32
        a.lin_k_heads, a.lin_v_heads, a.lin_head_dim, a.ctx, a.batch = 2, 4, 16, 128, 4

    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:
        pass
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    src = source_root(a)
    files = collect_files(src)
    if a.max_files:
        files = files[: a.max_files]
    train_f = [(r, t) for r, t in files if not is_heldout(r, a.heldout_percent)]
    held_f = [(r, t) for r, t in files if is_heldout(r, a.heldout_percent)]
    train_bytes = sum(len(t.encode()) for _, t in train_f)
    held_bytes = sum(len(t.encode()) for _, t in held_f)
    log(f"source {src} (Python {sys.version.split()[0]}): {len(files)} files; "
        f"train {len(train_f)} files {train_bytes} bytes; held-out {len(held_f)} files {held_bytes} bytes")

    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_f], a.vocab)
    vocab = tok.get_vocab()
    V = tok.get_vocab_size()
    assert V == a.vocab, (V, a.vocab)
    eot = vocab["<|endoftext|>"]
    train_stream = encode_stream(tok, [t for _, t in train_f], eot)
    held_stream = encode_stream(tok, [t for _, t in held_f], eot)
    log(f"tokenizer: vocab {V}, trained in {time.time() - t0:.1f}s; train tokens {len(train_stream)}, "
        f"held-out tokens {len(held_stream)} ({held_bytes / len(held_stream):.2f} bytes/token)")
    # round-trip check
    for _, t in held_f[:20]:
        assert tok.decode(tok.encode(t, add_special_tokens=False).ids, skip_special_tokens=False) == \
            __import__("unicodedata").normalize("NFC", t)

    from transformers import Qwen3_5ForCausalLM

    text_cfg = make_text_config(a, V, eot, eot, eot)
    text_cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    model = Qwen3_5ForCausalLM(text_cfg).to(device)
    mtp = MTP(text_cfg).to(device)
    n_main = sum(p.numel() for n, p in model.named_parameters())  # tied head counted once
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"params: main {n_main} + mtp {n_mtp} = {n_main + n_mtp}  (bf16 ~{2 * (n_main + n_mtp) / 1e6:.1f} MB)")

    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        prog = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    amp = torch.bfloat16 if device.type == "cuda" else torch.float32
    step_fn = forward_all
    if a.compile:
        step_fn = torch.compile(forward_all)

    rng = np.random.Generator(np.random.PCG64(a.seed))
    T = a.ctx
    n_windows = len(train_stream) - T - 1
    units: list[np.ndarray] = []
    if a.copy_prob > 0:
        t0 = time.time()
        arng = np.random.Generator(np.random.PCG64(a.seed + 1))  # separate stream: rng above is untouched
        aug = CopyAugmenter([t for _, t in train_f], arng, max_chars=a.copy_max_chars)
        n_units = a.copy_pool or int(a.steps * a.batch * a.copy_prob * 1.05) + 16
        texts = aug.units(n_units)
        units = encode_units(tok, texts, T + 1)
        ulen = np.array([len(u) for u in units])
        log(f"copy augmentation: p {a.copy_prob}; {len(aug.funcs)} functions, {len(aug.docs)} docstrings; "
            f"{n_units} units, tokens mean {ulen.mean():.0f} / max {ulen.max()}; built in {time.time() - t0:.1f}s")
        log("example unit:\n" + texts[0] + "\n--- example unit:\n" + texts[1] + "\n---")
    next_unit = 0
    tokens_per_step = a.batch * T
    log(f"training: {a.steps} steps x {tokens_per_step} tokens = {a.steps * tokens_per_step} tokens "
        f"({a.steps * tokens_per_step / len(train_stream):.2f} epochs)")
    model.train()
    mtp.train()
    t_train = time.time()
    tt = t_train
    step = 0
    t20 = t_train
    while step < a.steps:
        starts = rng.integers(0, n_windows, size=a.batch)
        rows = [train_stream[s: s + T + 1] for s in starts]
        if units:
            for i in np.flatnonzero(arng.random(a.batch) < a.copy_prob):
                rows[i] = copy_row(units[next_unit % len(units)], train_stream, int(starts[i]), T + 1, eot,
                                   bool(arng.random() < 0.5), arng)
                next_unit += 1
        batch = np.stack(rows).astype(np.int64)
        ids = torch.from_numpy(batch).to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device_type=device.type, dtype=amp, enabled=amp != torch.float32):
            logits, mlogits = step_fn(model, mtp, ids)
        loss_main = F.cross_entropy(logits.float().reshape(-1, V), ids[:, 1:].reshape(-1))
        loss_mtp = F.cross_entropy(mlogits.float().reshape(-1, V), ids[:, 2:].reshape(-1))
        loss = loss_main + a.mtp_weight * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if a.train_budget_s > 0 and step in (20, 60):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == 20:
                t20 = time.time()
            else:
                per_step = (time.time() - t20) / 40
                fit = int((a.train_budget_s - (time.time() - t_train)) / per_step) + step + 1
                if fit < a.steps:
                    log(f"train budget {a.train_budget_s:.0f}s at {per_step * 1e3:.1f} ms/step: "
                        f"steps {a.steps} -> {max(fit, a.warmup + 1)}")
                    a.steps = max(fit, a.warmup + 1)
        if step % 100 == 0 or step == a.steps - 1:
            lm, lt = loss_main.item(), loss_mtp.item()
            now = time.time()
            done = step + 1
            log(f"step {step:5d} lr {lr_at(step):.2e} loss {lm:.4f} mtp {lt:.4f} gnorm {gn.item():.2f} "
                f"tok/s {done * tokens_per_step / (now - t_train):,.0f} elapsed {now - t_train:.0f}s")
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    tok_s = a.steps * tokens_per_step / train_s
    log(f"trained {a.steps * tokens_per_step} tokens in {train_s:.1f}s ({tok_s:,.0f} tok/s)")

    # ---- held-out evaluation (on the bf16-rounded weights, as shipped)
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    ev = evaluate(model, mtp, held_stream, T, 32 if device.type == "cuda" else 4, device, amp)
    bits = ev["nll_nats"] / math.log(2)
    bpb = bits / held_bytes
    uni_bpb = unigram_bits(train_stream, held_stream, V) / held_bytes
    log(f"held-out: loss {ev['nll_nats'] / ev['tokens']:.4f} nats/token over {ev['tokens']} tokens; "
        f"bits/byte {bpb:.4f} (unigram baseline {uni_bpb:.4f}); main top-1 {ev['main_acc']:.4f}; "
        f"MTP top-1 agreement with own greedy next-next {ev['mtp_agree']:.4f}; MTP top-1 vs truth {ev['mtp_acc']:.4f}")
    cev = {}
    if a.copy_eval > 0:
        try:
            cev = copy_eval(model, mtp, tok, [t for _, t in held_f], a.seed, a.copy_eval, device, amp)
        except ValueError as e:
            log(f"copy evaluation skipped: {e}")
        for k, v in cev.items():
            log(f"held-out copy ({k}): greedy top-1 on the copied tokens {v['top1']:.4f} over {v['tokens']} tokens; "
                f"MTP agreement {v['mtp_agree']:.4f}")

    # ---- export
    chat_template = MINIMAL_TEMPLATE
    template_src = "minimal ChatML (tools/qwen3_5_chat_template.jinja absent)"
    if a.chat_template and Path(a.chat_template).exists():
        chat_template = Path(a.chat_template).read_text()
        template_src = "tools/qwen3_5_chat_template.jinja"
    mdir = out / "model"
    info = export(model, mtp, text_cfg, tok, mdir, chat_template, int(a.shard_mb * 1e6))
    log(f"exported {info['tensors']} tensors, {info['total_bytes']} bytes in {info['shards']} shard(s) to {mdir}; "
        f"chat template: {template_src}")

    prompts = pick_prompts([t for _, t in held_f], 10)
    (mdir / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")

    # ---- reload the export with transformers and greedy-generate samples
    from transformers import AutoTokenizer

    del model
    rmodel = Qwen3_5ForCausalLM.from_pretrained(str(mdir), dtype=torch.bfloat16).to(device).eval()
    rtok = AutoTokenizer.from_pretrained(str(mdir))
    samples = []
    for pr in prompts[:5]:
        enc = rtok(pr, return_tensors="pt").to(device)
        with torch.no_grad():
            g = rmodel.generate(**enc, max_new_tokens=64, do_sample=False, top_k=None, top_p=None,
                                temperature=None)
        samples.append((pr, rtok.decode(g[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)))
    wall = time.time() - t_start

    lines = [
        "Tandem default model: training record (tools/train_default_model.py)",
        f"command: python3 tools/train_default_model.py {' '.join(sys.argv[1:])}",
        f"device: {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"transformers {__import__('transformers').__version__}; tokenizers {__import__('tokenizers').__version__}",
        f"source: CPython standard library .py files at {src} ({a.source_tar or 'this interpreter'}; site-packages "
        f"excluded), "
        f"PSF License Version 2",
        f"split by sha256(relative path) % 100 < {a.heldout_percent} -> held out: "
        f"train {len(train_f)} files / {train_bytes} bytes / {len(train_stream)} tokens; "
        f"held-out {len(held_f)} files / {held_bytes} bytes / {len(held_stream)} tokens",
        f"tokenizer: byte-level BPE, vocab {V} ({len(SPECIAL_TOKENS)} added tokens)",
        f"parameters: main {n_main} (tied embedding/head) + MTP {n_mtp} = {n_main + n_mtp}",
        f"exported bytes: {info['total_bytes']} ({info['shards']} shards)",
        f"seed {a.seed}; steps {a.steps}; batch {a.batch} x ctx {T}; tokens trained {a.steps * tokens_per_step} "
        f"({a.steps * tokens_per_step / len(train_stream):.2f} epochs); lr {a.lr} cosine, warmup {a.warmup}, "
        f"wd {a.wd}; MTP loss weight {a.mtp_weight}",
        f"copy augmentation: {'off' if a.copy_prob <= 0 else f'p {a.copy_prob} per row, {len(units)} units (A of 110-{a.copy_max_chars} chars: whole functions 65%, line spans 25%, docstrings 10%; ~40% edits: rename the function or one identifier, change a string), rows used {next_unit}'}",
        f"training time {train_s:.1f}s; {tok_s:,.0f} tokens/s; total wall time {wall:.1f}s",
        f"held-out loss: {ev['nll_nats'] / ev['tokens']:.4f} nats/token ({ev['tokens']} predicted tokens)",
        f"held-out bits per byte: {bpb:.4f}   (unigram baseline, add-one, same tokenizer and split: {uni_bpb:.4f})",
        f"main model top-1 accuracy on held-out: {ev['main_acc']:.4f}",
        f"MTP top-1 agreement with the model's own greedy next-next token: {ev['mtp_agree']:.4f}",
        f"MTP top-1 accuracy vs the true next-next token: {ev['mtp_acc']:.4f}",
        *[f"held-out copy ({k}, {a.copy_eval} functions): greedy top-1 on the copied tokens {v['top1']:.4f} "
          f"({v['tokens']} tokens); MTP agreement {v['mtp_agree']:.4f}" for k, v in cev.items()],
        f"chat template: {template_src}",
        "",
        "greedy samples (transformers Qwen3_5ForCausalLM.from_pretrained on the export, 64 new tokens):",
    ]
    for i, (pr, s) in enumerate(samples):
        lines += [f"--- sample {i + 1} prompt:", pr, f"--- sample {i + 1} completion:", s, ""]
    text = "\n".join(lines) + "\n"
    (out / "train_default_model.txt").write_text(text)
    metrics = {
        "params_main": n_main, "params_mtp": n_mtp, "tokens_trained": a.steps * tokens_per_step,
        "tokens_per_s": tok_s, "train_s": train_s, "wall_s": wall,
        "heldout_loss_nats": ev["nll_nats"] / ev["tokens"], "heldout_bpb": bpb, "unigram_bpb": uni_bpb,
        "main_top1": ev["main_acc"], "mtp_agree": ev["mtp_agree"], "mtp_top1_truth": ev["mtp_acc"],
        "heldout_bytes": held_bytes, "heldout_tokens": int(len(held_stream)), "train_tokens": int(len(train_stream)),
        "train_files": len(train_f), "heldout_files": len(held_f), "exported_bytes": info["total_bytes"],
        "seed": a.seed, "steps": a.steps, "samples": samples, "copy_prob": a.copy_prob, "copy_eval": cev,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(text)


if __name__ == "__main__":
    main()
