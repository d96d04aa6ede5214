"""A warm expert cache across restarts: the slot table's cache states (which expert sits in which slot,
the policy's metadata) saved with orbax and, at the next load of the same model with the same slot
plan and policy, restored, each pool's slots refilled from the host store. The first requests then
hit as the previous run's last ones did instead of missing on every expert while the cache warms.

PATH is a directory in which orbax's CheckpointManager keeps one step: a save writes the next step (in
a temporary directory renamed when complete) and only then deletes the older one, so a crash mid-save
leaves the previous state. Counters are not saved: telemetry starts at zero.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.core.experts import ExpertRows
from strata_jax.offload.fetch import fetch_misses
from strata_jax.offload.policies import CacheState, Plan
from strata_jax.offload.slot_table import SlotTable
from strata_jax.offload.store import ExpertStore

log = logging.getLogger("strata_jax")

FORMAT = 2  # of the saved record (2: pools of blocks, SlotTable.block); a state of another format is ignored


def cache_identity(gguf, n_experts: int, table: SlotTable, policy_name: str) -> dict[str, Any]:
    """What a saved state must match to be restored: the model file (name, size, header fingerprint),
    its experts, the slot plan (pool of each MoE layer, slots per pool) and the policy."""
    return {"format": FORMAT, "model": os.path.basename(gguf.path), "file_size": int(gguf.file_size),
            "fingerprint": gguf.fingerprint(), "n_experts": int(n_experts), "moe_layers": len(table.layer_pool),
            "layer_pool": list(table.layer_pool), "slots_per_pool": [int(p.n_rows) for p in table.pools],
            "block": [int(b) for b in table.block],
            "policy": policy_name}


def _manager(path: str, create: bool):
    import orbax.checkpoint as ocp  # noqa: PLC0415 - only loads that keep a state pay its import

    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        max_to_keep=1, create=create, enable_async_checkpointing=False))


def save_cache_state(path: str, caches: tuple[CacheState, ...], identity: dict[str, Any]) -> None:
    """Write the cache states and the identity (with the time of saving) as PATH's next step."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    mgr = _manager(path, create=True)
    latest = mgr.latest_step()
    saved = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    mgr.save(0 if latest is None else latest + 1, args=ocp.args.Composite(
        caches=ocp.args.StandardSave(caches), meta=ocp.args.JsonSave({**identity, "saved": saved})))
    mgr.wait_until_finished()
    mgr.close()
    n_slots = sum(int(c.owner_X.size) for c in caches)
    log.info("expert cache: saved the state of %s slots to %s", f"{n_slots:,}", path)


def _mismatch(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why a state saved with `saved` does not fit this load (None: it does)."""
    what = {"format": "state format", "model": "model file", "file_size": "model file", "fingerprint": "model file",
            "n_experts": "model", "moe_layers": "model", "layer_pool": "slot plan (--expert-pools, --layer-scan)",
            "slots_per_pool": "slot plan (--expert-slots, --vram-budget)",
            "block": "slot plan (--expert-pools, --layer-scan)", "policy": "policy (--policy)"}
    for key, label in what.items():
        if saved.get(key) != now[key]:
            return f"it was saved for another {label}: {key} {saved.get(key)!r}, this load {now[key]!r}"
    return None


def load_cache_state(path: str, template: tuple[CacheState, ...],
                     identity: dict[str, Any]) -> tuple[tuple[CacheState, ...], str] | None:
    """The cache states saved in PATH and when they were saved, if they match `identity` (and have the
    shapes of `template`, this load's empty states); else None, with a log line saying why. Never
    raises: a state that cannot be read means a cold start, not a failed load."""
    if not os.path.isdir(path):
        log.info("expert cache: no saved state in %s yet; starting cold (it is saved on exit)", path)
        return None
    mgr = None
    try:
        import orbax.checkpoint as ocp  # noqa: PLC0415

        mgr = _manager(path, create=False)
        step = mgr.latest_step()
        if step is None:
            log.warning("expert cache: %s holds no saved state; starting cold", path)
            return None
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        why = _mismatch(meta, identity) if isinstance(meta, dict) else "its metadata is not a record"
        if why is not None:
            log.warning("expert cache: the state in %s is ignored, %s; starting cold", path, why)
            return None
        caches = mgr.restore(step, args=ocp.args.Composite(caches=ocp.args.StandardRestore(template))).caches
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
        if jax.tree.structure(caches) != jax.tree.structure(template) or shapes(caches) != shapes(template):
            log.warning("expert cache: the state in %s is ignored, its arrays do not have this cache's shapes; "
                        "starting cold", path)
            return None
        return tuple(caches), str(meta.get("saved", "at an unknown time"))
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign directory: start cold, say why
        log.warning("expert cache: cannot read the state in %s (%s: %s); starting cold", path, type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "")
        return None
    finally:
        if mgr is not None:
            mgr.close()


def restore_slot_table(path: str, got: tuple, table: SlotTable, store: ExpertStore) -> SlotTable:
    """`table` (empty, just built) with the states load_cache_state read from PATH (`got`) and every
    owned slot refilled from the store."""
    caches, saved = got
    table = table.replace(caches=caches)
    table = fill_pools(table, store)
    owned = sum(int(jnp.sum(c.owner_X >= 0)) for c in caches)
    log.info("expert cache: restored %s of %s slots from %s (saved %s)", f"{owned:,}", f"{table.n_slots:,}", path,
             saved)
    return table


def fill_pools(table: SlotTable, store: ExpertStore) -> SlotTable:
    """Each pool's slots loaded with their owners' rows from the store: one jitted program per pool."""
    pools = []
    for p, (pool, cache) in enumerate(zip(table.pools, table.caches)):
        # the pool's MoE layers in layer_local order
        layers = tuple(i for i, q in enumerate(table.layer_pool) if q == p)
        pools.append(_fill_pool(pool, cache.owner_X, store, layers))
    return table.replace(pools=tuple(pools))


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _fill_pool(pool: ExpertRows, owner_X: jax.Array, store: ExpertStore, layers: tuple[int, ...]) -> ExpertRows:
    # each layer's owned slots as the misses of one access: fetch_misses' loop, one copy per slot. A
    # shared pool's owners are global ids (local layer * E + expert); a pool of blocks has a row of owners
    # per layer, [layers, block], each the layer's own expert ids
    E = store.shape(store.layer_group[layers[0]])[1]
    for j, moe_idx in enumerate(layers):
        if owner_X.ndim == 2:
            own_X, base, mine_X = owner_X[j], j * owner_X.shape[1], owner_X[j] >= 0
        else:
            own_X, base, mine_X = owner_X, 0, (owner_X >= 0) & (owner_X // E == j)
        slot_X = jnp.arange(own_X.shape[0], dtype=jnp.int32)
        pool = fetch_misses(pool, store, moe_idx, Plan(jnp.where(mine_X, own_X % E, -1), slot_X, mine_X,
                                                    jnp.full_like(slot_X, -1)), base=base)
    return pool
