"""--finetune mode of tools/train_default_model.py: continue the shipped default model on code + synthetic chat.

Starts from the shipped weights (tandem/assets/default: model.language_model.* into transformers'
Qwen3_5ForCausalLM, mtp.* into the script's MTP head), keeps its tokenizer, and trains on a mix of rows: the
CPython code stream (loss on every token, as the base run) and packed synthetic chat conversations (tools/chat_data.py,
rendered with the shipped chat template as the engine renders prompts; loss on the final assistant turn only). Both
get the main and the MTP loss. Evaluates held-out code (bits/byte, MTP agreement) and held-out chat (greedy answers
that end with <|im_end|>, thinking closed, tool calls the engine's parser accepts with the right name and arguments)
and exports in the release layout.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat_data  # noqa: E402

PROBES = [  # the compliance suite's kinds of request, for the printed samples only (never trained on)
    ([{"role": "user", "content": "Say hello in exactly 3 words."}], None),
    ([{"role": "user", "content": "Count from 1 to 5."}], None),
    ([{"role": "system", "content": "You are a pirate. Always respond in pirate speak."},
      {"role": "user", "content": "Say hello."}], None),
    ([{"role": "user", "content": "My name is Alice."},
      {"role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
      {"role": "user", "content": "What is my name?"}], None),
    ([{"role": "user", "content": "Remember the code word: cobalt. Reply with OK."}, {"role": "assistant",
      "content": "OK."}, {"role": "user", "content": "What is the code word? Reply with only the code word."}], None),
    ([{"role": "user", "content": "This request only checks that the reply is well formed."}], None),
    ([{"role": "user", "content": "What's the weather like in San Francisco?"}],
     [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a location",
       "parameters": {"type": "object", "properties": {"location": {"type": "string", "description":
                      "The city and state, e.g. San Francisco, CA"}}, "required": ["location"]}}}]),
]


def load_shipped(base, a, src: Path, device):
    """(model, mtp, text_cfg, tokenizer) from a release-layout checkpoint written by the script's export."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tc = json.loads((src / "config.json").read_text())["text_config"]
    eot = tok.token_to_id("<|endoftext|>")
    for k, ak in [("vocab_size", "vocab"), ("hidden_size", "hidden"), ("intermediate_size", "intermediate"),
                  ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"), ("head_dim", "head_dim"),
                  ("num_key_value_heads", "kv_heads"), ("linear_num_key_heads", "lin_k_heads"),
                  ("linear_num_value_heads", "lin_v_heads"), ("linear_key_head_dim", "lin_head_dim"),
                  ("max_position_embeddings", "max_pos")]:
        setattr(a, ak, tc[k])
    a.rope_theta = tc["rope_parameters"]["rope_theta"]
    text_cfg = base.make_text_config(a, tc["vocab_size"], eot, eot, eot)
    text_cfg._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(text_cfg)
    mtp = base.MTP(text_cfg)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    main = {"model." + k[len("model.language_model."):]: v.float() for k, v in tensors.items()
            if k.startswith("model.language_model.")}
    main["lm_head.weight"] = main["model.embed_tokens.weight"]
    model.load_state_dict(main, strict=True)
    model.tie_weights()
    mtp.load_state_dict({k[len("mtp."):]: v.float() for k, v in tensors.items() if k.startswith("mtp.")}, strict=True)
    return model.to(device), mtp.to(device), text_cfg, tok


def pack_chat(pairs: list[tuple[list[int], list[int]]], start: int, length: int, eot: int):
    """One row of `length` tokens packed with conversations from pairs[start:], EOT-separated, and its loss mask
    (1 where the token is a target of the assistant turn). Returns (ids, mask, next start)."""
    ids, mask = [eot], [0]
    i = start
    while True:
        p, t = pairs[i % len(pairs)]
        if len(ids) + len(p) + len(t) + 1 > length and len(ids) > 1:
            break
        ids += p + t + [eot]
        mask += [0] * len(p) + [1] * len(t) + [0]
        i += 1
    pad = length - len(ids)
    ids, mask = (ids + [eot] * pad)[:length], (mask + [0] * pad)[:length]
    return np.array(ids, dtype=np.int64), np.array(mask, dtype=np.float32), i


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions with weight 1 ([B, T, V], [B, T], [B, T])."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def parse_call(text: str, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first call in generated text as the engine's tool parser reads it: {"name", "arguments"} or None."""
    from tandem.server.tool_parser import ToolCallParser

    parser = ToolCallParser(tools, "xml")
    for kind, value in parser.push(text) + parser.finish():
        if kind == "call":
            return {"name": value.name, "arguments": value.arguments}
    return None


def valid_args(args: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Required properties present, no unknown ones, JSON types as declared."""
    props = schema.get("properties") or {}
    if any(r not in args for r in schema.get("required") or []) or any(k not in props for k in args):
        return False
    check = {"string": lambda v: isinstance(v, str), "integer": lambda v: isinstance(v, int) and not isinstance(
        v, bool), "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
             "boolean": lambda v: isinstance(v, bool)}
    return all(check.get(props[k].get("type"), lambda v: True)(v) for k, v in args.items())


@torch.no_grad()
def _generate(model, ids: list[int], max_new: int, stop: int, device, **sampling: Any) -> list[int]:
    x = torch.tensor([ids], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=stop,
                         pad_token_id=stop, **sampling)
    return out[0, len(ids):].tolist()


def greedy(model, ids: list[int], max_new: int, stop: int, device) -> list[int]:
    return _generate(model, ids, max_new, stop, device, do_sample=False, top_k=None, top_p=None, temperature=None)


def sampled(model, ids: list[int], max_new: int, stop: int, device, seed: int) -> list[int]:
    """The shipped generation_config's sampling (temperature 0.6, top-p 0.95, top-k 20), as the server's default."""
    torch.manual_seed(seed)
    return _generate(model, ids, max_new, stop, device, do_sample=True, top_k=20, top_p=0.95, temperature=0.6)


def chat_eval(model, tok, template, seed: int, n: int, max_new: int, max_prompt: int, device,
              snippets: list[str] | None = None) -> dict[str, Any]:
    """Greedy answers to held-out synthetic conversations (another seed than training; ``snippets``: held-out
    prose), and whether a sampled answer (the served default) ends too."""
    model.eval()
    im_end = tok.token_to_id("<|im_end|>")
    synth = chat_data.ChatSynth(seed, snippets)
    c = {"n": 0, "ended": 0, "ended_sampled": 0, "think": 0, "think_closed": 0, "calls": 0, "call_ok": 0,
         "no_call_n": 0, "no_call_ok": 0, "exact": 0}
    shown = []
    while c["n"] < n:
        ex = synth.example()
        prompt, target = chat_data.render_example(template, ex)
        ids = tok.encode(prompt, add_special_tokens=False).ids
        if len(ids) > max_prompt:
            continue
        gen = greedy(model, ids, max_new, im_end, device)
        text = tok.decode(gen, skip_special_tokens=False)
        c["n"] += 1
        c["ended"] += im_end in gen
        c["ended_sampled"] += im_end in sampled(model, ids, max_new, im_end, device, seed + c["n"])
        if ex["thinking"]:
            c["think"] += 1
            c["think_closed"] += "</think>" in text
        answer = text.split("</think>")[-1].replace("<|im_end|>", "").strip()
        want = ex["messages"][-1]["content"]
        c["exact"] += bool(want) and answer == want
        if ex["tools"]:
            call = parse_call(text, ex["tools"])
            if ex["call"] is not None:
                c["calls"] += 1
                schema = next(t["function"]["parameters"] for t in ex["tools"]
                              if t["function"]["name"] == ex["call"]["name"])
                c["call_ok"] += call is not None and call["name"] == ex["call"]["name"] and \
                    valid_args(call["arguments"], schema) and call["arguments"] == ex["call"]["arguments"]
            else:
                c["no_call_n"] += 1
                c["no_call_ok"] += call is None
        if len(shown) < 6:
            shown.append((ex["kind"], prompt.split("<|im_start|>")[-2][-160:], text))
    model.train()
    r = {"n": c["n"], "ended": c["ended"] / c["n"], "ended_sampled": c["ended_sampled"] / c["n"],
         "think_closed": c["think_closed"] / max(1, c["think"]),
         "call_ok": c["call_ok"] / max(1, c["calls"]), "num_calls": c["calls"],
         "no_spurious_call": c["no_call_ok"] / max(1, c["no_call_n"]), "exact_answer": c["exact"] / c["n"]}
    return {**r, "samples": shown}


def probes(model, tok, template, max_new: int, device) -> list[str]:
    out = []
    model.eval()
    im_end = tok.token_to_id("<|im_end|>")
    for msgs, tools in PROBES:
        for thinking in (True, False):
            prompt = template.render(msgs, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
            gen = greedy(model, tok.encode(prompt, add_special_tokens=False).ids, max_new, im_end, device)
            text = tok.decode(gen, skip_special_tokens=False)
            call = parse_call(text, tools) if tools else None
            out.append(f"[{'think' if thinking else 'no-think'}] {msgs[-1]['content']!r} -> {text!r}"
                       + (f"  call={call}" if tools else ""))
    model.train()
    return out


def finetune_main(a, base) -> None:
    t_start = time.time()
    log = base.log
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    src_model = Path(a.finetune)
    model, mtp, text_cfg, tok = load_shipped(base, a, src_model, device)
    if a.tiny:
        a.ctx, a.batch = 128, 4
    V = tok.get_vocab_size()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    template_src = (src_model / "chat_template.jinja").read_text()
    template = chat_data.chat_environment_template(template_src)

    files = base.collect_files(base.source_root(a))
    if a.max_files:
        files = files[: a.max_files]
    train_f = [t for r, t in files if not base.is_heldout(r, a.heldout_percent)]
    held_f = [t for r, t in files if base.is_heldout(r, a.heldout_percent)]
    held_bytes = sum(len(t.encode()) for t in held_f)
    train_stream = base.encode_stream(tok, train_f, eot)
    held_stream = base.encode_stream(tok, held_f, eot)
    log(f"finetune from {src_model}: {len(train_f)} train / {len(held_f)} held-out files; train tokens "
        f"{len(train_stream)}, held-out {len(held_stream)}; loaded in {time.time() - t_start:.1f}s")

    T = a.ctx
    t0 = time.time()
    snip_rng = random.Random(a.seed + 5)
    synth = chat_data.ChatSynth(a.seed + 11, chat_data.snippets_from(train_f, snip_rng))
    held_snippets = chat_data.snippets_from(held_f, snip_rng, 400)
    exs = [synth.example() for _ in range(a.chat_pool)]
    pairs = [(p, t) for p, t in chat_data.encode_examples(tok, template, exs) if len(p) + len(t) + 2 <= T + 1]
    log(f"chat pool: {len(pairs)} of {len(exs)} conversations fit {T + 1} tokens; mean "
        f"{np.mean([len(p) + len(t) for p, t in pairs]):.0f} tokens, target mean "
        f"{np.mean([len(t) for _, t in pairs]):.1f}; built in {time.time() - t0:.1f}s")
    log("example:\n" + "".join(chat_data.render_example(template, exs[0])) + "\n---")
    vl = None
    if a.vision:
        import finetune_vision as fv

        vl, vcfg = fv.build_vl(model, text_cfg, tok, device)
        images, vconvs = fv.pool_for_training(tok, template, a, T, log)
        pad_id = tok.token_to_id("<|image_pad|>")
        n_vis_params = sum(p.numel() for p in vl.model.visual.parameters())
        log(f"vision tower: {n_vis_params:,} parameters, config {vcfg}")

    if a.eval_before:
        ev0 = base.evaluate(model, mtp, held_stream, T, 32 if device.type == "cuda" else 4, device,
                            torch.bfloat16 if device.type == "cuda" else torch.float32)
        log(f"before: held-out bits/byte {ev0['nll_nats'] / math.log(2) / held_bytes:.4f}; "
            f"MTP agreement {ev0['mtp_agree']:.4f}")

    params = list(model.parameters()) + list(mtp.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": a.wd},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if vl is not None:  # the new tower learns from scratch: a higher learning rate
        vparams = list(vl.model.visual.parameters())
        groups += [{"params": [p for p in vparams if p.ndim >= 2], "weight_decay": a.wd, "lr_scale": a.vision_lr_scale},
                   {"params": [p for p in vparams if p.ndim < 2], "weight_decay": 0.0, "lr_scale": a.vision_lr_scale}]
        params = params + vparams
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        prog = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    amp = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = np.random.Generator(np.random.PCG64(a.seed))
    n_chat = max(1, round(a.batch * a.chat_frac))
    n_vis = max(1, round(a.batch * a.vision_frac)) if vl is not None else 0
    n_text = a.batch - n_vis  # code + chat rows; image rows go through the VL model apart
    next_pair = next_conv = 0
    vis_loss = torch.zeros(())
    model.train()
    mtp.train()
    t_train = time.time()
    t20 = t_train
    step = 0
    while step < a.steps:
        starts = rng.integers(0, len(train_stream) - T - 1, size=n_text - n_chat)
        rows = [train_stream[s: s + T + 1].astype(np.int64) for s in starts]
        masks = [np.ones(T + 1, dtype=np.float32) for _ in starts]
        chat_rows = []
        for _ in range(n_chat):
            r, m, next_pair = pack_chat(pairs, next_pair, T + 1, eot)
            chat_rows.append((r, m))
        ids = torch.from_numpy(np.stack(rows + [r for r, _ in chat_rows])).to(device)
        w = torch.from_numpy(np.stack(masks + [m for _, m in chat_rows])).to(device)
        is_chat = torch.zeros(n_text, 1, device=device)
        is_chat[n_text - n_chat:] = 1.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step) * g.get("lr_scale", 1.0)
        with torch.autocast(device_type=device.type, dtype=amp, enabled=amp != torch.float32):
            logits, mlogits = base.forward_all(model, mtp, ids)
        w1, w2 = w[:, 1:], w[:, 2:]
        code_main = masked_ce(logits, ids[:, 1:], w1 * (1 - is_chat))
        chat_main = masked_ce(logits, ids[:, 1:], w1 * is_chat)
        code_mtp = masked_ce(mlogits, ids[:, 2:], w2 * (1 - is_chat))
        chat_mtp = masked_ce(mlogits, ids[:, 2:], w2 * is_chat)
        loss = code_main + a.chat_weight * chat_main + a.mtp_weight * (code_mtp + a.chat_weight * chat_mtp)
        if vl is not None:
            vids, vmask, vimgs, next_conv = fv.vision_batch(vconvs, images, next_conv, n_vis, T + 1, eot, device)
            with torch.autocast(device_type=device.type, dtype=amp, enabled=amp != torch.float32):
                vlogits = model.lm_head(fv.vl_hidden(vl, vids[:, :-1], vimgs, pad_id))
            vis_loss = masked_ce(vlogits, vids[:, 1:], vmask[:, 1:])
            loss = loss + a.vision_weight * vis_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if a.train_budget_s > 0 and step in (10, 30):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == 10:
                t20 = time.time()
            else:
                fit = int((a.train_budget_s - (time.time() - t_train)) / ((time.time() - t20) / 20)) + step + 1
                if fit < a.steps:
                    log(f"train budget {a.train_budget_s:.0f}s: steps {a.steps} -> {max(fit, a.warmup + 1)}")
                    a.steps = max(fit, a.warmup + 1)
        if step % 50 == 0 or step == a.steps - 1:
            log(f"step {step:4d} lr {lr_at(step):.2e} code {code_main.item():.4f} chat {chat_main.item():.4f} "
                f"image {vis_loss.item():.4f} mtp {code_mtp.item():.4f}/{chat_mtp.item():.4f} gnorm {gn.item():.2f} "
                f"tok/s {(step + 1) * a.batch * T / (time.time() - t_train):,.0f} elapsed {time.time() - t_train:.0f}s")
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    log(f"trained {a.steps} steps x {a.batch} x {T} tokens in {train_s:.1f}s")

    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    ev = base.evaluate(model, mtp, held_stream, T, 32 if device.type == "cuda" else 4, device, amp)
    bpb = ev["nll_nats"] / math.log(2) / held_bytes
    log(f"held-out code: bits/byte {bpb:.4f}; main top-1 {ev['main_acc']:.4f}; MTP agreement "
        f"{ev['mtp_agree']:.4f}; MTP vs truth {ev['mtp_acc']:.4f}  (README, shipped: 0.808 / 0.726)")
    with torch.autocast(device_type=device.type, dtype=amp, enabled=amp != torch.float32):
        cev = chat_eval(model, tok, template, a.seed + 999, a.chat_eval, a.chat_max_new, T * 3 // 4, device,
                        held_snippets)
        probe_lines = probes(model, tok, template, a.chat_max_new, device)
    log(f"held-out chat ({cev['n']} conversations, greedy, {a.chat_max_new} new tokens): ended with <|im_end|> "
        f"{cev['ended']:.3f} (sampled {cev['ended_sampled']:.3f}); thinking closed {cev['think_closed']:.3f}; tool "
        f"calls right name + valid, exact arguments {cev['call_ok']:.3f} of {cev['num_calls']}; no call when none "
        f"fits {cev['no_spurious_call']:.3f}; exact answer {cev['exact_answer']:.3f}")
    for kind, p, text in cev["samples"]:
        log(f"  [{kind}] ...{p!r} -> {text!r}")
    log("probes (the compliance suite's kinds of request):\n" + "\n".join(probe_lines))
    vev: dict[str, Any] = {}
    if vl is not None:
        with torch.autocast(device_type=device.type, dtype=amp, enabled=amp != torch.float32):
            vev = fv.vision_eval(vl, tok, template, a.seed + 777, a.vision_eval, a.vision_max_new, device)
        log(f"held-out images ({vev['n']}, greedy): names every colour {vev['colour']:.3f}; every shape "
            f"{vev['shape']:.3f}; both {vev['both']:.3f}; exact answer {vev['exact']:.3f}; ended with <|im_end|> "
            f"{vev['ended']:.3f}")
        for line in vev["samples"]:
            log("  [image] " + line)

    mdir = out / "model"
    info = base.export(model, mtp, text_cfg, tok, mdir, template_src, int(a.shard_mb * 1e6),
                       fv.export_vision(vl, vcfg) if vl is not None else None)
    if vl is not None:
        fv.write_preprocessor(mdir)
    shutil.copy(src_model / "heldout_prompts.json", mdir / "heldout_prompts.json")
    wall = time.time() - t_start
    log(f"exported {info['tensors']} tensors, {info['total_bytes']} bytes in {info['shards']} shards to {mdir}; "
        f"total wall time {wall:.1f}s")
    metrics = {"heldout_bpb": bpb, "main_top1": ev["main_acc"], "mtp_agree": ev["mtp_agree"],
               "mtp_top1_truth": ev["mtp_acc"], "chat": {k: v for k, v in cev.items() if k != "samples"},
               "probes": probe_lines, "steps": a.steps, "train_s": train_s, "wall_s": wall,
               "command": " ".join(sys.argv), "exported_bytes": info["total_bytes"],
               "vision": {k: v for k, v in vev.items() if k != "samples"}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
