"""Command line: ``tandem generate``, ``serve``, ``calibrate``, ``quantize``, ``gate`` and ``--version``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any
from collections.abc import Sequence

import orjson

from tandem import __version__
from tandem.checkpoint import CheckpointError
from tandem.config import ConfigError
from tandem.engine import Engine
from tandem.images import ImageLimits
from tandem.sampling import SamplingParams


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers ({e})") from e


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _add_cache_args(parser: argparse.ArgumentParser, default: str) -> None:
    """The prefix cache's options (tandem/cache/): Engine.from_pretrained's cache, cache_gb, ... ."""
    parser.add_argument("--cache", default=default, choices=["on", "off"],
                        help=f"reuse cached prompt prefixes across requests (default {default})")
    parser.add_argument("--cache-gb", type=float, default=None,
                        help="resident cache budget in GB: device memory on a GPU (default 8), host memory on the "
                             "CPU (default 2)")
    parser.add_argument("--cache-host-gb", type=float, default=None,
                        help="pinned host memory for blocks spilled from the device (default 16; the CPU has none)")
    parser.add_argument("--cache-dir", default=None, help="disk tier folder, kept across runs (default: none)")
    parser.add_argument("--cache-disk-gb", type=float, default=20.0, help="disk tier size cap in GB (default 20)")
    parser.add_argument("--prefix-chunk", type=int, default=None,
                        help="snapshot grid in tokens, a multiple of 64 (default 1024 on a GPU, 256 on the CPU)")
    parser.add_argument("--kv-dtype", default=None, choices=["bf16", "fp32"],
                        help="KV cache storage (default bf16: half the bytes; the CPU and GPU store the same bits)")
    parser.add_argument("--vision", default="auto", choices=["auto", "on", "off"],
                        help="images in: auto loads the checkpoint's vision tower when the first image arrives, on "
                             "loads it at start (an error without one), off refuses images (default auto)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the model over N ranks (GPUs 0..N-1 with --device cuda, simulated ranks on the "
                             "CPU): the same tokens as one; the prefix cache runs over it, speculation by --spec "
                             "lookup or auto only (no MTP head)")


def cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.from_pretrained's cache keyword arguments (the prefix cache's, the KV cache's ``kv_dtype``, and
    ``tensor_parallel``) from parsed ``_add_cache_args`` options."""
    return {"cache": args.cache, "cache_gb": args.cache_gb, "cache_host_gb": args.cache_host_gb,
            "cache_dir": args.cache_dir, "cache_disk_gb": args.cache_disk_gb, "prefix_chunk": args.prefix_chunk,
            "kv_dtype": args.kv_dtype, "tensor_parallel": args.tensor_parallel, "vision": args.vision}


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` argument parser."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem inference engine for Qwen3.5 models.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto (default): the GPU when CuPy sees one, else the CPU")
    gen.add_argument("--max-context", type=int, default=None,
                     help="context length in tokens (prompt + output; on the GPU the KV cache is allocated for it)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_cache_args(gen, "off")  # one process, one request: the cache pays off with --cache-dir (then on)
    gen.add_argument("--spec", default="default", choices=["default", "off", "lookup", "mtp", "auto"],
                     help="speculative decoding: drafters (output is identical either way); default: prompt lookup on "
                          "the CPU, off on a GPU (where each was measured; docs/performance.md)")
    _add_calibrate_parser(sub)
    _add_quant_parsers(sub)
    _add_serve_parser(sub)
    return parser


def _add_calibrate_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``tandem calibrate`` (tandem/speculative/calibrate.py)."""
    cal = sub.add_parser("calibrate", help="measure verify ms per tree size (StairCut's price curve)")
    cal.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    cal.add_argument("--max-nodes", type=int, default=32)
    cal.add_argument("--repeats", type=int, default=5)
    cal.add_argument("--out", default=None, help="profile file (default profiles/<device>.json)")
    cal.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="measure on this device (auto: the GPU when CuPy sees one, else the CPU)")


def _add_serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``tandem serve`` (tandem/server)."""
    srv = sub.add_parser("serve", help="run the OpenAI- and Anthropic-compatible HTTP server",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    srv.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0 = any free port (the ready line shows it)")
    srv.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto (default): the GPU when CuPy sees one, else the CPU")
    srv.add_argument("--spec", default="default", choices=["default", "off", "lookup", "mtp", "auto"],
                     help="speculative decoding: drafters (output is identical either way); default: prompt lookup on "
                          "the CPU, off on a GPU (where each was measured; docs/performance.md)")
    srv.add_argument("--spec-max-running", type=int, default=1, metavar="N",
                     help="with several slots on a GPU, slots draft trees only while at most N requests run; past "
                          "it each round is a plain step (a pass holding trees costs host time a slot; output is the "
                          "same either way)")
    srv.add_argument("--parallel", "-np", type=int, default=4, metavar="N",
                     help="sequence slots: requests generated at once, each with its own state (KV rows and "
                          "recurrent state for the whole context); the others wait in the queue")
    srv.add_argument("--max-queue", type=int, default=8,
                     help="requests that may wait while every slot runs (then 503)")
    srv.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait (then 503)")
    srv.add_argument("--max-context", "--max-model-len", dest="max_context", type=int, default=None,
                     help="context length in tokens (prompt + output; on the GPU the KV cache is allocated for it)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: dir name)")
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body in MiB (then 413)")
    srv.add_argument("--allowed-hosts", default="", metavar="NAMES",
                     help="comma-separated Host names served besides the bound address and loopback ('*': any)")
    srv.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                     help="comma-separated web origins served, with CORS headers ('*': any; default none)")
    srv.add_argument("--header-timeout", type=float, default=30.0,
                     help="seconds to receive a request's headers, and to keep an idle connection")
    srv.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a body (then 408)")
    srv.add_argument("--drain-timeout", type=float, default=60.0,
                     help="after SIGTERM / SIGINT, seconds the open requests may take to finish; then (or at a "
                          "second signal) they end with an error event (exit status 0 drained, 3 cut, 4 second "
                          "signal)")
    _add_cache_args(srv, "on")
    _add_client_flags(srv)
    _add_image_flags(srv)


def _add_image_flags(srv: argparse.ArgumentParser) -> None:
    """``tandem serve`` flags for images in requests (tandem/images.py limits, tandem/image_fetch.py URLs)."""
    limits = ImageLimits()
    srv.add_argument("--allow-image-urls", action="store_true",
                     help="fetch http(s) image URLs that requests name (10 s, the image byte limit, 3 redirects); "
                          "the server then reaches any address a client names (docs/security.md); without it a "
                          "URL is a 400 and images come inline as base64")
    srv.add_argument("--max-images", type=int, default=limits.max_images, metavar="N",
                     help="images one request may hold (then 400)")
    srv.add_argument("--max-image-mb", type=float, default=limits.max_bytes / 2**20, metavar="MB",
                     help="bytes one encoded image may have, inline or fetched, in MiB (then 400; the request body "
                          "limit --max-body-mb bounds inline images too)")


def image_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.from_pretrained's image keyword arguments from parsed ``_add_image_flags`` options.
    Raises: ValueError (a limit below 1)."""
    if args.max_images < 1 or args.max_image_mb <= 0:
        raise ValueError("--max-images must be at least 1 and --max-image-mb above 0")
    limits = ImageLimits(max_images=args.max_images, max_bytes=int(args.max_image_mb * 2**20))
    return {"allow_image_urls": args.allow_image_urls, "image_limits": limits}


def _add_client_flags(srv: argparse.ArgumentParser) -> None:
    """``tandem serve`` flags for clients: key, field strictness, thinking, templates, logging."""
    srv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require a key on /v1 routes (Authorization: Bearer or x-api-key); repeat for several "
                          "tenants (key1, key2, ...); with neither this nor --api-key-file, $TANDEM_API_KEY, else "
                          "no key")
    srv.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="tenants' keys, one 'name:key' a line; each tenant has its own prefix-cache namespace "
                          "and its name in the request log (docs/security.md)")
    srv.add_argument("--metrics-auth", action="store_true", help="require a key on /metrics too")
    srv.add_argument("--strict-fields", action="store_true",
                     help="answer 400 to unknown request fields (default: ignore them with a warning)")
    srv.add_argument("--reasoning-budget", type=int, default=None,
                     help="thinking budget in tokens: after it the reasoning block is closed (requests' "
                          "thinking_token_budget / budget_tokens override it)")
    srv.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                     help='template variables for every request, e.g. \'{"enable_thinking": false}\'')
    srv.add_argument("--reasoning-format", choices=["separate", "content"], default="separate",
                     help="separate: reasoning_content / thinking blocks; content: keep <think>...</think> in the text")
    srv.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file to use")
    srv.add_argument("--max-stored-responses", type=int, default=256,
                     help="/v1/responses results kept in memory for previous_response_id and GET")
    srv.add_argument("--max-stored-responses-mb", type=float, default=64.0,
                     help="the most memory the stored /v1/responses results take together (MB)")
    srv.add_argument("--responses-events", choices=["openai", "open-responses"], default="openai",
                     help="the names of /v1/responses' reasoning events: openai (response.reasoning_text.delta, "
                          "what Codex and the openai SDK parse) or open-responses (response.reasoning.delta)")
    srv.add_argument("--seed", type=int, default=None,
                     help="the sampling seed of a request that names none (as llama-server's --seed), so a sampled "
                          "reply repeats across runs; default: a random seed per request")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="server log level (info: one line per request)")
    srv.add_argument("--log-prompts", action="store_true",
                     help="put the prompt text in the request log lines, and the prompt and reply in the ledger")
    srv.add_argument("--ledger", default="auto", metavar="PATH",
                     help="the usage ledger, a SQLite file of one row per request (GET /v1/usage); auto (default): "
                          "ledger.sqlite in --cache-dir, else in $XDG_STATE_HOME/tandem (~/.local/state/tandem); "
                          "off: none")
    srv.add_argument("--activity", default="on", choices=["on", "off"],
                     help="live activity (GET /v1/activity, its stream and the /dashboard page; default on)")


def ledger_path(value: str, cache_dir: str | None) -> str | None:
    """The ledger file ``--ledger`` names: None for "off"; for "auto" ledger.sqlite in the cache folder, else in
    $XDG_STATE_HOME/tandem (default ~/.local/state/tandem)."""
    if value == "off":
        return None
    if value != "auto":
        return value
    if cache_dir is not None:
        return os.path.join(cache_dir, "ledger.sqlite")
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "tandem", "ledger.sqlite")


def _json_object(text: str) -> dict[str, object]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_quant_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``tandem quantize`` and ``tandem gate`` (tandem/quant, tandem/gate.py)."""
    q = sub.add_parser("quantize", help="quantise a BF16/FP8 checkpoint to NVFP4 or FP8")
    q.add_argument("src", help="source checkpoint directory (BF16 or FP8)")
    q.add_argument("dst", help="destination directory")
    q.add_argument("--format", dest="fmt", required=True, choices=["nvfp4", "fp8"])
    q.add_argument("--targets", default="mlp,gdn,attn", help="comma-separated subset of mlp,gdn,attn")
    q.add_argument("--keep", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="fnmatch patterns of modules to leave as they are, e.g. '*.layers.0.*'")
    q.add_argument("--calib", help="calibration text file: clip search on its activations (else round to nearest)")
    q.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens used (default 4096)")
    q.add_argument("--head", choices=["keep", "fp8"], default="keep", help="lm_head: keep, or FP8 per-row scales")
    q.add_argument("--rtn", action="store_true", help="round to nearest even with --calib (for comparisons)")
    g = sub.add_parser("gate", help="quality gate: a quantised checkpoint against its base")
    g.add_argument("base", help="unquantised checkpoint directory")
    g.add_argument("candidate", help="quantised checkpoint directory")
    g.add_argument("--text", nargs="+", action="extend", default=[], metavar="FILE",
                   help="held-out text files (.json: a list of strings); default: the held-out prompts")
    g.add_argument("--profile", default=None, help="thresholds file (default profiles/gate.json)")
    g.add_argument("--max-tokens", type=int, default=2048, help="tokens per text (default 2048)")
    g.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per text (0: skip)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")


def generate(args: argparse.Namespace) -> int:
    """Run ``tandem generate``; returns the exit status."""
    t0 = time.perf_counter()
    options = cache_options(args)
    if args.cache_dir is not None:
        options["cache"] = "on"
    engine = Engine.from_pretrained(args.model, device=args.device, max_context=args.max_context,
                                    progress=sys.stderr.isatty(), spec=args.spec, **options)
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, stop=list(args.stop)).validate()
    prompt = args.prompt_ids if args.prompt_ids is not None else (
        [{"role": "user", "content": args.prompt}] if args.chat else args.prompt)
    if not args.json:
        for chunk in engine.generate(prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        _wait_writes(engine)
        return 0
    done = engine.complete(prompt, params)
    n = len(done.token_ids)
    print(orjson.dumps({
        "model": engine.name, "prompt_ids": done.prompt_ids, "output_ids": done.token_ids, "text": done.text,
        "finish_reason": done.finish_reason, "cached_tokens": engine.last_cached_tokens,
        "timing": {"load_s": load_s, "prefill_s": done.prefill_s, "decode_s": done.decode_s,
                   "decode_tokens_per_s": (n - 1) / done.decode_s if n > 1 and done.decode_s > 0 else None},
        "stats": {"spec": args.spec, **(done.stats.as_dict() if done.stats is not None else {})},
    }).decode())
    _wait_writes(engine)
    return 0


def _wait_writes(engine: Engine) -> None:
    """Wait for the disk tier's files of this invocation, so the next one (in this process too) finds them."""
    if engine.cache is not None:
        engine.cache.wait_writes()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tandem`` command. Bad input exits with status 2 and a one-line error."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "calibrate":
            from tandem.speculative.calibrate import run_calibrate

            return run_calibrate(args.model, args.max_nodes, args.repeats, args.out, args.device)
        if args.command == "serve":
            from tandem.server.options import ServerOptions
            from tandem.server.serve import serve
            from tandem.server.tenants import parse_keys

            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            server_log = logging.getLogger("tandem")
            server_log.addHandler(handler)
            server_log.setLevel(args.log_level.upper())
            options = ServerOptions(
                tenants=parse_keys(args.api_key or [], args.api_key_file, os.environ.get("TANDEM_API_KEY")),
                metrics_auth=args.metrics_auth, strict_fields=args.strict_fields,
                reasoning_budget=args.reasoning_budget, default_template_kwargs=args.default_chat_template_kwargs,
                reasoning_format=args.reasoning_format, log_prompts=args.log_prompts,
                activity=args.activity == "on", ledger=ledger_path(args.ledger, args.cache_dir),
                max_stored_responses=args.max_stored_responses,
                max_stored_response_bytes=int(args.max_stored_responses_mb * 1024 * 1024),
                responses_events=args.responses_events, seed=args.seed)
            return serve(args.model, host=args.host, port=args.port, device=args.device, spec=args.spec,
                         max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
                         max_context=args.max_context, served_name=args.served_model_name,
                         max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                         allowed_hosts=_names(args.allowed_hosts), allowed_origins=_names(args.allowed_origins),
                         header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, options=options,
                         chat_template=args.chat_template,
                         cache_options={**cache_options(args), **image_options(args), "parallel": args.parallel},
                         drain_timeout_s=args.drain_timeout, spec_max_running=args.spec_max_running)
        if args.command == "quantize":
            from tandem.quant.command import run_quantize

            return run_quantize(args.src, args.dst, args.fmt, [t for t in args.targets.split(",") if t], args.keep,
                                args.calib, args.calib_tokens, args.head == "fp8", args.rtn)
        if args.command == "gate":
            from tandem.gate import run_gate

            return run_gate(args.base, args.candidate, args.text, args.profile, args.max_tokens, args.gen_tokens,
                            args.json)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
