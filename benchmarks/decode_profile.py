"""Where a decode step's time goes on the GPU, and what the fused quantized mat-vec kernel buys.

Three parts, each written to $OUT/decode_profile.json as it finishes (a cut run keeps what it had):
  check    the Pallas kernel (strata_jax/model/qmatvec.py) against dequantize + matmul, every type it
           takes (or --types), and swiglu calls over fused rows of two types (K-quants; IQ3_S + IQ1_M)
  kernels  device time of the kernel at B30 / BSEED sizes (routed experts read from a slot pool, dense
           projections, the LM head) over a sweep of block_rows x num_warps, against today's path
           (gather + dequantize + einsum), from the profiler's kernel events; the routed experts and a
           q_proj in each of --types (default: Q4_K and the seed's IQ3_S, IQ3_XXS, IQ2_XS, IQ1_M)
  steps    whole decode steps of a B30-shaped model with fewer layers (resident, LRU 50%): wall time
           per token, and the profiler's kernel time per step, in all and by kernel name

    python benchmarks/decode_profile.py [--layers 8] [--parts check,kernels,steps] [--types Q4_K,IQ3_S]
        [--sizes bseed] [--no-dense] [--sweep 16x2]

On CPU only `check` runs (in Pallas' interpreter: slow, use --types to pick a few).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from strata_jax.dev.synthetic import random_tensor_bytes  # noqa: E402
from strata_jax.model import qmatvec as qm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RESULT: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__}


def save():
    with open(os.path.join(OUT, "decode_profile.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def gpu_events(fn, n: int, host: dict | None = None):
    """Run fn() n times under the profiler; return the device events as (name, dur_us, stats). host: a
    dict to fill with the host threads' events, {name: total us} (XLA's launch work: thunk execution,
    command-buffer updates, PjRt's Execute), so a host-bound step shows where its launch time goes."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())
    d = tempfile.mkdtemp()
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with jax.profiler.trace(d, profiler_options=opts):
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
    path = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
    pd = ProfileData.from_file(path)
    evs = []
    for plane in pd.planes:
        if host is not None and plane.name.startswith("/host:"):
            for line in plane.lines:
                for ev in line.events:
                    key = re.sub(r"[._0-9]+$", "", ev.name)[:100]
                    host[key] = host.get(key, 0.0) + ev.duration_ns / 1e3
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for ev in line.events:
                evs.append((ev.name, ev.duration_ns / 1e3, dict(ev.stats), line.name, ev.start_ns))
    return evs


def per_call_us(fn, n=20):
    evs = gpu_events(fn, n)
    by = collections.defaultdict(float)
    for name, us, *_ in evs:
        by[name[:80]] += us / n
    return sum(by.values()), dict(sorted(by.items(), key=lambda kv: -kv[1])[:8])


# ---- check -------------------------------------------------------------------------------------------


def _swiglu_check(rng, gate_qt, up_qt, F=64, D=512):
    g = random_tensor_bytes(rng, gate_qt, (5, F, D), 0.02)
    u = random_tensor_bytes(rng, up_qt, (5, F, D), 0.02)
    w_SB = jnp.asarray(np.concatenate([g.reshape(5, -1), u.reshape(5, -1)], axis=1))
    parts = (qm.Part(gate_qt, F, g.shape[-1], 0, D), qm.Part(up_qt, F, u.shape[-1], F * g.shape[-1], D))
    x = jnp.asarray(rng.standard_normal((3, 1, D)).astype(np.float32))
    slots = jnp.array([4, 1, 3], jnp.int32)
    y = qm.stacked_matvec(x, w_SB, slots, parts=parts, swiglu=True)
    ref = qm.reference_matvec(x, w_SB, slots, parts, swiglu=True)
    return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


def part_check(types):
    rng = np.random.default_rng(0)
    res = {}
    for qt in types or sorted(qm.SUPPORTED, key=int):
        for F, D, T, br in ((40, 512, 1, 16), (64, 768, 3, 32), (48, 896, 1, 16)):
            if not qm.supported(qt, D):
                continue
            w = random_tensor_bytes(rng, qt, (3, F, D), 0.02)
            R = w.shape[-1]
            w_SB = jnp.asarray(w.reshape(3, F * R))
            part = qm.Part(qt, F, R, 0, D)
            x = jnp.asarray(rng.standard_normal((4, T, D)).astype(np.float32))
            slots = jnp.array([2, 0, 1, 2], jnp.int32)
            try:
                y = qm.stacked_matvec(x, w_SB, slots, parts=(part,), block_rows=br)
                ref = qm.reference_matvec(x, w_SB, slots, (part,))
                err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
                res[f"{qt.name} F{F} D{D} T{T}"] = err
            except Exception as e:  # noqa: BLE001
                res[f"{qt.name} F{F} D{D} T{T}"] = f"{type(e).__name__}: {str(e)[:300]}"
    # swiglu over a fused (gate, up) pair; the IQ pair reads two codebook inputs in one call
    for gate_qt, up_qt in ((Q.Q4_K, Q.Q6_K), (Q.IQ3_S, Q.IQ1_M)):
        key = f"swiglu {gate_qt.name.lower()}+{up_qt.name.lower()}"
        try:
            res[key] = _swiglu_check(rng, gate_qt, up_qt)
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {str(e)[:300]}"
    RESULT["check"] = res
    save()
    print("check:", json.dumps(res, indent=0))


# ---- kernels -----------------------------------------------------------------------------------------


def _expert_pool(rng, S, F, D, qt=Q.Q4_K):
    g = random_tensor_bytes(rng, qt, (F, D), 0.02)
    d = random_tensor_bytes(rng, qt, (D, F), 0.02)
    row = np.concatenate([g.reshape(-1), g.reshape(-1), d.reshape(-1)])
    data = np.broadcast_to(row, (S, row.size)).copy()
    gp = qm.Part(qt, F, g.shape[-1], 0, D)
    up = qm.Part(qt, F, g.shape[-1], g.size, D)
    dp = qm.Part(qt, D, d.shape[-1], 2 * g.size, F)
    return jnp.asarray(data), (gp, up, dp)


KERNEL_TYPES = (Q.Q4_K, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ1_M)  # the kernels part's default --types


EXPERT_SIZES = {"b30": (128, 8, 768, 2048), "bseed": (512, 10, 512, 2048)}  # E, top-k, F, D


def _gb_s(nbytes, us):
    return nbytes / us / 1e3 if us else None  # no device events (a CPU dry run): no figure


def _time_kernel(res, sweep, label, w, slots, x, parts, sw, nbytes):
    """The fused kernel on one problem over the sweep, right after its baseline (a cut run keeps pairs)."""
    for br, nw in sweep:
        key = f"{label} br{br} w{nw}"
        try:
            t0 = time.perf_counter()
            fn = jax.jit(lambda w=w, s=slots, x=x, br=br, nw=nw, parts=parts, sw=sw:
                         qm.stacked_matvec(x, w, s, parts=parts, swiglu=sw, block_rows=br, num_warps=nw))
            jax.block_until_ready(fn())
            compile_s = time.perf_counter() - t0
            tot, _ = per_call_us(fn)
            res[key] = {"us": tot, "GB_s": _gb_s(nbytes, tot), "compile_s": compile_s}
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {str(e)[:400]}"
        print(key, res[key], flush=True)
    save()


def part_kernels(sweep, types, sizes=tuple(EXPERT_SIZES), dense_too=True):
    """Device time (profiler kernel events) of the kernel against today's path per problem, each problem's
    kernel timed right after its baseline. Labels of Q4_K problems carry no type name (as in earlier
    results); the others name theirs."""
    from strata_jax.gguf.quant import dequantize

    rng = np.random.default_rng(1)
    res = RESULT.setdefault("kernels", {})
    types = types or KERNEL_TYPES
    expert_problems = [(f"{name}" if qt == Q.Q4_K else f"{name} {qt.name}", qt, *EXPERT_SIZES[name])
                       for qt in types for name in sizes
                       if qm.supported(qt, EXPERT_SIZES[name][3]) and qm.supported(qt, EXPERT_SIZES[name][2])]
    for name, qt, E, K, F, D in expert_problems:
        pool, (gp, up, dp) = _expert_pool(rng, E, F, D, qt)
        slots = jnp.asarray(rng.choice(E, K, replace=False).astype(np.int32))
        x = jnp.asarray(rng.standard_normal((K, 1, D)), jnp.bfloat16)
        h = jnp.asarray(rng.standard_normal((K, 1, F)), jnp.bfloat16)
        n_gu, n_d = K * 2 * F * gp.row_bytes, K * D * dp.row_bytes

        def baseline(pool=pool, slots=slots, x=x, gp=gp, up=up, dp=dp):
            rows = jnp.take(pool, slots, axis=0)
            mats = []
            for p in (gp, up, dp):
                blk = rows[:, p.offset:p.offset + p.n_rows * p.row_bytes].reshape(-1, p.n_rows, p.row_bytes)
                mats.append(dequantize(blk, p.qtype, p.n_cols, jnp.bfloat16))
            x1 = x[:, 0]
            f32 = jnp.float32
            a = jax.nn.silu(jnp.einsum("kd,kfd->kf", x1, mats[0], preferred_element_type=f32))
            a = (a * jnp.einsum("kd,kfd->kf", x1, mats[1], preferred_element_type=f32)).astype(jnp.bfloat16)
            return jnp.einsum("kf,kdf->kd", a, mats[2], preferred_element_type=f32)

        tot, top = per_call_us(jax.jit(baseline))
        res[f"{name} experts: baseline gather+dequant+einsum (gate, up, down)"] = {
            "us": tot, "GB_s": _gb_s(n_gu + n_d, tot), "top": top}
        print(name, "baseline experts", f"{tot:.1f} us", flush=True)
        _time_kernel(res, sweep, f"{name} experts gate+up", pool, slots, x, (gp, up), True, n_gu)
        _time_kernel(res, sweep, f"{name} experts down", pool, slots, h, (dp,), False, n_d)
    if not dense_too:
        return
    dense = [("q_proj", Q.Q4_K, 4096, 2048), ("o_proj", Q.Q4_K, 2048, 4096),
             ("kv_proj", Q.Q4_K, 512, 2048), ("lm_head", Q.Q4_K, 151936, 2048),
             ("qwen ffn_up q5_0", Q.Q5_0, 4864, 896), ("qwen ffn_down q6_k", Q.Q6_K, 896, 4864),
             ("qwen lm_head q8_0", Q.Q8_0, 151936, 896)]
    dense += [(f"q_proj {qt.name.lower()}", qt, 4096, 2048) for qt in types if qt != Q.Q4_K and qm.supported(qt, 2048)]
    for name, qt, F, D in dense:
        w = random_tensor_bytes(rng, qt, (F, D), 0.02)
        wd = jnp.asarray(w)
        x = jnp.asarray(rng.standard_normal((1, 1, D)), jnp.bfloat16)
        tot, top = per_call_us(jax.jit(lambda wd=wd, x=x, qt=qt, D=D: jnp.einsum(
            "td,fd->tf", x[0], dequantize(wd, qt, D, jnp.bfloat16), preferred_element_type=jnp.float32)))
        res[f"dense {name}: baseline dequant+einsum"] = {"us": tot, "GB_s": _gb_s(w.size, tot), "top": top}
        print("baseline", name, f"{tot:.1f} us", flush=True)
        _time_kernel(res, sweep, f"dense {name}", jnp.asarray(w.reshape(1, -1)), jnp.zeros((1,), jnp.int32), x,
                     (qm.dense_part(qt, F, D),), False, w.size)


# ---- steps -------------------------------------------------------------------------------------------

def part_steps(layers: int, tokens: int, confs_arg: str):
    import dataclasses

    import strata_jax
    from strata_jax.bench.shapes import SHAPES
    from strata_jax.dev.synthetic import write_synthetic_gguf

    spec = dataclasses.replace(SHAPES["b30"], n_layers=layers)
    path = f"/tmp/b30-{layers}L.gguf"
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_synthetic_gguf(path, spec)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    res = RESULT.setdefault("steps", {})
    prompt = list(range(100, 132))
    cache = {"resident": {}, "lru50": {"expert_slots": layers * 128 // 2, "policy": "lru"}}
    confs = [(f"{c} qmatvec={flag}", cache[c], flag) for c, flag in (x.split(":") for x in confs_arg.split(","))]
    for conf, kw, flag in confs:
        os.environ["STRATA_JAX_QMATVEC"] = flag
        jax.clear_caches()
        t0 = time.perf_counter()
        model = strata_jax.load(path, ctx=1024, **kw)
        model.tokenizer.stop_ids = frozenset()
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        model.generate(prompt, max_tokens=4, temperature=0, cache_prompt=False)
        first_s = time.perf_counter() - t1
        g = model.generate(prompt, max_tokens=tokens, temperature=0, cache_prompt=False)
        row = {"load_s": load_s, "first_generate_s": first_s, "decode_tok_s": g.timings["decode_per_second"],
               "ms_per_token": 1e3 / g.timings["decode_per_second"], "stats": {
                   k: v for k, v in model.stats().items() if isinstance(v, (int, float, str))}}
        # profile 8 decode steps through the engine's own step function
        def run8(model=model):
            model.generate(prompt, max_tokens=9, temperature=0, cache_prompt=True)
            return jnp.zeros(())

        host_us = {}
        evs = gpu_events(run8, 1, host_us)
        # nested host events overlap (a thunk inside Execute): totals per name, not a partition
        row["host_top_us_per_step"] = {k: round(v / 8, 1) for k, v in
                                       sorted(host_us.items(), key=lambda kv: -kv[1])[:40]}
        if any("hlo_module" in e[2] for e in evs):  # decode steps only, not the prompt's prefill
            evs = [e for e in evs if "decode" in str(e[2].get("hlo_module", ""))]
        # under a CUDA graph every kernel's hlo_op is the command buffer: group by kernel name instead
        by_kernel = collections.defaultdict(float)
        keys = set()
        for name, us, stats, *_ in evs:
            keys.update(stats)
            by_kernel[re.sub(r"[._0-9]+$", "", name)] += us / 8
        row["profile_us_per_step"] = sum(by_kernel.values())
        row["profile_kernels_per_step"] = len(evs) / 8
        row["profile_top_kernels"] = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:40])
        row["profile_stat_keys"] = sorted(keys)
        row["profile_sample"] = [(n[:100], round(u, 2), {k: str(v)[:120] for k, v in s.items()})
                                 for n, u, s, *_ in evs[:30]]
        res[conf] = row
        save()
        print(conf, json.dumps({k: row[k] for k in ("decode_tok_s", "ms_per_token", "profile_us_per_step",
                                                     "profile_kernels_per_step")}), flush=True)
        del model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="check,steps,kernels")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--confs", default="resident:1,lru50:1,resident:0,lru50:0",
                   help="steps: configuration:qmatvec flag pairs")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--sweep", default="8x1,16x2,32x4")
    p.add_argument("--types", default="", help="check / kernels: comma-separated GGML types (default: check "
                   "every type the kernel takes; kernels Q4_K and the seed's IQ types)")
    p.add_argument("--sizes", default=",".join(EXPERT_SIZES), help="kernels: the expert problem sizes")
    p.add_argument("--no-dense", action="store_true", help="kernels: the routed experts only")
    a = p.parse_args()
    sweep = [tuple(int(v) for v in s.split("x")) for s in a.sweep.split(",")]
    types = [Q[t.strip().upper()] for t in a.types.split(",") if t.strip()]
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            {"check": lambda: part_check(types), "kernels": lambda: part_kernels(
                sweep, types, tuple(x for x in a.sizes.split(",") if x), not a.no_dense),
             "steps": lambda: part_steps(a.layers, a.tokens, a.confs)}[part]()
        except Exception:  # noqa: BLE001
            RESULT[f"{part}_error"] = traceback.format_exc()
            traceback.print_exc()
        RESULT[f"{part}_s"] = time.perf_counter() - t0
        save()
        print(f"== {part} done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
