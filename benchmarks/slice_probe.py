"""Which ways of reading a scanned layer's slice keep the layer loop inside XLA's command buffers (GPU).

The two copies left in qseed's decode loop (docs/benchmarks.md, "Float products read in place"): the
attention layers' read of their span of the stacked KV cache, and the F16 hyper-connection matrices,
GGML bytes bitcast two to a value. Each variant is a small scanned program with that one read, run in its
own process so that XLA's command-buffer conversion log (TF_CPP_VMODULE) is its own; it prints one JSON
line per variant: "not convertible" loop count, host ms in the call, ms per step.

    python benchmarks/slice_probe.py            # every variant, one process each
    python benchmarks/slice_probe.py kv:slice   # one variant, in this process
    python benchmarks/slice_probe.py bench kv:f32+hc:shift --model M ...   # `strata-jax bench` with the
        # variants patched in (use --no-resident: the resident child process runs unpatched)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VARIANTS = ("kv:slice", "kv:f32", "kv:gather", "kv:before", "hc:bitcast", "hc:shift", "hc:f16")


def patch(variants: str) -> None:
    """Swap in the named forms (joined by "+") of the KV read (kvquant.read; kv:before: attention's
    READ_BEFORE_WRITE) and the F16 decoder (quant._f16) for this process."""
    import jax
    import jax.numpy as jnp

    from strata_jax.gguf import quant
    from strata_jax.model import kvquant
    plain = kvquant.read
    for v in variants.split("+"):
        if v == "kv:slice":  # the code as it is
            continue
        if v == "kv:f32":
            kvquant.read = lambda c, layer, start, size, dtype: plain(c, layer, start, size, jnp.float32).astype(
                jnp.float32)
        elif v == "kv:gather":
            def read(c, layer, start, size, dtype):
                if isinstance(c, kvquant.QuantKV):
                    return plain(c, layer, start, size, dtype)
                return jnp.moveaxis(c[layer, :, start + jnp.arange(size)], 0, 1)
            kvquant.read = read
        elif v == "kv:before":
            from strata_jax.model.layers import attention
            attention.READ_BEFORE_WRITE = True
        elif v == "hc:shift":
            def f16(b):
                u = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
                return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)
            quant._f16 = f16
        else:
            raise SystemExit(f"slice_probe: unknown form {v!r} (kv:slice, kv:f32, kv:gather, kv:before, hc:shift)")


def run(variant: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from strata_jax.gguf import quant
    from strata_jax.model.layers import attention, basic
    from strata_jax.model.runs import _loop

    kind, form = variant.split(":")
    steps = 30
    if kind == "kv":
        L, S, K, Dh, H = 12, 1024, 2, 256, 16
        patch(variant)

        def step(x, kc, vc, pos):
            def layer(carry, i):
                x, kc, vc = carry
                q = jnp.broadcast_to(x[:, :, None, :Dh], (1, 1, H, Dh)).astype(jnp.bfloat16)
                kv = jnp.broadcast_to(x[:, :, None, :Dh], (1, 1, K, Dh)).astype(jnp.bfloat16)
                out, kc, vc = attention.attend(q, kv, kv, pos, kc, vc, i, None, attn_block=256)
                return (x + 1e-3 * out[..., :x.shape[-1]], kc, vc), None
            (x, kc, vc), _ = _loop(layer, (x, kc, vc), L)
            return x, kc, vc

        f = jax.jit(step, donate_argnums=(1, 2))
        x = jnp.ones((1, 1, 2048), jnp.float32)
        kc = jnp.zeros((L, 1, S, K, Dh), jnp.bfloat16)
        vc = jnp.zeros((L, 1, S, K, Dh), jnp.bfloat16)
        args = lambda t: (jnp.full((1, 1), 300 + t, jnp.int32),)  # noqa: E731
        call = lambda x, st, t: f(x, *st, *args(t))  # noqa: E731
        state = (kc, vc)
    else:
        L, F, R = 36, 12288, 320
        patch(variant)
        rng = np.random.default_rng(0)
        w16 = rng.standard_normal((L, F, R)).astype(np.float16)
        if form == "f16":
            stack = jnp.asarray(w16)
            w_of = lambda i: jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False).astype(jnp.float32)  # noqa: E731
        else:
            stack = jnp.asarray(w16.view(np.uint8).reshape(L, F, 2 * R))
            w_of = lambda i: quant.dequantize(  # noqa: E731
                jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False), quant.T.F16, R, jnp.float32)

        def step(x, st, pos):
            def layer(x, i):
                y = basic.few_rows_product(x[..., :R], w_of(i))  # [1, F]
                return x + 1e-3 * jnp.tanh(y[..., :x.shape[-1]]), None
            x, _ = _loop(layer, x, L)
            return x, st

        f = jax.jit(step)
        x = jnp.ones((1, 2048), jnp.float32)
        state = (jnp.zeros(()),)
        call = lambda x, st, t: f(x, st[0], t)  # noqa: E731

    out = call(x, state, 0)
    jax.block_until_ready(out)
    x, state = out[0], out[1:]
    host, t0 = 0.0, time.perf_counter()
    for t in range(1, steps + 1):
        h = time.perf_counter()
        out = call(x, state, t)
        host += time.perf_counter() - h
        x, state = out[0], out[1:]
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    return {"variant": variant, "host_ms_per_step": round(1e3 * host / steps, 3),
            "ms_per_step": round(1e3 * wall / steps, 3), "finite": bool(np.isfinite(np.asarray(x)).all())}


def main() -> None:
    if sys.argv[1:2] == ["bench"]:
        patch(sys.argv[2])
        from strata_jax.cli import main as cli
        sys.exit(cli(["bench", *sys.argv[3:]]))
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])), flush=True)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2")
    for v in VARIANTS:
        p = subprocess.run([sys.executable, __file__, v], env=env, capture_output=True, text=True, timeout=300)
        row = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"variant": v, "rc": p.returncode,
                                                                                        "err": p.stderr[-1500:]}
        row["not_convertible"] = sum("not convertible" in ln for ln in p.stderr.splitlines())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
