"""The `strata-jax` command: generate, inspect, serve, check, pull."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from strata_jax.core.errors import StrataError

log = logging.getLogger("strata_jax")


def _int_at_least(name, low):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {v}")
        return v

    return parse


def _positive_int(name):
    return _int_at_least(name, 1)


def _counts(text: str) -> tuple[int, ...]:
    """--promote-after: comma-separated integers >= 0."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers >= 0, e.g. 1,2,4")
    return out


def _fractions(text: str) -> list[float]:
    """--fractions: comma-separated shares of all experts, each in (0, 1]."""
    try:
        out = [float(f) for f in text.split(",")]
    except ValueError:
        out = []
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of shares in (0, 1], e.g. 0.125,0.25,0.5")
    return out


MODEL_HELP = ("GGUF file (a split set's first shard), or REPO[@REV]:FILE on a Hugging Face-compatible hub, pulled "
              "into the cache and verified on first use (default: the embedded Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")


def resolve_model(ref):
    """--model as a local path: a hub reference pulled (verified) into the cache first; run after the
    options are validated, so a bad flag never waits for a download."""
    from strata_jax.hub import resolve_model as resolve

    return resolve(ref)


def model_or_default(ref):
    """resolve_model(ref), or the embedded default model's path when no model is given (as generate and
    serve load it), fetched into the cache on first use."""
    if ref is not None:
        return resolve_model(ref)
    from strata_jax.dev.default_model import default_model_path

    return str(default_model_path())


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    # values stay text here: engine_config() validates them all (EngineConfig, errors naming the flag)
    from strata_jax.engine.config import DTYPES, EXPERT_FETCH, LAYER_SCAN, PLE_TABLES, POOLS, SPEC_DRAFTERS
    from strata_jax.model.config import ROPE_SCALINGS

    p.add_argument("--model", "-m", metavar="PATH|REPO:FILE", help=MODEL_HELP)
    p.add_argument("--ctx", default=None, help="context length in tokens (default: the model's trained length, or "
                                                "the largest that fits the VRAM budget beside the expert cache)")
    p.add_argument("--kv", default="f16", help="KV cache storage: f16 (the compute dtype), q8_0 or q4_0 (32-value "
                                               "blocks with a float16 scale), or K,V such as q8_0,q4_0 (default f16)")
    p.add_argument("--kv-resident", default=None, metavar="N",
                   help="keep N positions of each attention layer's KV cache on the device and stream the rest from "
                        "pinned host memory inside each step (long contexts that do not fit beside the experts; "
                        "default: the whole cache on the device)")
    p.add_argument("--devices", default=None, metavar="0,1",
                   help="the devices (JAX's indices) whose memory holds the expert cache: several split its slots, "
                        "each fetching its own misses, with the dense weights and KV cache on each (default: every GPU "
                        "where there are several, else the first device)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--prefill-chunk", default="auto",
                   help="prompt tokens per jitted prefill call at most, a power of two >= 16, or auto (default): the "
                        "longest up to 4096 whose activations take at most 1/8 of the device memory and cost no "
                        "context against 512 (512 on a CPU)")
    p.add_argument("--decode-chunk", default=None,
                   help="decode steps per jitted call, the loop over tokens on the device (default: 16 on a GPU, "
                        "where a step's launch costs as much as the step; 1 elsewhere; docs/benchmarks.md)")
    p.add_argument("--rope-scaling", default=None, choices=ROPE_SCALINGS,
                   help="RoPE scaling over the file's: yarn or linear (with --rope-scale) to run past the trained "
                        "context, none to turn the file's off")
    p.add_argument("--rope-scale", default=None, help="RoPE context scaling factor, e.g. 4 for 4x the original "
                                                      "context (the default context becomes that)")
    p.add_argument("--yarn-orig-ctx", default=None, help="YaRN: the model's original context (default: the file's)")
    def spec(value: str) -> str:
        if value in ("lookup", "mtp") or value.startswith("draft:") and len(value) > len("draft:"):
            return value
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(SPEC_DRAFTERS)})")

    p.add_argument("--spec", default=None, type=spec, metavar="{lookup,mtp,draft:PATH}",
                   help="speculative decoding (greedy and sampled, lossless): lookup drafts n-gram matches from the "
                        "prompt and output so far, mtp has the model's own MTP block draft (qwen3next, qwen35*, "
                        "glm4moe files that carry one), draft:PATH has a small GGUF model with the same vocabulary "
                        "draft greedily; the drafts are verified in one pass (one-row sessions: --parallel 1)")
    p.add_argument("--spec-max", default=4, help="drafted tokens per verify pass at most (default 4)")
    p.add_argument("--layer-scan", default="on", choices=LAYER_SCAN,
                   help="compile alike layers once, scanned over their stacked weights (default on); off unrolls "
                        "every layer: compile time then grows with the layer count")
    p.add_argument("--conversation-cache-mib", default=0,
                   help="host RAM (MiB) for conversations whose KV-cache rows were taken by others: a prompt that "
                        "continues one prefills only its new tokens (default 0: none)")
    p.add_argument("--conversation-cache-dir", default=None, metavar="DIR",
                   help="keep those conversations in DIR too, across restarts (checked against the model before "
                        "reuse; default none)")
    p.add_argument("--conversation-cache-disk-mib", default=8192,
                   help="disk cap of --conversation-cache-dir in MiB (default 8192)")
    c = p.add_argument_group("expert cache (MoE models)")
    c.add_argument("--expert-slots", default=None,
                   help="total expert slots on the device (default: as many as the VRAM budget holds)")
    c.add_argument("--vram-budget", default=None, help="device memory to use, e.g. 32GiB: sizes the context too "
                                                       "(default: free memory; none known on CPU)")
    c.add_argument("--vram-reserve", default=None, help="memory kept free for XLA workspace (default 1GiB)")
    c.add_argument("--policy", default="lru",
                   help="cache policy: lru, lfu, lrfu, lrfu(LAMBDA), or static:FILE.npy (a saved usage profile "
                        "[layers, experts] or routing trace [tokens, layers, k])")
    c.add_argument("--prefetch-depth", default=0,
                   help="prefetch: each MoE layer fetches the experts that the next N layers' routers predict "
                        "(default 0 = off: without copy/compute overlap it is slower, docs/benchmarks.md)")
    c.add_argument("--expert-pools", choices=POOLS, default="per-layer",
                   help="a slot pool per MoE layer (default) or one shared by layers of the same expert types")
    c.add_argument("--expert-fetch", default="auto", choices=EXPERT_FETCH,
                   help="how a step copies its cache misses from host RAM: kernel (one call per layer reading the "
                        "pinned store, no host sync), loop (one copy per miss) or auto (default: kernel on a GPU)")
    c.add_argument("--expert-cache-state", default=None, metavar="DIR",
                   help="keep the expert cache warm across restarts: its state is restored from DIR at load (when "
                        "saved for this model, slot plan and policy) and saved there at the end of generate or on "
                        "serve's clean shutdown (offloading only)")
    c.add_argument("--cold-experts", default=None, metavar="GGUF",
                   help="mixed precision: the same model at a lower-bit expert type (e.g. IQ2_XXS); a cache miss is "
                        "served from it (fewer bytes over PCIe) until the expert is used --promote-after times, then "
                        "fetched at the model's own type (offloading only)")
    c.add_argument("--promote-after", default=2,
                   help="low-bit uses of an expert before it is fetched into the cache at full type, free slots "
                        "aside (default 2; 0: always, i.e. no low-bit serving; -1: never)")
    c.add_argument("--no-prefetch", dest="prefetch_depth", action="store_const", const=0,
                   help="prefetch off (the default; same as --prefetch-depth 0)")
    p.add_argument("--ple-table", default="auto", choices=PLE_TABLES,
                   help="qwen4exp: where the PLE n-gram table lives: device, host (pinned host memory, rows "
                        "gathered there) or auto (default: host when experts are offloaded or it is over 1 GiB)")


def engine_config(args):
    """The EngineConfig of the shared engine flags (generate, serve), validated before anything loads."""
    from strata_jax.engine.config import EngineConfig

    return EngineConfig.create(flags=True, ctx=args.ctx, dtype=args.dtype, kv=args.kv, prefill_chunk=args.prefill_chunk,
                               kv_resident=args.kv_resident, devices=args.devices, decode_chunk=args.decode_chunk, expert_slots=args.expert_slots,
                               vram_budget=args.vram_budget, vram_reserve=args.vram_reserve, policy=args.policy,
                               prefetch=args.prefetch_depth, expert_pools=args.expert_pools,
                               expert_fetch=getattr(args, "expert_fetch", "auto"),
                               expert_cache_state=getattr(args, "expert_cache_state", None),
                               cold_experts=getattr(args, "cold_experts", None),
                               promote_after=getattr(args, "promote_after", 2),
                               parallel=getattr(args, "parallel", 1),
                               ple_table=getattr(args, "ple_table", "auto"), spec=getattr(args, "spec", None),
                               spec_max=getattr(args, "spec_max", 4), rope_scaling=args.rope_scaling,
                               rope_scale=args.rope_scale, yarn_orig_ctx=args.yarn_orig_ctx,
                               layer_scan=getattr(args, "layer_scan", "on"),
                               conversation_cache_mib=getattr(args, "conversation_cache_mib", 0),
                               conversation_cache_dir=getattr(args, "conversation_cache_dir", None),
                               conversation_cache_disk_mib=getattr(args, "conversation_cache_disk_mib", 8192))


# generate's sampling flags, by the name validate_sampling knows them by
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}


def check_generate_flags(args) -> None:
    """generate's sampling and length flags, checked before the model loads."""
    from strata_jax.core.errors import ConfigError
    from strata_jax.engine.sampling import validate_sampling

    validate_sampling(names=SAMPLING_FLAGS, **{k: getattr(args, k) for k in SAMPLING_FLAGS})
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} is invalid: it must be an integer >= 1.")
    if any(not s for s in args.stop or []):
        raise ConfigError("--stop '' is invalid: each stop string must be non-empty.")


def length_reason(model, max_tokens: int | None, final) -> str:
    """For a generation cut off (finish "length"): which limit cut it and the flag that raises it."""
    if final.finish_reason != "length":
        return ""
    used = len(final.prompt_token_ids or []) + final.timings["predicted_n"]
    if max_tokens is not None and used < model.ctx:
        return f" (stopped at --max-tokens {max_tokens}; raise it with --max-tokens N)"
    trained = model.config.context_length
    more = (f"raise it with --ctx N, up to the model's {trained:,}" if model.ctx < trained else
            "the model's trained context; --rope-scaling yarn --rope-scale F runs past it")
    return f" (stopped at the context limit --ctx {model.ctx}; {more})"


def _cmd_generate(args) -> int:
    import strata_jax

    if args.prompt is None and args.chat is None:
        raise StrataError("give --prompt TEXT (raw completion) or --chat TEXT (one user turn through the chat template)")
    config = engine_config(args)
    check_generate_flags(args)
    model = strata_jax.load(resolve_model(args.model), config)
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        prompt = messages
    else:
        prompt = args.prompt
    from strata_jax.engine import compiling

    final, t_first = None, None
    compiled_before, t_start = compiling.compile_seconds(), time.perf_counter()
    # no --max-tokens: until the model stops, bounded by the context (the session caps it to what is left)
    max_tokens = args.max_tokens if args.max_tokens is not None else model.ctx
    for chunk in model.generate_stream(prompt, max_tokens=max_tokens, temperature=args.temperature,
                                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                       stop=args.stop or None):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        final = chunk
        if t_first is None:
            t_first, compiled_first = time.perf_counter(), compiling.compile_seconds() - compiled_before
    sys.stdout.write("\n")
    t = final.timings
    # tok/s leave out compilation; the time to the first token shows what a cold start costs
    compiled = compiling.compile_seconds() - compiled_before
    print(f"first token after {t_first - t_start:.2f} s"
          + (f" ({compiled_first:.1f} s of it compiling)" if compiled_first else "") + "; "
          f"prefill: {t['prompt_n']} tokens in {t['prompt_ms']:.0f} ms ({t['prompt_per_second']:.1f} tok/s); "
          f"decode: {t['predicted_n']} tokens, {t['decode_per_second']:.1f} tok/s; "
          + (f"drafts: {t['draft_n_accepted']}/{t['draft_n']} accepted in {t['draft_passes']} passes; "
             if "draft_n" in t else "")
          + (f"compiling: {compiled:.1f} s in all (first run only: {compiling.cache_where()}); " if compiled else "")
          + f"finish: {final.finish_reason}{length_reason(model, args.max_tokens, final)}", file=sys.stderr)
    if config.expert_cache_state is not None:
        model.save_expert_cache()
    if model.config.is_moe:
        st = model.stats()
        print(f"experts: {st['lookups']} lookups, hit rate {st['hit_rate']:.1%}, {st['bytes_h2d'] / 1e6:.1f} MB "
              f"host->device, {st['expert_slots']} slots of {st['total_experts']}"
              + "".join(f"; {c['device']}: {c['slots']} slots, {c['misses']} misses" for c in st.get("cards") or ()),
              file=sys.stderr)
    return 0


def _cmd_inspect(args) -> int:
    from strata_jax.engine.inspect import format_report, report
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model.kvquant import check_kv
    from strata_jax.core.units import parse_size

    budget = parse_size(args.vram_budget, "--vram-budget") if args.vram_budget else None
    reserve = parse_size(args.vram_reserve, "--vram-reserve") if args.vram_reserve else None
    if args.path is not None and args.model is not None:
        raise StrataError("give the model once: `strata-jax inspect PATH` or `--model PATH|REPO:FILE`")
    print(format_report(report(GGUFFile(model_or_default(args.path or args.model)), vram_budget=budget, ctx=args.ctx,
                               kv=check_kv(args.kv, "--kv"), dtype=args.dtype, vram_reserve=reserve,
                               parallel=args.parallel, kv_resident=args.kv_resident, cards=args.cards)))
    return 0


def _cmd_serve(args) -> int:
    from strata_jax.serving.server import serve

    config = engine_config(args)
    args.model = resolve_model(args.model)
    return serve(args, config)


def _cmd_check(args) -> int:
    import json

    from strata_jax.check import check, format_check
    from strata_jax.core.units import parse_size

    if args.model_pos is not None and args.model is not None:
        raise StrataError("give the model once: `strata-jax check MODEL` or `--model MODEL`")
    if args.vram_budget is not None:
        parse_size(args.vram_budget, "--vram-budget")
    model = model_or_default(args.model_pos or args.model)
    if args.cold_experts is not None and not Path(args.cold_experts).expanduser().is_file():
        raise StrataError(f"--cold-experts {args.cold_experts}: not a file; give the low-bit GGUF of the same model")
    c = check(model, ctx=args.ctx, parallel=args.parallel, vram_budget=args.vram_budget,
              probe_pinned=args.pinned_probe, cold_experts=args.cold_experts, kv_resident=args.kv_resident,
              devices=args.devices)
    if args.json:  # the text output carries them itself
        for w in c["warnings"]:
            log.warning("%s", w)
    print(json.dumps(c, indent=2, default=str) if args.json else format_check(c))
    return 0


def _cmd_pull(args) -> int:
    from strata_jax.core.units import fmt_bytes
    from strata_jax.hub import pull

    got = pull(args.repo, args.files, revision=args.revision, dest_dir=args.dir, retries=args.retries,
               progress=not args.quiet)
    for f in got:
        state = "verified  " if f.verified else "UNVERIFIED"  # the hub publishes no sha256 for it
        print(f"{state} {f.path}  {fmt_bytes(f.size)}  sha256 {f.sha256}")
    return 0


def _cmd_trace_record(args) -> int:
    import strata_jax
    from strata_jax.offload.traces import save_trace

    path = Path(args.prompts)
    if not path.is_file():
        raise StrataError(f"no prompts file at {path}: give a text file with one prompt per line.")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise StrataError(f"{path} has no prompts: write one per line.")
    config = engine_config(args).replace(record_routing=True)
    model = strata_jax.load(resolve_model(args.model), config)
    if not model.config.is_moe:
        raise StrataError(f"{model.config.arch} is a dense model: it routes no experts, there is nothing to trace.")
    rows = []
    for i, text in enumerate(prompts):
        start = len(model.routing_trace())
        prompt = text if args.raw else [{"role": "user", "content": text}]
        out = model.generate(prompt, max_tokens=args.max_tokens, temperature=0, cache_prompt=False)
        n = len(model.routing_trace()) - start
        rows.append({"name": f"prompt{i}", "text": text, "start": start, "prefill": n - len(out.token_ids) + 1,
                     "decode": len(out.token_ids) - 1})
    trace = model.routing_trace()
    save_trace(args.out, trace, model=Path(model.gguf.shard_paths[0]).name, fingerprint=model.gguf.fingerprint(),
               experts=model.config.n_experts, prompts=rows)
    print(f"{args.out}: {trace.shape[0]} tokens x {trace.shape[1]} MoE layers x top-{trace.shape[2]}, "
          f"{len(rows)} prompts")
    return 0


def _cmd_trace_report(args) -> int:
    import json

    from strata_jax.offload import analysis
    from strata_jax.offload.traces import read_trace

    trace, meta = read_trace(args.trace, args.prompt)
    r = analysis.report(trace, args.fractions, per_layer=args.per_layer, n_experts=meta.get("experts"),
                        promote_after=args.promote_after, cold_ratio=args.cold_ratio)
    if args.json:
        print(json.dumps(r))
    else:
        print(analysis.format_report(r))
    if args.plots:
        try:
            files = analysis.plot_report(trace, r, args.plots)
        except ImportError:
            raise StrataError("plots need matplotlib: pip install 'strata-jax[research]'") from None
        print("plots: " + ", ".join(files), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata-jax", description="MoE inference beyond GPU memory, from GGUF, in JAX.")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    _add_engine_options(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="raw prompt, completed as is")
    src.add_argument("--chat", "-c", help="a user message, rendered with the model's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="stop after N generated tokens (default: when the model stops, or at the context's end)")
    g.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=40, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--seed", "-s", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func=_cmd_generate)

    from strata_jax.engine.config import DTYPES

    i = sub.add_parser("inspect", help="describe a GGUF file and what fits in a VRAM budget")
    i.add_argument("path", nargs="?", help="GGUF file (a split set's first shard) or REPO[@REV]:FILE (default: the "
                                           "embedded default model, as generate loads it)")
    i.add_argument("--model", "-m", metavar="PATH|REPO:FILE", help="the same as PATH")
    i.add_argument("--vram-budget", help="e.g. 32GiB: how many expert slots would fit")
    i.add_argument("--ctx", type=_positive_int("--ctx"), default=None,
                   help="context to reserve KV cache for (default: the trained length, cut to fit --vram-budget)")
    i.add_argument("--kv", default="f16", help="KV cache storage, as load's --kv: f16, q8_0, q4_0 or K,V")
    i.add_argument("--kv-resident", type=_positive_int("--kv-resident"), default=None, metavar="N",
                   help="KV streaming, as load's: N positions of each layer's cache on the device, the rest in host "
                        "memory")
    i.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype, as load's (auto: bfloat16 on GPU; float32 on CPU, dense weights dequantized)")
    i.add_argument("--vram-reserve", default=None, help="memory kept free for XLA workspace, as load (default 1GiB)")
    i.add_argument("--parallel", type=_positive_int("--parallel"), default=1,
                   help="KV-cache rows to reserve, as serve --parallel (default 1)")
    i.add_argument("--cards", type=_positive_int("--cards"), default=1,
                   help="plan the expert cache split over this many cards of --vram-budget each, as --devices "
                        "would (each card keeps the dense weights and KV cache beside its share)")
    i.set_defaults(func=_cmd_inspect)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, streaming, metrics)")
    _add_engine_options(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs an API key)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$STRATA_JAX_API_KEY)")
    s.add_argument("--alias", default=None, help="model id reported by /v1/models (default: the file's stem)")
    s.add_argument("--parallel", type=_positive_int("--parallel"), default=1,
                   help="requests decoded at once in one batch (default 1); each holds a KV-cache row of --ctx "
                        "tokens that also keeps its conversation's prefix for the next turn")
    s.add_argument("--queue-size", type=_positive_int("--queue-size"), default=64,
                   help="requests that may wait for the engine; more get 429 (default 64)")
    s.add_argument("--shutdown-grace", "--shutdown-timeout", dest="shutdown_timeout", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGTERM/SIGINT, while new ones get 503 with "
                        "Retry-After; then each stream ends with an error event; a second signal ends them at once "
                        "(default 10)")
    s.add_argument("--max-body", default="4MiB",
                   help="largest request body, e.g. 4MiB or 1000000 bytes; larger ones get 413 (default 4MiB)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip compiling the decode step before reporting ready")
    s.set_defaults(func=_cmd_serve)
    k = sub.add_parser("check", help="is this machine fit (GPU, PCIe link, bandwidth, RAM, pinned memory, disk), "
                                     "and does MODEL fit it")
    k.add_argument("model_pos", nargs="?", metavar="MODEL", help="GGUF file, a split set's first shard, or "
                                                                 "REPO[@REV]:FILE (default: the embedded default model)")
    k.add_argument("--model", "-m", metavar="PATH|REPO:FILE", help="the same as MODEL")
    k.add_argument("--json", action="store_true", help="machine-readable output")
    k.add_argument("--ctx", type=_positive_int("--ctx"), default=None,
                   help="context to reserve KV cache for (default: the trained length, cut to fit the budget)")
    k.add_argument("--parallel", type=_positive_int("--parallel"), default=1, help="KV-cache rows, as serve --parallel")
    k.add_argument("--vram-budget", default=None, help="size the verdict for this much device memory (default: free)")
    k.add_argument("--cold-experts", default=None, metavar="GGUF",
                   help="the low-bit copy serve would get (--cold-experts): its experts count in the RAM verdict")
    k.add_argument("--kv-resident", type=_positive_int("--kv-resident"), default=None, metavar="N",
                   help="KV streaming, as serve's: N positions a layer on the device, the rest counted in host RAM")
    k.add_argument("--devices", default=None, metavar="0,1",
                   help="the devices serve would split the expert cache over (--devices): each card's memory, and the "
                        "plan with --vram-budget per card (default: every GPU where there are several)")
    k.add_argument("--no-pinned-probe", dest="pinned_probe", action="store_false",
                   help="skip the largest-pinned-allocation probe (it briefly pins up to the model's expert bytes)")
    k.set_defaults(func=_cmd_check)
    pl = sub.add_parser("pull", help="download GGUF files (split sets whole) from a Hugging Face-compatible hub "
                                     "($HF_ENDPOINT, $HF_TOKEN), resumable, verified by size and sha256")
    pl.add_argument("repo", help="OWNER/NAME")
    pl.add_argument("files", nargs="*", metavar="FILE",
                    help="files or globs in the repo (a shard brings its whole split set); default: the repo's one model")
    pl.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    pl.add_argument("--dir", default=None, help="where to put the files (default: the cache, "
                                                 "~/.cache/strata-jax/hub/OWNER--NAME/REVISION)")
    pl.add_argument("--retries", type=_int_at_least("--retries", 0), default=5,
                    help="new requests after a dropped or short transfer, per file (default 5)")
    pl.set_defaults(func=_cmd_pull)
    sub.add_parser("bench", help="offload benchmark on a synthetic MoE (strata-jax bench --help)", add_help=False)
    tr = sub.add_parser("trace", help="record a model's expert routing, or report what a trace says about caching")
    trs = tr.add_subparsers(dest="trace_command", required=True)
    rec = trs.add_parser("record", help="generate greedily from each prompt of a file and save the routed experts "
                                        "of every token (strata_jax/offload/traces.py)")
    _add_engine_options(rec)
    rec.add_argument("--prompts", required=True, help="a text file, one prompt per line (a user turn through the "
                                                      "chat template, or raw with --raw)")
    rec.add_argument("--raw", action="store_true", help="complete each line as is, without the chat template")
    rec.add_argument("--max-tokens", "-n", type=_positive_int("--max-tokens"), default=64,
                     help="tokens generated per prompt (default 64)")
    rec.add_argument("--out", required=True, help="the trace file to write (.npz)")
    rec.set_defaults(func=_cmd_trace_record)
    rep = trs.add_parser("report", help="per-layer popularity, reuse distance, next-token overlap, and every cache "
                                        "policy's hit rate against Belady's optimum")
    rep.add_argument("trace", help="a trace from `trace record` (.npz) or a shared JSON trace")
    rep.add_argument("--prompt", default=None, help="only this prompt of the trace")
    rep.add_argument("--fractions", type=_fractions, default="0.125,0.25,0.5",
                     help="cache sizes as shares of all experts (default 0.125,0.25,0.5)")
    rep.add_argument("--per-layer", action="store_true", help="a cache per layer instead of one shared cache")
    rep.add_argument("--promote-after", type=_counts, default=(), metavar="N,N,...",
                     help="also replay mixed-precision experts (--cold-experts) promoting after these low-bit uses")
    rep.add_argument("--cold-ratio", type=float, default=0.6,
                     help="with --promote-after: a low-bit expert's bytes over a high-bit one's (default 0.6, about "
                          "IQ2_XXS against IQ3_S)")
    rep.add_argument("--plots", default=None, metavar="DIR", help="also write PNG plots there (needs matplotlib)")
    rep.add_argument("--json", action="store_true", help="print the report as JSON")
    rep.set_defaults(func=_cmd_trace_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own parser
        from strata_jax.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="strata-jax: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)  # not its backend-probing chatter
    logging.getLogger("absl").setLevel(logging.WARNING)  # nor orbax's dozens of lines per save (--expert-cache-state)
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstrata-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
