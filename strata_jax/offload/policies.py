"""Expert-cache policies as pure jnp functions, shared by the jitted engine step and the simulator.

A policy is a pair of functions:

    init(n_slots, n_layers, n_experts) -> CacheState
    access(state, layer, ids_U) -> (CacheState, Plan)

`access` is called once per MoE layer per step with the layer's unique routed experts (`ids_U`, -1
padded). It returns where each needed expert lives after the step and which of them must be fetched
into which slot. The mechanics every policy shares (hit detection, victim choice that never evicts an
expert needed now, map/owner bookkeeping) live in `admit`; a policy supplies only its eviction score
and how that score changes on use. Everything is traceable: layer and ids may be traced values.

Policies: "lru"; "lfu" (use counts kept per expert across evictions); "lrfu" / lrfu_policy(lam), the
recency-frequency hybrid of Lee et al.; static_policy(profile), seeded from a saved usage profile; and
belady_policy(trace), the offline optimum, for the simulator only (strata_jax.offload.simulate).
Recency enters as an int32 difference to the clock, so LRU order stays exact over long runs.

Shape legend: strata_jax/core/shapes.py (here L: the layers of this cache, X its slots, Ac its accesses,
one per token and layer: a = t * L + l).
Expert ids are global within a cache: g = layer * E + expert.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


FREE, DISABLED = -1, -2  # owner_X of an empty slot / of a slot that must stay unused


@struct.dataclass
class CacheState:
    slot_map_LE: jax.Array  # int32: slot holding (layer, expert), -1 if absent
    owner_X: jax.Array  # int32: global expert id in each slot, FREE (-1) or DISABLED (-2)
    clock: jax.Array  # int32 scalar: accesses so far (one per layer visit)
    meta: dict[str, jax.Array]  # policy-specific state (recency, frequency, ...)

    @classmethod
    def empty(cls, n_slots: int, n_layers: int, n_experts: int, **meta: jax.Array) -> "CacheState":
        return cls(jnp.full((n_layers, n_experts), -1, jnp.int32), jnp.full((n_slots,), -1, jnp.int32),
                   jnp.zeros((), jnp.int32), dict(meta))

    @property
    def n_experts(self) -> int:
        return self.slot_map_LE.shape[-1]  # a stack of states (SlotTable.block) has a leading axis


@struct.dataclass
class Plan:
    ids_U: jax.Array  # int32: the requested experts (-1 padding)
    slot_U: jax.Array  # int32: slot of each requested expert after this access (-1 for padding)
    miss_U: jax.Array  # bool: must be fetched into slot_U before use
    evicted_U: jax.Array  # int32: global id previously in slot_U for misses (-1: the slot was free)

    @property
    def n_hits(self) -> jax.Array:
        return jnp.sum((self.ids_U >= 0) & ~self.miss_U)

    @property
    def n_misses(self) -> jax.Array:
        return jnp.sum(self.miss_U)


def _lex_smallest(score_X: jax.Array, tie_X: jax.Array, k: int) -> jax.Array:
    """Indices of the k smallest (score, tie) pairs in lexicographic order (then lowest index). Built from
    float top_k, which XLA runs far faster than a sort or an integer top_k (20-50x on CPU at S=576):
    the k smallest scores give a threshold v; the fewer than k slots below v are ordered pairwise, the
    slots at v by their tie key."""
    vals_k, idx_k = jax.lax.top_k(-score_X, k)
    # a reduction, not vals_k[k - 1]: XLA folds a one-element slice into the top_k's sort and then no
    # longer recognises it as a top_k (a full sort, 20x slower)
    v = -jnp.min(vals_k)
    cs, ct = -vals_k, tie_X[idx_k]
    lower = jnp.arange(k)[:, None] < jnp.arange(k)[None, :]  # top_k lists equal scores by index
    before_kk = (cs[:, None] < cs[None, :]) | ((cs[:, None] == cs[None, :]) & (
        (ct[:, None] < ct[None, :]) | ((ct[:, None] == ct[None, :]) & lower)))
    below_k = cs < v
    rank_k = jnp.sum(before_kk & below_k[:, None], axis=0)
    n_below = jnp.sum(below_k)
    first_k = jnp.zeros((k,), idx_k.dtype).at[jnp.where(below_k, rank_k, k)].set(idx_k, mode="drop")
    _, at_v_k = jax.lax.top_k(-jnp.where(score_X == v, tie_X, jnp.inf), k)
    pos = jnp.arange(k)
    return jnp.where(pos < n_below, first_k, at_v_k[jnp.clip(pos - n_below, 0, k - 1)])


def admit(state: CacheState, layer, ids_U: jax.Array, evict_score_X: jax.Array,
          tiebreak_X: jax.Array | None = None) -> tuple[CacheState, Plan]:
    """Look up ids_U in layer; give each miss the not-needed slot with the lowest evict score (free slots
    first; among equal scores the lowest `tiebreak_X` if given, else the lowest slot index). Scores are
    compared in float32 (an int above 2^24 is rounded: pass small or relative values); +-inf and nan
    are clamped to the largest finite values, so they can never displace a needed or a free slot.
    A slot whose owner is DISABLED (-2) is never used, so one compiled replay can serve several cache
    sizes (the simulator pads with them). Requires U <= usable slots; ids_U unique apart from -1 padding."""
    S = state.owner_X.shape[0]
    L, E = state.slot_map_LE.shape
    U = ids_U.shape[0]
    if U > S:
        raise ValueError(f"{U} experts requested at once but the cache has only {S} slots")
    valid = ids_U >= 0
    safe_ids = jnp.where(valid, ids_U, 0)
    cur = jnp.where(valid, state.slot_map_LE[layer, safe_ids], -1)
    hit = valid & (cur >= 0)
    miss = valid & ~hit
    protected_X = jnp.zeros((S,), bool).at[jnp.where(hit, cur, S)].set(True, mode="drop")
    # a policy's inf or nan must not tie with the +inf that protects needed experts
    big = jnp.finfo(jnp.float32).max
    score = jnp.nan_to_num(evict_score_X.astype(jnp.float32), nan=big, posinf=big, neginf=-big)
    score = jnp.where(state.owner_X == FREE, -jnp.inf, score)
    score = jnp.where(protected_X | (state.owner_X == DISABLED), jnp.inf, score)
    if tiebreak_X is None:
        _, victims_U = jax.lax.top_k(-score, U)
    else:
        victims_U = _lex_smallest(score, tiebreak_X.astype(jnp.float32), U)
    rank_U = jnp.cumsum(miss) - 1
    new_slot = jnp.where(miss, victims_U[jnp.clip(rank_U, 0, U - 1)], cur)
    evicted = jnp.where(miss, state.owner_X[jnp.where(miss, new_slot, 0)], -1)

    # unmap evicted experts, map the new ones, record owners; padding writes go out of range and drop
    ev_ok = evicted >= 0
    slot_map = state.slot_map_LE.at[jnp.where(ev_ok, evicted // E, L), jnp.where(ev_ok, evicted % E, 0)].set(
        -1, mode="drop")
    slot_map = slot_map.at[jnp.where(miss, layer, L), safe_ids].set(new_slot, mode="drop")
    owner = state.owner_X.at[jnp.where(miss, new_slot, S)].set(layer * E + safe_ids, mode="drop")
    new_state = dataclasses.replace(state, slot_map_LE=slot_map, owner_X=owner, clock=state.clock + 1)
    return new_state, Plan(ids_U, jnp.where(valid, new_slot, -1), miss, evicted)


def used_slots(plan: Plan, n_slots: int) -> jax.Array:
    """Scatter indices for the slots touched by this access (out of range for padding: use mode="drop")."""
    return jnp.where(plan.ids_U >= 0, plan.slot_U, n_slots)


def promote(uses_E: jax.Array, ids_U: jax.Array, hit_U: jax.Array, after: int,
            n_free: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """Mixed-precision experts (--cold-experts): which of one layer's requested experts go through the cache
    at the model's own type. Hits do; a miss is promoted (admitted and fetched at the high-bit type) once it
    has been served `after` times from the low-bit copy since it last entered the cache, or while the cache
    has free slots (n_free: the first misses take them, as nothing is displaced); else it is served from
    that copy and counted (uses_E, int32 [E]: this layer's low-bit uses). An admission filter: an expert
    used once in a while never displaces the hot ones (docs/benchmarks.md has the replays). after=0
    promotes every miss (plain offloading), after=-1 none (every miss low-bit: what the copy costs).
    Returns (uses_E, promote_U); the policy sees only the promoted."""
    valid_U = ids_U >= 0
    safe_U = jnp.where(valid_U, ids_U, 0)
    proven_U = valid_U & ~hit_U & (uses_E[safe_U] >= after) & (after >= 0)
    other_U = valid_U & ~hit_U & ~proven_U
    room = jnp.maximum(jnp.asarray(n_free if after >= 0 else 0, jnp.int32) - jnp.sum(proven_U).astype(jnp.int32), 0)
    promote_U = (valid_U & hit_U) | proven_U | (other_U & (jnp.cumsum(other_U) <= room))
    cold_U = valid_U & ~promote_U
    E = uses_E.shape[0]
    uses_E = uses_E.at[jnp.where(cold_U, safe_U, E)].add(1, mode="drop")
    # an expert admitted starts over: once evicted, it proves itself again before it comes back
    return uses_E.at[jnp.where(promote_U & ~hit_U, safe_U, E)].set(0, mode="drop"), promote_U


# --- shared helpers ----------------------------------------------------------------------------------

def _touch(last_use_X: jax.Array, plan: Plan, clock: jax.Array) -> jax.Array:
    """Stamp the slots used by this access with `clock` (the post-access clock, as LRU does)."""
    return last_use_X.at[used_slots(plan, last_use_X.shape[0])].set(clock, mode="drop")


def _owner_values(state: CacheState, values_LE: jax.Array) -> jax.Array:
    """values_LE gathered at each slot's owner (garbage for free slots: admit overrides their score)."""
    g = jnp.maximum(state.owner_X, 0)
    return values_LE[g // state.n_experts, g % state.n_experts]


def _age_S(state: CacheState) -> jax.Array:
    # int32 difference first: exact in float32 for the last 2^24 accesses and correct across clock wrap
    return state.meta["last_use_X"] - state.clock


def _layer_rows(state: CacheState, layer, ids_U: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter indices (layer, expert) for the valid requested ids; padding points out of range."""
    valid = ids_U >= 0
    L = state.slot_map_LE.shape[0]
    return jnp.where(valid, layer, L), jnp.where(valid, ids_U, 0)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named (init, access) pair. Policies are compared by name inside jit caches, so a policy with
    parameters must put them in its name."""

    name: str
    init: Callable[[int, int, int], CacheState]
    access: Callable[[CacheState, Any, jax.Array], tuple[CacheState, Plan]]

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and other.name == self.name


# --- LRU ---------------------------------------------------------------------------------------------

def lru_init(n_slots: int, n_layers: int, n_experts: int) -> CacheState:
    return CacheState.empty(n_slots, n_layers, n_experts, last_use_X=jnp.full((n_slots,), -1, jnp.int32),
                            last_pos_X=jnp.zeros((n_slots,), jnp.int32))


def lru_access(state: CacheState, layer, ids_U: jax.Array) -> tuple[CacheState, Plan]:
    """Evict the least recently used. Experts used by the same access are ordered by their position in
    that request (earlier = older), as an OrderedDict LRU touching them in order would: the order is then
    independent of where experts happen to sit, and a pure-Python reference reproduces it exactly."""
    state, plan = admit(state, layer, ids_U, _age_S(state), state.meta["last_pos_X"])
    idx_U = used_slots(plan, state.owner_X.shape[0])
    last = state.meta["last_use_X"].at[idx_U].set(state.clock, mode="drop")
    pos = state.meta["last_pos_X"].at[idx_U].set(jnp.arange(ids_U.shape[0], dtype=jnp.int32), mode="drop")
    return dataclasses.replace(state, meta={**state.meta, "last_use_X": last, "last_pos_X": pos}), plan


LRU = Policy("lru", lru_init, lru_access)


# --- LFU ---------------------------------------------------------------------------------------------

def lfu_init(n_slots: int, n_layers: int, n_experts: int) -> CacheState:
    return CacheState.empty(n_slots, n_layers, n_experts, count_LE=jnp.zeros((n_layers, n_experts), jnp.int32),
                            last_use_X=jnp.full((n_slots,), -1, jnp.int32))


def lfu_access(state: CacheState, layer, ids_U: jax.Array) -> tuple[CacheState, Plan]:
    """Evict the lowest use count; counts live per (layer, expert), so an evicted expert keeps its
    history (in-cache LFU forgets it and then thrashes between newcomers). Ties: least recently used."""
    clock = state.clock
    state, plan = admit(state, layer, ids_U, _owner_values(state, state.meta["count_LE"]), _age_S(state))
    count = state.meta["count_LE"].at[_layer_rows(state, layer, ids_U)].add(1, mode="drop")
    last = _touch(state.meta["last_use_X"], plan, clock + 1)
    return dataclasses.replace(state, meta={**state.meta, "count_LE": count, "last_use_X": last}), plan


LFU = Policy("lfu", lfu_init, lfu_access)


# --- LRFU --------------------------------------------------------------------------------------------
# Lee et al.'s combined recency and frequency: CRF <- CRF * 2^(-lam * age) + 1 on each use. Kept as
# log2(CRF) at the last use, so the current value is log_crf - lam * age: no overflow for lam = 0
# (CRF = count) and no underflow to 0 for old experts (which would tie them all). Time is counted in
# visits of the expert's own layer (one per token in decode), not in accesses of the whole cache, so lam
# means the same per token whether the cache serves one layer or all of them.

# lam picked on the shared granite trace (notebooks/cache_policies.ipynb): mean hit rate over 9..28 of
# 32 slots per layer, shared and per-layer caches, is flat for lam in 0.05..0.08 (78.5%; 0.02: 77.9%,
# 0.15: 78.2%, LFU 76.6%, lam = 1: 76.0%, LRU 73.6%). 0.06 is a CRF half-life of ~17 tokens. One small
# model and 304 tokens: re-tune on a trace of the model being served.
LRFU_DEFAULT_LAM = 0.06


def lrfu_init(n_slots: int, n_layers: int, n_experts: int) -> CacheState:
    return CacheState.empty(
        n_slots, n_layers, n_experts,
        log_crf_LE=jnp.full((n_layers, n_experts), -jnp.inf, jnp.float32),  # log2 CRF at last use; CRF 0
        last_LE=jnp.zeros((n_layers, n_experts), jnp.int32),  # layer visit count at last use
        visits_L=jnp.zeros((n_layers,), jnp.int32),  # visits of each layer so far
        last_use_X=jnp.full((n_slots,), -1, jnp.int32))


def _lrfu_access(lam: float, state: CacheState, layer, ids_U: jax.Array) -> tuple[CacheState, Plan]:
    m = state.meta
    age_LE = m["visits_L"][:, None] - m["last_LE"]
    cur_LE = m["log_crf_LE"] - jnp.float32(lam) * age_LE.astype(jnp.float32)
    clock = state.clock
    state, plan = admit(state, layer, ids_U, _owner_values(state, cur_LE), _age_S(state))
    rows = _layer_rows(state, layer, ids_U)
    log_crf = m["log_crf_LE"].at[rows].set(jnp.logaddexp2(cur_LE[layer, rows[1]], 0.0),
                                           mode="drop")
    last = m["last_LE"].at[rows].set(m["visits_L"][layer], mode="drop")
    visits = m["visits_L"].at[layer].add(1)
    meta = {**m, "log_crf_LE": log_crf, "last_LE": last, "visits_L": visits,
            "last_use_X": _touch(m["last_use_X"], plan, clock + 1)}
    return dataclasses.replace(state, meta=meta), plan


@functools.lru_cache(maxsize=None)
def lrfu_policy(lam: float) -> Policy:
    """LRFU with decay lam per layer visit: 0 is LFU (served by the exact integer LFU, since log2 of a
    huge count stops moving in float32), larger is more recency-driven; 1 is already LRU-like for any
    expert used at most once per token. Cached so one lam gives one access function (one jit entry)."""
    lam = float(lam)
    if not (lam >= 0.0 and math.isfinite(lam)):
        from strata_jax.core.errors import ConfigError

        raise ConfigError(f"LRFU lambda must be a finite number >= 0, got {lam!r}")
    name = f"lrfu({lam:g})"
    if lam == 0.0:
        return Policy(name, lfu_init, lfu_access)
    return Policy(name, lrfu_init, functools.partial(_lrfu_access, lam))


# --- static (profile-seeded) -------------------------------------------------------------------------

def usage_profile(trace_TLk, n_layers: int, n_experts: int) -> np.ndarray:
    """float32 [L, E]: how many tokens routed to each (layer, expert) in a trace [tokens, layers, k]
    (-1 padding ignored, an expert counted once per token and layer). Save it with np.save."""
    t = np.asarray(trace_TLk)
    if t.ndim != 3 or t.shape[1] != n_layers:
        raise ValueError(f"trace shape {t.shape} is not [tokens, {n_layers}, k]")
    if t.size and (t.max() >= n_experts or t.min() < -1):
        raise ValueError(f"trace has expert ids outside [-1, {n_experts})")
    first = np.ones(t.shape, bool)  # count duplicates within a (token, layer) row once
    for j in range(1, t.shape[2]):
        first[..., j] = ~np.any(t[..., :j] == t[..., j:j + 1], axis=-1)
    keep = first & (t >= 0)
    layer_TLk = np.broadcast_to(np.arange(n_layers)[None, :, None], t.shape)
    prof = np.zeros((n_layers, n_experts), np.float64)
    np.add.at(prof, (layer_TLk[keep], t[keep]), 1.0)
    return prof.astype(np.float32)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:10]


def static_access(state: CacheState, layer, ids_U: jax.Array) -> tuple[CacheState, Plan]:
    clock = state.clock
    state, plan = admit(state, layer, ids_U, _owner_values(state, state.meta["profile_LE"]), _age_S(state))
    last = _touch(state.meta["last_use_X"], plan, clock + 1)
    return dataclasses.replace(state, meta={**state.meta, "last_use_X": last}), plan


def static_policy(profile_LE, name: str | None = None) -> Policy:
    """Evict the expert with the lowest saved usage (`profile_LE`, counts or frequencies per layer and
    expert, e.g. from `usage_profile`; ties: least recently used). The profile's hot set stays resident
    and the remaining slots churn among the cold experts. The profile must cover the cache's layers
    exactly: [n_layers, n_experts] of the cache that init builds, or of the whole model when the slot
    table splits layers into several pools (init then receives the pool's `layers` and takes their rows)."""
    prof = np.asarray(profile_LE, np.float32)
    if prof.ndim != 2 or not np.all(np.isfinite(prof)):
        raise ValueError(f"profile must be a finite [layers, experts] array, got shape {prof.shape}")
    name = name or f"static({_digest(prof)})"

    def init(n_slots: int, n_layers: int, n_experts: int, layers: tuple[int, ...] | None = None) -> CacheState:
        p = prof
        if layers is not None and p.shape[0] != n_layers and p.shape[0] > max(layers, default=-1):
            p = p[list(layers)]  # a whole-model profile, this pool's layers
        if p.shape != (n_layers, n_experts):
            raise ValueError(f"static profile has shape {prof.shape} but the cache holds {n_layers} layers "
                             f"of {n_experts} experts")
        return CacheState.empty(n_slots, n_layers, n_experts, profile_LE=jnp.asarray(p),
                                last_use_X=jnp.full((n_slots,), -1, jnp.int32))

    return Policy(name, init, static_access)


# --- Belady (offline optimum, simulator only) --------------------------------------------------------

NEVER = 2 ** 30  # next use of an expert that is not used again: finite, so admit's +inf stays "protected"


def belady_next_use(trace_TLk) -> tuple[np.ndarray, np.ndarray]:
    """int32 ids_Ack, next_Ack for the accesses of a trace in simulator order (a = token * L + layer):
    ids_Ack[a] are the routed ids (-1 padding) and next_Ack[a, j] the access index at which the expert
    ids_Ack[a, j] of that layer is next requested (NEVER if it is not)."""
    t = np.asarray(trace_TLk, np.int64)
    T, L, K = t.shape
    E = int(t.max()) + 1 if t.size else 1
    next_LE = np.full((L, E + 1), NEVER, np.int64)  # column E absorbs -1 padding
    next_TLk = np.empty((T, L, K), np.int64)
    col_TLk = np.where(t >= 0, t, E)
    rows_Lk = np.arange(L)[:, None]
    for tok in range(T - 1, -1, -1):
        next_TLk[tok] = next_LE[rows_Lk, col_TLk[tok]]
        next_LE[rows_Lk, col_TLk[tok]] = tok * L + np.arange(L)[:, None]
        next_LE[:, E] = NEVER
    next_TLk = np.where(t >= 0, next_TLk, NEVER)
    return t.reshape(T * L, K).astype(np.int32), next_TLk.reshape(T * L, K).astype(np.int32)


def belady_init(n_slots: int, n_layers: int, n_experts: int, ids_Ack: np.ndarray, next_Ack: np.ndarray
                ) -> CacheState:
    return CacheState.empty(n_slots, n_layers, n_experts, ids_Ack=jnp.asarray(ids_Ack),
                            next_Ack=jnp.asarray(next_Ack), next_use_X=jnp.full((n_slots,), NEVER, jnp.int32))


def belady_access(state: CacheState, layer, ids_U: jax.Array) -> tuple[CacheState, Plan]:
    """Evict the resident expert whose next request is farthest away. Access number `state.clock` must be
    row `clock` of the trace the meta was built from (token-major, then layer); `layer` is not checked."""
    m = state.meta
    A = m["ids_Ack"].shape[0]
    a = jnp.minimum(state.clock, A - 1)
    match_Uk = (ids_U[:, None] == m["ids_Ack"][a][None, :]) & (ids_U >= 0)[:, None] & (state.clock < A)
    next_U = jnp.where(jnp.any(match_Uk, axis=1), m["next_Ack"][a][jnp.argmax(match_Uk, axis=1)], NEVER)
    score = (state.clock - m["next_use_X"]).astype(jnp.float32)  # farthest next use = lowest score
    state, plan = admit(state, layer, ids_U, score)
    nxt = m["next_use_X"].at[used_slots(plan, m["next_use_X"].shape[0])].set(next_U, mode="drop")
    return dataclasses.replace(state, meta={**m, "next_use_X": nxt}), plan


def belady_policy(trace_TLk, name: str | None = None) -> Policy:
    """Belady's MIN, offline: the next-use time of every access is precomputed from `trace_TLk`. Usable
    only in the simulator (strata_jax.offload.simulate), replaying exactly that trace from an empty cache
    in its access order (token-major, then layer) with one access per (token, layer); the engine cannot
    know the future. It bounds what any policy can reach at a given cache size."""
    ids_Ack, next_Ack = belady_next_use(trace_TLk)
    name = name or f"belady({_digest(ids_Ack)})"
    return Policy(name, functools.partial(belady_init, ids_Ack=ids_Ack, next_Ack=next_Ack), belady_access)


# --- registry ----------------------------------------------------------------------------------------

LRFU = dataclasses.replace(lrfu_policy(LRFU_DEFAULT_LAM), name="lrfu")

POLICIES: dict[str, Policy] = {"lru": LRU, "lfu": LFU, "lrfu": LRFU}

_LRFU_NAME = re.compile(r"^\s*lrfu\s*\(\s*([0-9.eE+-]+)\s*\)\s*$")


def _static_from_file(path: str) -> Policy:
    """static_policy from a .npy file: a usage profile [layers, experts] or a routing trace
    [tokens, layers, k] (Model.routing_trace(), saved with np.save), counted into a profile."""
    from strata_jax.core.errors import ConfigError

    try:
        arr = np.load(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the static policy's profile {path!r} ({e}); save a [layers, experts] "
                          "profile or a [tokens, layers, k] routing trace with numpy.save") from None
    if arr.ndim == 3:
        arr = usage_profile(arr, arr.shape[1], int(arr.max()) + 1 if arr.size else 1)
    if arr.ndim != 2:
        raise ConfigError(f"{path!r} holds an array of shape {arr.shape}: expected a [layers, experts] profile "
                          "or a [tokens, layers, k] routing trace")
    return static_policy(arr)


def get_policy(policy: str | Policy) -> Policy:
    """A Policy, a registered name ("lru", "lfu", "lrfu"), "lrfu(<lam>)", or "static:<file.npy>" (a saved
    usage profile or routing trace). Belady needs the future: build it with belady_policy(trace)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy in POLICIES:
            return POLICIES[policy]
        if policy.startswith("static:"):
            return _static_from_file(policy[len("static:"):])
        m = _LRFU_NAME.match(policy)
        if m:
            try:
                return lrfu_policy(float(m.group(1)))
            except ValueError:
                pass
    from strata_jax.core.errors import ConfigError

    hint = ""
    if isinstance(policy, str) and policy.split("(")[0].strip() in ("belady", "static"):
        hint = f"; {policy!r} needs data: use belady_policy(trace) or static_policy(profile)"
    raise ConfigError(f"unknown cache policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}, "
                      f"lrfu(<lambda>), or pass a strata_jax.offload.policies.Policy{hint}") from None
