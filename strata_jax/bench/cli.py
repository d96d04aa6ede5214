"""`strata-jax bench`: the arguments and the order of one run (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata_jax.bench import machine
from strata_jax.bench.peer import PEER_PLACEMENTS
from strata_jax.bench.shapes import SHAPES, synthetic_model_path

log = logging.getLogger("strata_jax")


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _fraction(s: str) -> float:
    v = float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"a cache fraction lies in (0, 1], got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata-jax bench", description=sys.modules["strata_jax.bench"].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="synthetic model shape (default small)")
    p.add_argument("--model", help="benchmark this GGUF instead of a synthetic one")
    p.add_argument("--label", help="the shape name the rows carry (default: --shape, or the --model file's stem)")
    p.add_argument("--tokens", type=_positive, default=128, help="decoded tokens, timed after a warm-up (default 128)")
    p.add_argument("--prompt-len", type=_positive, default=32, help="prompt before the timed decode (default 32)")
    p.add_argument("--prefill-len", type=_positive, action="append", default=None,
                   help="also time a warm prefill of a prompt this long (repeatable; issue 5: 512 and 4096)")
    p.add_argument("--ctx", type=_positive, default=1024,
                   help="context length (raised to cover the prompts and the decoded tokens)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv", default="f16", help="KV cache storage in every configuration: f16, q8_0, q4_0 or K,V "
                                               "(load's --kv; default f16)")
    p.add_argument("--kv-resident", default=None, type=int, metavar="N",
                   help="KV streaming in every configuration: N positions of each attention layer's cache on the "
                        "device, the rest in pinned host memory (load's --kv-resident); rows carry kv_vram_hit")
    p.add_argument("--devices", default=None, metavar="0,1",
                   help="the devices every configuration splits its expert cache over (load's --devices; "
                        "--vram-budget is per card); rows carry `devices` and per-card misses")
    p.add_argument("--routing", choices=["model", "realistic"], action="append", default=None,
                   help="model: the random routers; realistic: every configuration replays the same "
                        "realistic_trace(QWEN3_30B_A3B, seed 0) at this shape. Repeat for both (default model)")
    p.add_argument("--vram-budget", help="emulate a card of this size, e.g. 32GiB: JAX's allocations are capped at "
                                         "it and a configuration sized by it is added")
    p.add_argument("--cache-fraction", type=_fraction, action="append", default=None,
                   help="a configuration with this share of all experts as slots (repeatable; default 0.5 "
                        "without --vram-budget)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--prefetch-depth", type=int, action="append", default=None,
                   help="prefetch depth; repeat to compare several (0 = off, the default)")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--decode-chunk", type=_positive, default=None,
                   help="decode steps per jitted call in every configuration (default: the engine's, load's "
                        "decode_chunk)")
    p.add_argument("--prefill-chunk", default=None,
                   help="prompt tokens per prefill call in every configuration: a number or auto (default: the "
                        "engine's, 512)")
    p.add_argument("--layer-scan", choices=["on", "off"], default="on",
                   help="alike layers compiled once as a scan (default on) or every layer unrolled")
    p.add_argument("--expert-fetch", choices=["auto", "kernel", "loop"], default="auto",
                   help="how offloaded configurations copy their misses: kernel, loop or auto (the engine's "
                        "default: kernel on a GPU)")
    p.add_argument("--no-resident", dest="resident", action="store_false", help="no all-resident reference run")
    p.add_argument("--resident-process", choices=["auto", "same", "child"], default="auto",
                   help="where the resident reference runs: auto = a child process without the VRAM cap when "
                        "every expert does not fit the budget, else this process")
    p.add_argument("--resident-only", action="store_true",
                   help="only the all-resident configuration: no cache, no llama.cpp, no VRAM cap (what the "
                        "uncapped child runs; also a quick A/B of XLA_FLAGS)")
    p.add_argument("--probe-mib", type=_positive, default=None,
                   help="size of the bandwidth probes (default 1024 on a GPU, 64 on CPU)")
    p.add_argument("--peer-llama-bench", metavar="PATH",
                   help="llama-bench binary: also run llama.cpp's placements (all-gpu, cpu-experts, budget at "
                        "--vram-budget) on the same GGUF and merge its rows")
    p.add_argument("--peer-when", choices=["auto", "before", "after"], default="auto",
                   help="run llama.cpp before JAX starts or after our rows; auto: after, if it fits in the "
                        "device memory JAX keeps free (strata_jax/bench/peer.py)")
    p.add_argument("--peer-wait", type=float, default=0, metavar="SECONDS",
                   help="wait this long for the llama-bench binary to appear (built in the background)")
    p.add_argument("--peer-placement", action="append", choices=list(PEER_PLACEMENTS), default=None,
                   help="llama.cpp placements to run (repeatable; default all three, budget only with "
                        "--vram-budget)")
    p.add_argument("--peer-depth", action="store_true",
                   help="llama-bench decodes (and prefills) after --prompt-len tokens already in its KV cache (-d), "
                        "as these rows decode after the prompt, with --kv's type (-ctk/-ctv): long-context rows")
    p.add_argument("--peer-reps", type=_positive, default=3)
    p.add_argument("--peer-threads", type=_positive, default=None)
    p.add_argument("--spec", default=None, metavar="{lookup,mtp,draft:PATH}",
                   help="decode with this drafter (speculative decoding, as generate's --spec): the rows carry "
                        "draft_n, draft_n_accepted and draft_passes; random weights accept little")
    p.add_argument("--spec-max", type=_positive, default=4, help="with --spec: drafted tokens per pass at most")
    p.add_argument("--spec-pass", type=_positive, action="append", default=None, metavar="K",
                   help="after each decode, decode again speculatively with verify passes of K tokens (the last "
                        "token and K - 1 drafts from an oracle that knows the greedy output; repeatable): the cost "
                        "of a verify pass on random weights (bench/spec.py)")
    p.add_argument("--spec-accept", type=_fraction, action="append", default=None, metavar="A",
                   help="the oracle's forced acceptance per drafted token for --spec-pass (repeatable; default 1)")
    p.add_argument("--cold-experts", default=None, metavar="GGUF",
                   help="mixed precision in the offloaded rows: misses served from this lower-bit copy of the model")
    p.add_argument("--cold-qtype", default=None, metavar="TYPE",
                   help="with --shape: the shape written again with its routed experts in TYPE (e.g. IQ2_XXS) as "
                        "the --cold-experts copy")
    p.add_argument("--promote-after", type=int, default=2,
                   help="with --cold-experts/--cold-qtype: low-bit uses before an expert is cached, free slots aside "
                        "(default 2; -1: never)")
    p.add_argument("--out", help="write every row and the machine's description here (JSON), after each row")
    return p


def needed_ctx(args) -> int:
    return max(args.ctx, args.prompt_len + args.tokens + 1, *(n + 1 for n in args.prefill_len))


class Results:
    """The JSON document, rewritten after every row so that a run cut short keeps what it measured."""

    def __init__(self, out: str | None, doc: dict):
        self.out, self.doc = out, doc

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            r.setdefault("shape", self.doc["shape"])
            shown = {k: v for k, v in r.items() if k not in ("token_ids", "budget_plan", "command", "build")}
            print(json.dumps(shown), flush=True)
        self.doc["rows"].extend(rows)
        self.save()

    def save(self) -> None:
        if self.out:
            tmp = Path(self.out).with_suffix(".partial")
            tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
            tmp.replace(self.out)


def _child_resident(args, path: str, shape: str, ctx: int) -> list[dict]:
    """The resident reference in a child process that sees the whole card (it does not fit the budget).
    It runs after our capped rows, the ones the targets need, while this process still holds its capped
    pool: so the child allocates on demand (no preallocation) beside it. It measures decode only: it is
    there for token equality, and prefill would cost compilations (its token buckets, per routing mode)
    that a GPU sitting of 30 minutes cannot spare."""
    fd, out = tempfile.mkstemp(prefix="bench-resident-", suffix=".json")
    os.close(fd)
    argv = [sys.executable, "-m", "strata_jax.bench", "--resident-only", "--model", path, "--label", shape,
            "--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len), "--ctx", str(ctx),
            "--dtype", args.dtype, "--kv", args.kv, "--out", out]
    for r in args.routing:
        argv += ["--routing", r]
    if args.probe_mib:
        argv += ["--probe-mib", str(args.probe_mib)]
    if args.decode_chunk:
        argv += ["--decode-chunk", str(args.decode_chunk)]
    if args.prefill_chunk:
        argv += ["--prefill-chunk", str(args.prefill_chunk)]
    argv += ["--layer-scan", args.layer_scan]
    if args.devices:
        argv += ["--devices", args.devices]
    if args.spec:
        argv += ["--spec", args.spec, "--spec-max", str(args.spec_max)]
    log.info("resident reference in a child process without the VRAM cap: %s", shlex.join(argv))
    proc = subprocess.run(argv, env=dict(machine.uncapped_env(), XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    try:
        rows = json.loads(Path(out).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        rows = [{"engine": "strata-jax", "config": "resident", "config_kind": "resident", "routing": r,
                 "error": f"child process exited {proc.returncode} with no rows"} for r in args.routing]
    finally:
        Path(out).unlink(missing_ok=True)
    for r in rows:
        r["process"] = "child, uncapped (every expert does not fit the budget)"
    return rows


def run(args, argv: list[str]) -> dict:
    from strata_jax.core.units import parse_size

    t_start = time.perf_counter()
    path = str(args.model or synthetic_model_path(args.shape))
    if args.cold_qtype is not None:
        args.cold_experts = str(synthetic_model_path(args.shape, args.cold_qtype))
    shape = args.label or (Path(path).stem if args.model else args.shape)
    budget = parse_size(args.vram_budget, "--vram-budget") if args.vram_budget else None
    smi = machine.nvidia_smi()
    doc = {"format": 1, "shape": shape, "model": path,
           "model_file_bytes": os.path.getsize(path), "command": shlex.join(["strata-jax", "bench", *argv]),
           "machine": machine.machine_info(smi), "args": dict(vars(args)), "rows": []}
    res = Results(args.out, doc)
    # --- before JAX's backend starts: the cap, and llama.cpp if it does not fit beside us (peer.py) -----
    cap = machine.apply_vram_cap(budget, smi) if budget is not None and not args.resident_only else None
    doc["vram"] = cap
    from strata_jax.bench.limits import ModelBytes, measure_bandwidths, resident_estimate
    from strata_jax.model.config import ModelConfig
    from strata_jax.gguf.reader import GGUFFile

    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gguf)
    mb = ModelBytes.of(gguf, cfg, args.kv)
    ctx = needed_ctx(args)
    on_gpu = smi is not None and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")
    itemsize = 4 if args.dtype == "float32" or (args.dtype == "auto" and not on_gpu) else 2
    need = resident_estimate(gguf, cfg, min(ctx, args.kv_resident or ctx), itemsize, kv=args.kv)  # KV on the device
    doc["resident_estimate_bytes"] = need
    from strata_jax.bench import peer

    def run_peer():
        res.add(peer.run_peer(args.peer_llama_bench, path, budget=budget, prefill_lens=args.prefill_len or [512],
                              n_gen=args.tokens, reps=args.peer_reps, threads=args.peer_threads,
                              wait_s=args.peer_wait, placements=args.peer_placement,
                              depth=args.prompt_len if args.peer_depth else 0, kv=args.kv))

    peer_when = None
    if args.peer_llama_bench and not args.resident_only:
        peer_when = args.peer_when
        if peer_when == "auto":
            after = peer.fits_after(doc["model_file_bytes"], machine.gpu_total_bytes(smi),
                                    cap["fraction"] if cap and cap["capped"] else None)
            peer_when = "after" if after else "before"
        doc["peer_when"] = peer_when
        if peer_when == "before":
            run_peer()
    resident_in_child = args.resident and not args.resident_only and (
        args.resident_process == "child"
        or args.resident_process == "auto" and cap is not None and cap["capped"] and need > budget)
    # --- JAX from here on ----------------------------------------------------------------------------
    from strata_jax.bench.run import ROUTING_SEED, build_configs, mark_same_tokens, prompts, routing_trace, run_config

    doc["probes"] = probes = measure_bandwidths(args.probe_mib << 20 if args.probe_mib else None)
    doc["machine"].update(machine.device_info())
    machine.check_cap(cap, doc["machine"]["jax_bytes_limit"])
    capped = bool(cap and cap["capped"] and cap.get("effective", True))
    traces = {}
    if "realistic" in args.routing:
        traces["realistic"] = routing_trace(cfg, max(ctx - 1, 1), ROUTING_SEED)
    doc["routing_seed"] = ROUTING_SEED
    prompt, long_prompts = prompts(cfg.vocab_size, args.prompt_len, args.prefill_len)
    total = len(cfg.moe_layers) * cfg.n_experts
    configs = build_configs(args, total, budget, resident=args.resident and not resident_in_child)
    has_resident = any(c.kind == "resident" for c in configs) or resident_in_child
    for conf in configs:
        if conf.kind == "budget" and has_resident and need <= budget:
            log.info("%s: every expert fits (%s needed), the same as the resident configuration; skipped",
                     conf.name, f"{need / 2**30:.1f} GiB")
            continue
        rows = run_config(path, conf, ctx=ctx, dtype=args.dtype, kv=args.kv, kv_resident=args.kv_resident,
                          devices=args.devices,
                          routings=args.routing, traces=traces,
                          prompt=prompt, long_prompts=long_prompts, n_tokens=args.tokens, mb=mb, probes=probes,
                          skip_if_resident=conf.kind == "budget" and has_resident,
                          spec=(args.spec_pass, args.spec_accept))
        for r in rows:
            r.setdefault("process", "main" + (", capped at the budget" if capped else ""))
            r["vram_cap_bytes"] = budget if capped else None
            r["ctx"] = ctx
        mark_same_tokens(doc["rows"] + rows)
        res.add(rows)
    # the rows the targets need came first; then llama.cpp, then the uncapped resident reference
    if peer_when == "after":
        run_peer()
    if resident_in_child:
        res.add(_child_resident(args, path, shape, ctx))
    mark_same_tokens(doc["rows"])
    doc["wall_s"] = time.perf_counter() - t_start
    res.save()
    return doc


def check_engine_options(args) -> None:
    """The engine options every configuration shares, validated before anything is written or loaded
    (EngineConfig: errors name the flag)."""
    from strata_jax.core.errors import ConfigError
    from strata_jax.engine.config import EngineConfig

    for depth in args.prefetch_depth:
        EngineConfig.create(flags=True, ctx=args.ctx, dtype=args.dtype, kv=args.kv, kv_resident=args.kv_resident,
                            decode_chunk=args.decode_chunk, devices=args.devices,
                            **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}),
                            vram_budget=args.vram_budget, policy=args.policy, prefetch=depth,
                            layer_scan=args.layer_scan, expert_fetch=args.expert_fetch, spec=args.spec,
                            spec_max=args.spec_max, promote_after=args.promote_after,
                            **({"cold_experts": args.cold_experts} if args.cold_experts else {}))
    if args.cold_qtype is not None:
        from gguf import GGMLQuantizationType

        if args.cold_experts or args.model:
            raise ConfigError("--cold-qtype writes a copy of a synthetic --shape: give --shape and --cold-qtype, or "
                              "--model and --cold-experts PATH.")
        if args.cold_qtype.upper() not in GGMLQuantizationType.__members__:
            raise ConfigError(f"--cold-qtype {args.cold_qtype!r} is not a GGML type: give one such as IQ2_XXS, "
                              "IQ1_M, Q2_K or Q4_0.")
        args.cold_qtype = args.cold_qtype.upper()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.prefill_len = args.prefill_len or []
    args.routing = list(dict.fromkeys(args.routing or ["model"]))
    args.cache_fraction = args.cache_fraction or ([] if args.vram_budget else [0.5])
    args.prefetch_depth = args.prefetch_depth or [0]
    args.spec_pass = args.spec_pass or []
    args.spec_accept = args.spec_accept or [1.0]
    logging.basicConfig(level=logging.INFO, format="strata-jax: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)
    from strata_jax.core.errors import StrataError

    try:
        check_engine_options(args)
        run(args, argv)
    except StrataError as e:
        print(f"strata-jax bench: error: {e}", file=sys.stderr)
        return 2
    return 0
