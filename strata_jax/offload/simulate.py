"""Replay a recorded expert-routing trace through a cache policy, without weights: hit rates per policy
and cache size in well under a second, from the same jnp policy code the engine runs.

Access order is the engine's: for each token, each MoE layer in order, one `access` with that layer's
unique routed experts. By default one cache of `n_slots` serves every layer (as the engine's
`expert_slots` does within a pool); `per_layer=True` gives each layer its own cache of n_slots // L slots,
the setting of published per-layer reuse curves.

Shape legend: strata_jax/core/shapes.py (here Ac: accesses, T * L of them, a = t * L + l; U: the unique
ids of one access, k of them, -1 padded).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.offload.policies import (DISABLED, FREE, CacheState, Policy, belady_access, belady_policy, get_policy,
                                         promote, static_policy, usage_profile)


def load_trace(path, prompt: str | None = None) -> np.ndarray:
    """int32 [T, L, K] from the shared trace JSON ({"prompts": {name: {"prefill", "decode"}}}): prefill
    then decode tokens of `prompt`, or of every prompt one after another (file order) when None."""
    data = json.loads(Path(path).read_text())
    prompts = data["prompts"]
    if prompt is not None and prompt not in prompts:
        raise KeyError(f"prompt {prompt!r} not in the trace; it has {', '.join(prompts)}")
    names = list(prompts) if prompt is None else [prompt]
    rows = [np.asarray(prompts[n]["prefill"] + prompts[n]["decode"], np.int32) for n in names]
    return np.concatenate(rows, axis=0)


def n_experts_of(trace_TLk) -> int:
    """Experts per layer a trace implies: its largest id + 1 (at least 1)."""
    return max(int(np.max(trace_TLk, initial=-1)) + 1, 1)


def unique_requests(trace_TLk) -> np.ndarray:
    """int32 [T, L, K]: each (token, layer) row's distinct ids in router order, -1 padding at the end
    (duplicates are legal in a trace but `admit` needs unique requests)."""
    t = np.asarray(trace_TLk, np.int32)
    keep = t >= 0
    for j in range(1, t.shape[-1]):
        keep[..., j] &= ~np.any(t[..., :j] == t[..., j:j + 1], axis=-1)
    order = np.argsort(~keep, axis=-1, kind="stable")  # kept entries first, router order preserved
    return np.where(np.take_along_axis(keep, order, -1), np.take_along_axis(t, order, -1), -1).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("access", "keep_states"))
def replay(access, state: CacheState, layer_Ac: jax.Array, ids_AcU: jax.Array, keep_states: bool = False):
    """Run `access` over a sequence of requests: (final state, Plans stacked [A, U], states stacked [A]
    after each access or None). Any layer order works for the online policies."""

    def step(st, x):
        st, plan = access(st, x[0], x[1])
        return st, (plan, st if keep_states else None)

    final, (plans, states) = jax.lax.scan(step, state, (layer_Ac, ids_AcU))
    return final, plans, states


@functools.partial(jax.jit, static_argnames=("access",))
def _replay_per_layer(access, states_L: CacheState, ids_TLU: jax.Array):
    """One independent cache per layer, stacked on a leading axis: the layers of a token are independent,
    so they run side by side (vmap) and the scan is over tokens only."""
    layer_L = jnp.arange(ids_TLU.shape[1], dtype=jnp.int32)

    def step(st, ids_LU):
        st, plan = jax.vmap(access)(st, layer_L, ids_LU)
        return st, plan

    return jax.lax.scan(step, states_L, ids_TLU)[1]


def _mixed_access(access, after: int, st: CacheState, uses_E: jax.Array, layer, ids_U: jax.Array):
    """One access with mixed-precision experts, as the engine's lookup does it (offload/provider.py): the
    misses not promoted (policies.promote) are served low-bit and never reach the policy. Returns (state,
    uses_E, plan, cold_U)."""
    valid_U = ids_U >= 0
    hit_U = valid_U & (st.slot_map_LE[layer, jnp.maximum(ids_U, 0)] >= 0)
    uses_E, promote_U = promote(uses_E, ids_U, hit_U, after, jnp.sum(st.owner_X == FREE))
    st, plan = access(st, layer, jnp.where(promote_U, ids_U, -1))
    return st, uses_E, plan, valid_U & ~promote_U


@functools.partial(jax.jit, static_argnames=("access", "after"))
def _replay_mixed(access, after: int, state: CacheState, layer_Ac: jax.Array, ids_AcU: jax.Array):
    """`replay` with mixed-precision experts (one cache): (plans [A, U], cold [A, U])."""
    uses_LE = jnp.zeros(state.slot_map_LE.shape, jnp.int32)

    def step(carry, x):
        st, uses = carry
        st, uses_E, plan, cold_U = _mixed_access(access, after, st, uses[x[0]], x[0], x[1])
        return (st, uses.at[x[0]].set(uses_E)), (plan, cold_U)

    return jax.lax.scan(step, (state, uses_LE), (layer_Ac, ids_AcU))[1]


@functools.partial(jax.jit, static_argnames=("access", "after"))
def _replay_per_layer_mixed(access, after: int, states_L: CacheState, ids_TLU: jax.Array):
    """`_replay_per_layer` with mixed-precision experts: (plans [T, L, U], cold [T, L, U])."""
    L = ids_TLU.shape[1]
    layer_L = jnp.arange(L, dtype=jnp.int32)
    uses_LE = jnp.zeros((L, states_L.slot_map_LE.shape[-1]), jnp.int32)

    def step(carry, ids_LU):
        st, uses = carry
        st, uses, plan, cold = jax.vmap(functools.partial(_mixed_access, access, after))(st, uses, layer_L, ids_LU)
        return (st, uses), (plan, cold)

    return jax.lax.scan(step, (states_L, uses_LE), ids_TLU)[1]


def with_slots(state: CacheState, n_usable: int) -> CacheState:
    """An empty cache with only its first n_usable slots in use (the rest DISABLED)."""
    owner = jnp.where(jnp.arange(state.owner_X.shape[0]) < n_usable, state.owner_X, DISABLED)
    return dataclasses.replace(state, owner_X=owner.astype(jnp.int32))


def _stack(states: list[CacheState]) -> CacheState:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)


def _resolve(policy, trace_TLk: np.ndarray, n_experts: int) -> tuple[str, Callable[[np.ndarray], Policy]]:
    """(report name, factory sub_trace_TLk -> Policy): Belady must be built from the exact accesses its
    cache will see, which differ between the shared and the per-layer replay."""
    if isinstance(policy, str) and policy.strip() == "belady":
        return "belady", lambda sub: belady_policy(sub, name="belady")
    if isinstance(policy, str) and policy.strip() == "static":
        # oracle: the profile is the replayed trace's own usage, i.e. a perfectly representative saved one
        prof = usage_profile(trace_TLk, trace_TLk.shape[1], n_experts)
        pol = static_policy(prof, name="static(oracle)")
        return pol.name, lambda sub: pol
    pol = get_policy(policy)
    return pol.name, lambda sub: pol


def _rate(h, m) -> float:
    return float(h / (h + m)) if h + m else 1.0


def simulate(trace_TLk, policy: str | Policy, n_slots: int, *, per_layer: bool = False, warmup_tokens: int = 0,
             n_experts: int | None = None, promote_after: int | None = None) -> dict:
    """Replay `trace_TLk` (int [tokens, layers, k] of routed ids, -1 padding) through `policy` with
    `n_slots` slots in total, starting from an empty cache.

    policy: a registered name ("lru", "lfu", "lrfu", "lrfu(0.2)"), a Policy, or one built from the trace
    itself: "belady" (offline optimum) or "static" (profile = this trace's own usage counts: an oracle,
    so optimistic; a deployment would use a profile saved from other traffic via static_policy). A
    Policy made by belady_policy is only valid for the shared replay of the trace it was built from.
    per_layer: each layer gets its own cache of n_slots // L slots instead of one shared cache.
    warmup_tokens: the first tokens still fill the cache but are left out of the *_after_warmup counts.
    n_experts: experts per layer (default: the largest id in the trace + 1).
    promote_after: mixed-precision experts (--cold-experts): a miss is served low-bit (counted in misses and
    in `cold`, never admitted) until that expert has been served so `promote_after` times.

    Returns hits, misses, lookups, hit_rate, per_layer_hit_rate, the same after warmup, compulsory
    misses (distinct experts in the trace: no cache size can do better), and the setup."""
    trace_TLk = np.asarray(trace_TLk)
    if trace_TLk.ndim != 3:
        raise ValueError(f"trace must be [tokens, layers, k], got shape {trace_TLk.shape}")
    T, L, K = trace_TLk.shape
    E = int(n_experts) if n_experts is not None else n_experts_of(trace_TLk)
    if trace_TLk.size and (trace_TLk.min() < -1 or trace_TLk.max() >= E):
        raise ValueError(f"trace ids must lie in [-1, {E})")
    ids_TLU = unique_requests(trace_TLk)
    name, make = _resolve(policy, trace_TLk, E)
    S = n_slots // L if per_layer else n_slots
    # requests are K wide (one compiled replay per trace width); narrower only if the cache needs it
    U = K if S >= K else max(int((ids_TLU >= 0).sum(-1).max(initial=0)), 1)
    ids_TLU = ids_TLU[..., :U]
    if S < U:
        raise ValueError(f"{S} slots{' per layer' if per_layer else ''} cannot hold the {U} experts one "
                         "access needs")

    # every size runs on the same padded shape (the extra slots DISABLED): one compile per policy and
    # trace shape covers a whole sweep; slots beyond one per expert could never be used anyway
    S_pad = max(E if per_layer else L * E, U)
    S_use = min(S, S_pad)
    if per_layer and isinstance(policy, Policy) and policy.access is belady_access:
        raise ValueError("a belady_policy(...) Policy is built for the shared replay; pass 'belady' by name")
    if promote_after is not None and (isinstance(policy, Policy) and policy.access is belady_access or name == "belady"):
        raise ValueError("Belady's optimum knows every future access, so low-bit serving does not apply to it")
    cold_TLU = np.zeros(ids_TLU.shape, bool)
    if per_layer:
        pols = [make(trace_TLk[:, l:l + 1]) for l in range(L)]
        states = _stack([with_slots(p.init(S_pad, L, E), S_use) for p in pols])
        if promote_after is None:
            plans = _replay_per_layer(pols[0].access, states, jnp.asarray(ids_TLU))  # leaves [T, L, U]
        else:
            plans, cold = _replay_per_layer_mixed(pols[0].access, int(promote_after), states, jnp.asarray(ids_TLU))
            cold_TLU = np.asarray(cold)
    else:
        pol = make(trace_TLk)
        layer_Ac = jnp.asarray(np.tile(np.arange(L, dtype=np.int32), T))
        state = with_slots(pol.init(S_pad, L, E), S_use)
        if promote_after is None:
            _, plans, _ = replay(pol.access, state, layer_Ac, jnp.asarray(ids_TLU.reshape(T * L, U)))
        else:
            plans, cold = _replay_mixed(pol.access, int(promote_after), state, layer_Ac,
                                        jnp.asarray(ids_TLU.reshape(T * L, U)))
            cold_TLU = np.asarray(cold).reshape(T, L, U)
    # a low-bit miss is a miss (it crossed PCIe), outside the policy's plan
    miss_TLU = np.asarray(plans.miss_U).reshape(T, L, U) | cold_TLU
    valid_TLU = ids_TLU >= 0
    hit_TL = (valid_TLU & ~miss_TLU).sum(-1)
    miss_TL = miss_TLU.sum(-1)
    w = min(max(int(warmup_tokens), 0), T)
    hits, misses = int(hit_TL.sum()), int(miss_TL.sum())
    hits_w, misses_w = int(hit_TL[w:].sum()), int(miss_TL[w:].sum())
    distinct = int(sum(len(np.unique(ids_TLU[:, l][valid_TLU[:, l]])) for l in range(L)))
    return {
        "policy": name, "n_slots": int(n_slots), "per_layer": bool(per_layer),
        "slots_per_layer": S if per_layer else n_slots / L,
        "tokens": T, "layers": L, "experts": E,
        "hits": hits, "misses": misses, "lookups": hits + misses, "hit_rate": _rate(hits, misses),
        "per_layer_hit_rate": [_rate(h, m) for h, m in zip(hit_TL.sum(0).tolist(), miss_TL.sum(0).tolist())],
        "warmup_tokens": w, "hits_after_warmup": hits_w, "misses_after_warmup": misses_w,
        "hit_rate_after_warmup": _rate(hits_w, misses_w),
        "compulsory_misses": distinct,
        "promote_after": promote_after, "cold": int(cold_TLU.sum()),
        "cold_share": float(cold_TLU.sum() / (hits + misses)) if hits + misses else 0.0,
    }
