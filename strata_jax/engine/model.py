"""`load()` and `Model`: the Python API around the jitted programs.

A Model owns what does not change between requests: the weights, the tokenizer, the expert cache
(offload manager) and the telemetry. Generation runs in a Session (engine/session.py): `generate` and
`generate_stream` use a one-row session the model keeps; `serve --parallel N` one of N rows.

Shape legend: strata_jax/core/shapes.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import runtime
from strata_jax.core import cards, hostrows
from strata_jax.core.paths import cache_dir
from strata_jax.engine.config import AUTO_PREFILL_MAX, MIN_PREFILL_CHUNK, PLE_DEVICE_MAX, EngineConfig
from strata_jax.engine.constrained import request_grammar
from strata_jax.engine.convcache import ConversationCache, DiskTier, HostTier, identity
from strata_jax.engine.draft import DraftModel, draft_path
from strata_jax.engine.session import HostTiming, Session
from strata_jax.engine.streaming import Generation, GenerationChunk, TokenLogprob  # noqa: F401
from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import ExpertCounters, ExpertSpec
from strata_jax.model.config import ModelConfig, with_rope_scaling
from strata_jax.model.forward import KVCache
from strata_jax.gguf.reader import GGUFFile, check_vocabulary
from strata_jax.core.units import fmt_bytes, parse_size
from strata_jax.model.memory import (activation_bytes, dense_weight_bytes, fixed_device_bytes, kv_cache_bytes,
                                     kv_label, mtp_bytes, routed_expert_bytes)
from strata_jax.gguf.tokenizer import GGUFTokenizer
from strata_jax.model import mtp, runs
from strata_jax.model.weights import WeightLoader, expert_spec, load_params
from strata_jax.offload.manager import OffloadManager, expert_floor_bytes, plan_model_cache
from strata_jax.offload.provider import SlotExperts
from strata_jax.offload.slot_table import resident_slot_table
from strata_jax.offload.sizing import ContextPlan, describe_context, device_free_bytes, plan_context

log = logging.getLogger("strata_jax")


FIM_WINDOW = 2048  # tokens of prefix and suffix an infill prompt keeps at most: llama.cpp's default batch (n_batch)
PLE_TABLE_NAME = "per_layer_token_embd.weight"  # model/layers/ple.py's TABLE_NAME (imported only for qwen4exp)


def ple_surely_host(choice: str, gguf: GGUFFile, cfg: ModelConfig) -> bool:
    """Whether the PLE table goes to host memory whatever the expert cache holds (what sizing the context
    can count on before the cache is planned)."""
    if cfg.ple is None or not gguf.has(PLE_TABLE_NAME):
        return False
    return choice == "host" or (choice == "auto" and gguf.tensor(PLE_TABLE_NAME).nbytes > PLE_DEVICE_MAX)


def ple_placement(choice: str, gguf: GGUFFile, cfg: ModelConfig, spec, fixed_bytes: int, *, expert_pools: str,
                  parallel: int, expert_slots: int | None, vram_budget, vram_reserve,
                  free_bytes: int | None) -> tuple[str | None, str]:
    """Where qwen4exp's PLE table goes ("device" or "host"; None: the model has none) and why; what load
    does and `inspect`/`check` predict. auto: host when the expert cache would not hold every expert with
    the table on the device (its gathers then cost a few rows a token while an expert miss costs MBs) or
    when the table is large. fixed_bytes: the device's fixed bytes with the table on it."""
    if cfg.ple is None or not gguf.has(PLE_TABLE_NAME):
        return None, "no PLE table"
    if choice != "auto":
        return choice, "ple_table=" + choice
    if ple_surely_host(choice, gguf, cfg):
        return "host", f"auto: over {PLE_DEVICE_MAX / 2**30:.0f} GiB"
    if spec is None:
        return "device", "auto: a dense model"
    try:
        resident = plan_model_cache(spec, fixed_bytes=fixed_bytes, expert_pools=expert_pools, batch_rows=parallel,
                                    expert_slots=expert_slots, vram_budget=vram_budget, vram_reserve=vram_reserve,
                                    free_bytes=free_bytes).resident
    except ConfigError:  # not even the fewest expert slots fit beside it: in host memory it may still work
        return "host", "auto: on the device it leaves no room for the expert cache"
    if not resident:
        return "host", "auto: the experts are offloaded"
    return "device", "auto: it fits beside every expert"


def _conversation_cache(config: EngineConfig, gguf: GGUFFile, cfg: ModelConfig, ctx: int, dtype) \
        -> ConversationCache | None:
    """The conversation cache's tiers the config asks for (engine/convcache.py), or None."""
    ram = HostTier(config.conversation_cache_mib << 20) if config.conversation_cache_mib else None
    disk = None
    if config.conversation_cache_dir is not None:
        mtp_on = config.spec == "mtp"  # the MTP block's cache travels with the row's (model/mtp.py)
        ident = identity(gguf.fingerprint(), kv=config.kv, dtype=jnp.dtype(dtype).name, rope=[
            config.rope_scaling, config.rope_scale, config.yarn_orig_ctx], **({"mtp": True} if mtp_on else {}))
        row = jax.eval_shape(lambda: KVCache.zeros(cfg, 1, ctx, dtype, kv=config.kv).replace(
            mtp=mtp.state_zeros(cfg, 1, ctx, dtype, config.kv) if mtp_on else None))
        disk = DiskTier(config.conversation_cache_dir, config.conversation_cache_disk_mib << 20, ident, row)
    return ConversationCache(ram, disk) if ram is not None or disk is not None else None


def _ple_placement(config: EngineConfig, gguf: GGUFFile, cfg: ModelConfig, spec, fixed_bytes: int,
                   device) -> str | None:
    """ple_placement for this load, logged."""
    where, why = ple_placement(config.ple_table, gguf, cfg, spec, fixed_bytes, expert_pools=config.expert_pools,
                               parallel=config.parallel, expert_slots=config.expert_slots,
                               vram_budget=config.vram_budget, vram_reserve=config.vram_reserve,
                               free_bytes=device_free_bytes(device))
    if where is not None:
        log.info("PLE table: %.2f GB in %s (%s)", gguf.tensor(PLE_TABLE_NAME).nbytes / 1e9,
                 "pinned host memory, rows gathered there" if where == "host" else "device memory", why)
    return where


def _device_bytes(tree: Any) -> int:
    """Bytes of a pytree's arrays that live in device memory (not the ones placed in pinned host memory)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) != "pinned_host")


def plan_model_context(gguf, cfg, spec: ExpertSpec | None, *, ctx: int | None, kv: str, itemsize: int, rows: int,
                       prefill_chunk: int, expert_pools: str = "per-layer", expert_slots: int | None = None,
                       vram_budget: int | str | None = None, vram_reserve: int | str | None = None,
                       free_bytes: int | None = None, off_device: tuple[str, ...] = (),
                       dense_itemsize: int | None = None, mtp: bool = False,
                       kv_resident: int | None = None, subchunk: int = 0) -> ContextPlan:
    """The context load allocates for a model (ctx, or the trained length), checked against the budget
    beside its dense weights (but off_device; dequantized to dense_itemsize bytes a value, or None: in
    their blocks), activations and the fewest expert slots a step needs (spec: its experts' layout, None
    for a dense model), and with mtp (--spec mtp) the MTP block's KV layer and resident experts
    (memory.mtp_bytes): what load and `strata-jax inspect` both use. kv_resident (--kv-resident): the
    device holds that many positions of the KV cache whatever the context (the rest is host memory)."""
    floor = 0.0
    if spec is not None:
        floor = expert_floor_bytes(spec, expert_pools=expert_pools, batch_rows=rows, expert_slots=expert_slots)
    kv_position = kv_cache_bytes(cfg, 1, rows, itemsize, kv)
    layer = routed_expert_bytes(gguf, cfg) // max(len(cfg.moe_layers), 1) if subchunk else 0
    other = dense_weight_bytes(gguf, off_device, dense_itemsize) + activation_bytes(cfg, prefill_chunk, subchunk, layer)
    mtp_position = kv_position // max(cfg.n_kv_layers, 1) if mtp else 0  # the MTP block's cache is not streamed
    if mtp:
        other += mtp_bytes(gguf, cfg, 0, rows, itemsize, kv)
    if kv_resident is not None:
        other += kv_position * kv_resident
        kv_position = 0
    kv_position += mtp_position
    return plan_context(
        requested=ctx, trained=cfg.context_length, kv_bytes_per_position=kv_position,
        other_bytes=other,
        expert_bytes=floor,
        vram_budget=vram_budget, vram_reserve=vram_reserve, free_bytes=free_bytes)


def resolve_prefill_chunk(value: int | str, cfg: ModelConfig, *, ctx: int | None, budget: int | None,
                          plan: Callable[[int], ContextPlan]) -> int:
    """prefill_chunk "auto" (a number stays as it is): 512 (or the context, if shorter), or longer: the
    longest power of two up to AUTO_PREFILL_MAX and the context whose activation bound takes at most 1/8 of
    `budget` (vram_budget, else the free device memory) and with which the model still plans the context
    it plans at 512 (`plan`: the context plan at a chunk; it raises ConfigError where nothing fits).
    Longer chunks stream an offloaded model's experts fewer times per prompt; their activations come out
    of the expert cache. 512 where no memory figure is known (CPU) or where 512 does not fit (the planner
    then says why)."""
    if value != "auto":
        return int(value)
    ctx = ctx or cfg.context_length

    def capped(c: int) -> int:  # no chunk past the context
        while c > MIN_PREFILL_CHUNK and c // 2 >= ctx:
            c //= 2
        return c

    chunk = capped(512)
    if budget is not None:
        top = MIN_PREFILL_CHUNK
        while top * 2 <= AUTO_PREFILL_MAX and activation_bytes(cfg, top * 2) <= budget // 8:
            top *= 2
        try:
            want = plan(chunk).ctx if capped(top) > chunk else None
        except ConfigError:
            want = None
        c = capped(top)
        while want is not None and c > chunk:
            try:
                if plan(c).ctx >= want:
                    chunk = c
                    break
            except ConfigError:
                pass
            c //= 2
    log.info("prefill chunk: %d tokens (auto: activations %s of %s)", chunk, fmt_bytes(activation_bytes(cfg, chunk)),
             fmt_bytes(budget) if budget is not None else "an unknown memory size")
    return chunk


def _plan_context(config: EngineConfig, gguf: GGUFFile, cfg: ModelConfig, spec, itemsize: int, device) -> ContextPlan:
    """The context load allocates (plan_model_context); a PLE table surely kept in host memory is not counted."""
    ple_host = ple_surely_host(config.ple_table, gguf, cfg)
    return plan_model_context(gguf, cfg, spec, ctx=config.ctx, kv=config.kv, itemsize=itemsize, rows=config.parallel,
                              prefill_chunk=config.prefill_chunk, expert_pools=config.expert_pools,
                              expert_slots=config.expert_slots, vram_budget=config.vram_budget,
                              vram_reserve=config.vram_reserve, free_bytes=device_free_bytes(device),
                              off_device=(PLE_TABLE_NAME,) if ple_host else (),
                              dense_itemsize=itemsize if config.dequantize_dense else None,
                              mtp=config.spec == "mtp", kv_resident=config.kv_resident,
                              subchunk=config.kernels.prefill_subchunk)


def _with_rope_override(cfg: ModelConfig, config: EngineConfig) -> ModelConfig:
    """cfg with the config's rope_scaling / rope_scale / yarn_orig_ctx over the file's, logged."""
    scaled = with_rope_scaling(cfg, config.rope_scaling, config.rope_scale, config.yarn_orig_ctx)
    if scaled is cfg:
        return cfg
    cfg, r = scaled, scaled.rope_scaling
    log.info("rope scaling: %s", "none (the file's scaling off)" if r is None else
             f"{r.kind} x{r.factor:g}" + (f" of an original {r.orig_ctx:,}-token context" if r.orig_ctx else "")
             + f": the model's context is {cfg.context_length:,}")
    return cfg


def _check_mtp(gguf: GGUFFile, cfg: ModelConfig) -> None:
    """--spec mtp: a ConfigError, before any weight loads, where the file has no MTP block to draft with."""
    if not (cfg.n_nextn_layers and gguf.has(f"blk.{cfg.n_layers}.nextn.eh_proj.weight")):
        raise ConfigError(f"--spec mtp: {os.path.basename(gguf.path)} has no MTP (nextn) block"
                          + ("" if cfg.n_nextn_layers else f" ({cfg.arch} files carry none)")
                          + ". Use --spec lookup, or --spec draft:PATH with a small model of the same vocabulary.")


def _with_mtp_experts(params, gguf: GGUFFile, loader: WeightLoader, device):
    """params with the MTP block's routed experts resident in a provider of their own (--spec mtp:
    model/mtp.py); device: a device, or every card's (replicated: the block is one layer)."""
    cfg = loader.cfg
    nx = params.nextn[0]
    if nx.block.moe is None:
        return params
    layer = cfg.n_layers  # the MTP block's index in the file
    spec = expert_spec(loader, (layer,))
    provider = SlotExperts(jax.device_put(resident_slot_table(gguf, spec, device), device), None,
                           jax.device_put(ExpertCounters.zeros(1), device), None, 0)
    log.info("speculative decoding: MTP block %d, its %d experts resident (%s)", layer, cfg.n_experts,
             fmt_bytes(spec.bytes_per_expert(0) * cfg.n_experts))
    return params.replace(nextn=(nx.replace(experts=provider),) + tuple(params.nextn[1:]))


def _layer_runs(params, cfg: ModelConfig, experts: OffloadManager | None, choice: str) -> tuple | None:
    """The runs of alike layers to scan (model/runs.py), or None when scanning is off. Besides the params,
    alike layers share what the forward pass reads of them statically: the sliding window; in the hybrid
    family the layer kind and the QSA compress ratio; the expert pool. A PLE layer starts a run: the
    forward pass runs its PLE before the run (no scanned body has it)."""
    if choice == "off":
        return None
    moe = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    ple_layers = cfg.ple.layers if cfg.ple is not None else ()

    def static(i: int) -> tuple:
        pool = experts.layer_key(moe[i]) if i in moe and experts is not None else None
        qsa = cfg.qsa[i] if cfg.qsa else None  # the layer's QSA dims: its compress ratio differs
        return i in cfg.swa_layers, cfg.kind(i), qsa, pool

    return runs.plan_runs([runs.signature(layer, static(i)) for i, layer in enumerate(params.layers)], starts=ple_layers)


def _cold_experts(path: str | None, gguf: GGUFFile, cfg: ModelConfig, spec: ExpertSpec,
                  device) -> tuple[GGUFFile, ExpertSpec] | None:
    """--cold-experts: the low-bit GGUF and its experts' layout, once it is checked to be the same model
    (architecture, shapes, expert count, vocabulary); only its experts are read."""
    if path is None:
        return None
    cold = GGUFFile(path)
    ccfg = ModelConfig.from_gguf(cold)
    for what, mine, theirs in (("architecture", ccfg.arch, cfg.arch), ("layer count", ccfg.n_layers, cfg.n_layers),
                               ("width", ccfg.d_model, cfg.d_model), ("expert count", ccfg.n_experts, cfg.n_experts),
                               ("experts per token", ccfg.n_experts_used, cfg.n_experts_used),
                               ("expert FFN width", ccfg.expert_ffn_dim, cfg.expert_ffn_dim),
                               ("MoE layers", tuple(ccfg.moe_layers), tuple(cfg.moe_layers))):
        if mine != theirs:
            raise ConfigError(f"--cold-experts {path}: its {what} is {mine}, the model's is {theirs}: give a "
                              "lower-bit quantization of the same model.")
    check_vocabulary(cold, gguf, path, "--cold-experts ", "so it is not the same model: give a lower-bit "
                     "quantization of the model itself.")
    cold_spec = expert_spec(WeightLoader(cold, ccfg, device))
    log.info("cold experts: %s, %s per expert against the model's %s, serve misses until promoted", path,
             fmt_bytes(cold_spec.bytes_per_expert(0)), fmt_bytes(spec.bytes_per_expert(0)))
    return cold, cold_spec


class Model:
    """A loaded model. Built by load(), which validates the EngineConfig before the file is opened."""

    def __init__(self, gguf: GGUFFile, config: EngineConfig | None = None, device: Any = None):
        t0 = time.perf_counter()
        self.gguf = gguf
        config = config or EngineConfig.create()
        cfg = _with_rope_override(ModelConfig.from_gguf(gguf), config)
        self.config = cfg
        self.devices = pick_devices(config.devices, device, moe=cfg.is_moe)
        self.device = self.devices[0]  # what is not split lives here too (and on every other card)
        # several cards split the expert cache (core/cards.py); arrays of the steps' state go to `placement`:
        # the device, or every card of the mesh
        self.cards = cards.mesh(self.devices) if len(self.devices) > 1 else None
        self.placement = self.device if self.cards is None else cards.replicated(self.cards)
        if self.cards is not None:
            _check_cards(config, cfg)
        config = config.check_model(cfg).resolved(self.device.platform)
        self.dtype = jnp.dtype(config.dtype).type
        if runtime.applied and self.device.platform == "gpu":
            log.info("XLA: %s (expert-miss loops run as CUDA graph nodes, no host sync per iteration; "
                     "STRATA_JAX_XLA_DEFAULTS=0 turns this off)", " ".join(f"{k}={v}" for k, v in runtime.applied.items()))
        dequantize_dense = config.dequantize_dense
        loader = WeightLoader(gguf, cfg, self.device, dequantize_dense=dequantize_dense, dense_dtype=self.dtype)
        spec = expert_spec(loader) if cfg.is_moe else None
        itemsize = jnp.dtype(self.dtype).itemsize
        # spec "draft:PATH": the draft model loads before anything of the target is planned, so that the
        # free device memory the target's context and expert cache plan from counts the draft
        self.drafter: Callable[[Sequence[int], int], list[int]] | None = None  # DraftModel, or use_drafter's
        if config.spec == "mtp":
            _check_mtp(gguf, cfg)
        if (path := draft_path(config.spec)) is not None:
            draft = GGUFFile(path)
            check_vocabulary(draft, gguf, path, "--spec draft:", "so its drafts would be other tokens. Pick a draft "
                             "model from the same family (the same tokenizer), or use --spec lookup.")
            self.drafter = DraftModel(Model(draft, EngineConfig.create(ctx=config.ctx, parallel=1), self.device))
        self.spec, self.spec_max = config.spec, config.spec_max  # the drafter's name; use_drafter changes them
        if config.prefill_chunk == "auto":
            budget = parse_size(config.vram_budget, "vram_budget") if config.vram_budget is not None else \
                device_free_bytes(self.device)
            chunk = resolve_prefill_chunk("auto", cfg, ctx=config.ctx, budget=budget, plan=lambda c: _plan_context(
                dataclasses.replace(config, prefill_chunk=c), gguf, cfg, spec, itemsize, self.device))
            config = dataclasses.replace(config, prefill_chunk=chunk)
        # the context first, from the header alone: one that cannot fit is refused before any weight loads
        self.context_plan = _plan_context(config, gguf, cfg, spec, itemsize, self.device)
        self.engine_config = config = dataclasses.replace(config, ctx=self.context_plan.ctx)
        self.ctx, self.prefill_chunk, self.decode_chunk = config.ctx, config.prefill_chunk, config.decode_chunk
        self.kv = config.kv
        # KV streaming: the positions of each layer's cache on the device (None: all of them)
        self.kv_resident = config.kv_resident if config.kv_resident is not None and config.kv_resident < self.ctx \
            else None
        if config.kv_resident is not None and self.kv_resident is None:
            log.info("kv_resident %d covers the whole context (%d): the KV cache stays on the device",
                     config.kv_resident, self.ctx)
        if self.kv_resident is not None and not hostrows.available(self.device):
            raise ConfigError(f"--kv-resident {self.kv_resident} streams the KV cache by the host-rows kernels, which "
                              f"are not available here ({hostrows.why_not(self.device)}): install a compiler (nvcc "
                              "on a GPU, g++ on a CPU), or keep the whole cache on the device.")
        self.kernels = config.kernels
        self.conversation_cache = _conversation_cache(config, gguf, cfg, self.ctx, self.dtype)  # shared by sessions
        self.tokenizer = GGUFTokenizer.from_metadata(gguf.metadata)

        def fixed(off_device: tuple[str, ...] = ()) -> int:
            # a server decoding `parallel` requests at once holds that many KV-cache rows (Session)
            return fixed_device_bytes(gguf, cfg, ctx=self.kv_resident or self.ctx, itemsize=itemsize,
                                      rows=config.parallel,
                                      prefill_chunk=config.prefill_chunk, off_device=off_device, kv=config.kv,
                                      dense_itemsize=itemsize if dequantize_dense else None,
                                      subchunk=config.kernels.prefill_subchunk) + (
                mtp_bytes(gguf, cfg, self.ctx, config.parallel, itemsize, config.kv) if config.spec == "mtp" else 0)

        self.ple_table = _ple_placement(config, gguf, cfg, spec, fixed(), self.device)
        self.params = load_params(loader, "pinned_host" if self.ple_table == "host" else "device")
        self._host_tables: list[Any] = []  # several cards: host tables the steps read by address, kept here
        if self.cards is not None:
            self.params = jax.device_put(self._addressed_tables(self.params), self.placement)
        self.dense_bytes = _device_bytes(self.params)
        self.experts: OffloadManager | None = None
        if cfg.is_moe:
            off_device = (PLE_TABLE_NAME,) if self.ple_table == "host" else ()
            self.experts = OffloadManager(gguf, spec, self.device, fixed_bytes=fixed(off_device),
                                          expert_slots=config.expert_slots, vram_budget=config.vram_budget,
                                          vram_reserve=config.vram_reserve, policy=config.policy,
                                          prefetch=config.prefetch, expert_pools=config.expert_pools,
                                          batch_rows=config.parallel, cache_state=config.expert_cache_state,
                                          stacked=config.layer_scan == "on", fetch=config.expert_fetch,
                                          cold=_cold_experts(config.cold_experts, gguf, cfg, spec, self.device),
                                          promote_after=config.promote_after, cards=self.cards)
            loader.bytes_loaded += self.experts.device_bytes
        if config.spec == "mtp":
            self.params = _with_mtp_experts(self.params, gguf, loader, self.placement)
        self.layer_runs = _layer_runs(self.params, cfg, self.experts, config.layer_scan)
        if self.layer_runs is not None:
            self.params = self.params.replace(layers=runs.stack_layers(self.params.layers, self.layer_runs, free=True))
            log.info("layers: %s", runs.describe(self.layer_runs))
        streamed = None
        if self.kv_resident is not None:
            kv_bytes = lambda n: kv_cache_bytes(cfg, n, config.parallel, itemsize, config.kv)  # noqa: E731
            streamed = (self.kv_resident, kv_bytes(self.kv_resident), kv_bytes(self.ctx - self.kv_resident))
        log.info(describe_context(self.context_plan, config.parallel, kv_label(config.kv, jnp.dtype(self.dtype).name),
                                  self.cache_plan, streamed))
        jax.block_until_ready(self.params)
        dt = time.perf_counter() - t0
        log.info("loaded %s (%s, %d layers%s) in %.1f s: %.2f GiB of weights on %s at %.2f GiB/s; "
                 "compute %s, context %d, decode %s per jitted call, dense weights %s %s",
                 os.path.basename(gguf.path), cfg.arch, cfg.n_layers,
                 f", {cfg.n_experts} experts top-{cfg.n_experts_used}" if cfg.is_moe else "",
                 dt, loader.bytes_loaded / 2**30,
                 self.device if self.cards is None else f"{len(self.devices)} devices ({', '.join(map(str, self.devices))})",
                 loader.bytes_loaded / 2**30 / max(dt, 1e-9),
                 jnp.dtype(self.dtype).name, self.ctx,
                 f"{self.decode_chunk} steps" if self.decode_chunk > 1 else "1 step", fmt_bytes(self.dense_bytes),
                 "dequantized at load (CPU default; dequantize_dense=False keeps GGML blocks)" if dequantize_dense
                 else "in GGML blocks, dequantized in each step")
        self.routing: list[np.ndarray] | None = [] if config.record_routing else None  # [tokens, M, k] per call
        self.forced_TMk: np.ndarray | None = None  # force_routing's trace
        self.host = HostTiming()
        self.kv_read = [0, 0]  # KV cells finished requests attended to, and those read from VRAM (kv_stats)
        self._session: Session | None = None  # generate's one-row session, made on first use

    def _addressed_tables(self, params):
        """params with each host PLE table addressed (ple.PLETable.addressed; the arrays kept by the model)."""
        from strata_jax.model.layers import ple

        def one(t):
            if not isinstance(t, ple.PLETable) or t.memory_kind != "pinned_host":
                return t
            self._host_tables.append(t.rows.data)
            return t.addressed(self.device)

        return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, ple.PLETable))

    def wait_loaded(self) -> "Model":
        """Until the whole model is in memory; returns the model. The expert store of an offloading model
        loads in the background: a step waits for it on its own, compiling meanwhile (engine/session.py)."""
        if self.experts is not None:
            self.experts.wait()
        return self

    # -- telemetry --------------------------------------------------------------------------------
    @property
    def cache_plan(self):
        return self.experts.plan if self.experts is not None else None

    def stats(self) -> dict[str, Any]:
        """Expert-cache telemetry since load or reset_stats (see OffloadManager.stats); {} for dense models."""
        return self.experts.stats() if self.experts is not None else {}

    def kv_stats(self) -> dict[str, Any]:
        """KV streaming (--kv-resident) since load or reset_stats: the positions each layer keeps on the device,
        the cache cells finished requests' tokens attended to, how many of them were read from VRAM and that
        share (the rest crossed PCIe from host memory); {} when the whole cache is on the device."""
        if self.kv_resident is None:
            return {}
        cells, near = self.kv_read
        return {"kv_resident": self.kv_resident, "kv_cells": cells, "kv_cells_vram": near,
                "kv_vram_hit": near / cells if cells else None}

    def save_expert_cache(self, path: str | os.PathLike[str] | None = None) -> str | None:
        """Save the expert cache's state (which expert sits in which slot, the policy's metadata) to the
        directory `path` (default: the expert_cache_state option), for a later load with that option to
        start warm. Returns the directory, or None when there is no cache to warm (a dense model, or
        every expert resident). Call it between generations."""
        from strata_jax.engine.config import check_option  # noqa: PLC0415

        if path is None:
            path = self.engine_config.expert_cache_state
            if path is None:
                raise ConfigError("save_expert_cache() needs a directory: pass path=..., or load the model with "
                                  "expert_cache_state=PATH (--expert-cache-state).")
        path = check_option("expert_cache_state", path)
        if self.experts is None:
            log.info("expert cache state not saved: %s is a dense model", self.config.arch)
            return None
        return path if self.experts.save_cache_state(path) else None

    def device_memory(self, session: Session | None = None) -> dict[str, int]:
        """Device bytes by use: dense weights, expert slot pools (0 for a dense model) and the KV cache
        of `session` (default: the model's own one-row session, 0 until it has run)."""
        session = session or self._session
        return {"dense": self.dense_bytes, "experts": self.experts.device_bytes if self.experts is not None else 0,
                "kv": session.kv_bytes() if session is not None else 0}

    def host_timing(self) -> dict[str, float | int | None]:
        """Decode steps and jitted decode calls since load or reset_stats, the host's milliseconds per
        step inside the jitted calls (dispatch) and blocked on the tokens (wait); see HostTiming."""
        return self.host.summary()

    def reset_stats(self) -> None:
        self.host = HostTiming()
        self.kv_read = [0, 0]  # KV cells finished requests attended to, and those read from VRAM (kv_stats)
        if self.experts is not None:
            self.experts.reset_stats()

    def routing_trace(self) -> np.ndarray:
        """int32 [tokens, MoE layers, k]: the experts routed for every token processed since load (needs
        record_routing=True). Feed it to strata_jax.offload.simulate."""
        if self.routing is None:
            raise ConfigError("routing is not recorded: load the model with record_routing=True.")
        if not self.routing:
            return np.zeros((0, len(self.config.moe_layers), self.config.n_experts_used), np.int32)
        return np.concatenate(self.routing, axis=0)

    def force_routing(self, trace_TMk: np.ndarray | None) -> None:
        """Replay a routing trace (int [tokens, MoE layers, k], e.g. strata_jax.offload.routing's
        realistic_trace) instead of the routers' choices: the token at cache position p uses row
        p % len(trace). For benchmarks of cache behaviour under a chosen routing; None restores the routers."""
        if trace_TMk is None:
            self.forced_TMk = None
            return
        cfg = self.config
        t = np.asarray(trace_TMk)
        if t.ndim != 3 or t.shape[1:] != (len(cfg.moe_layers), cfg.n_experts_used) or not len(t):
            raise ConfigError(f"a routing trace must be [tokens, {len(cfg.moe_layers)}, {cfg.n_experts_used}] "
                              f"for this model, got shape {t.shape}")
        if t.min() < 0 or t.max() >= cfg.n_experts:
            raise ConfigError(f"routing trace ids must lie in [0, {cfg.n_experts})")
        self.forced_TMk = t.astype(np.int32)

    def forced_prefill(self, pos: int, T: int) -> dict:
        """The forced-routing argument of a prefill chunk over cache positions pos..pos+T-1: [M, T, k]
        ({} when not forcing)."""
        if self.forced_TMk is None:
            return {}
        rows = self.forced_TMk[np.arange(pos, pos + T) % len(self.forced_TMk)]  # [T, M, k]
        return {"forced": jnp.asarray(rows.transpose(1, 0, 2))}

    def note_steps(self, seconds: float, n: int) -> None:
        """Wall time of n steps, for the expert cache's bandwidth and stall telemetry."""
        if self.experts is not None:
            self.experts.note_steps(seconds, n)

    def _adopt(self, session: Session) -> None:
        """A new session takes the device memory for its rows: the one-row session's cache is freed."""
        if self._session is not None and self._session is not session:
            self._session = None

    def use_drafter(self, drafter: Callable[[Sequence[int], int], list[int]] | None, spec_max: int = 4,
                    name: str = "custom") -> None:
        """Speculative decoding with a drafter of your own (None: off): drafter(seq, n_max) returns up to
        n_max token ids to follow seq (the prompt, the output so far and its last token), verified in one
        pass as --spec's drafters are, so greedy output stays the model's own. Takes effect with a new
        one-row session (what the current one holds is dropped)."""
        if drafter is not None and (not isinstance(spec_max, int) or spec_max < 1):
            raise ConfigError(f"use_drafter: spec_max={spec_max!r} must be a positive integer (drafted tokens per "
                              "verify pass).")
        self.drafter = drafter
        self.spec, self.spec_max = (name, spec_max) if drafter is not None else (None, self.spec_max)
        self._session = None

    def session(self) -> Session:
        """The one-row session generate and logits use (made again if another session replaced it)."""
        if self._session is None:
            s = Session(self, 1)
            self._session = s
        return self._session

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def chat_text(self, messages: Sequence[dict], *, response_prefix: str = "", **template_kwargs) -> str:
        """The prompt a message list makes: the GGUF's chat template with its generation prompt, then
        response_prefix (what prompt_tokens tokenizes)."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                  **template_kwargs) + response_prefix

    def infill_tokens(self, prefix: str, suffix: str, *, extra: Sequence[dict] = (), prompt: str = "",
                      n_predict: int = -1) -> list[int]:
        """The fill-in-the-middle prompt of code between `prefix` and `suffix`, laid out as llama.cpp's /infill
        lays it out: the repository pattern where the vocabulary has its tokens ([REPO]myproject, then each
        `extra` file {"filename", "text"} after [FILE_SEP]), then [PRE]prefix[SUF]suffix[MID]prompt. As there,
        the prefix keeps its last 3/4 of a FIM_WINDOW-token window (half the context where that is less) and the
        suffix its first quarter (less the prompt), and the extra files, latest kept, what the context leaves after
        the window and twice n_predict."""
        tok = self.tokenizer
        fim = tok.fim_ids
        if not {"pre", "suf", "mid"} <= fim.keys():
            raise ConfigError("this model's vocabulary has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                              "<|fim_suffix|>, <|fim_middle|>): it was not trained to infill; send the text before "
                              "the gap as a plain prompt instead.")
        text = lambda s: tok.encode(s, add_special=False, parse_special=False)  # noqa: E731
        extra_ids = [fim["rep"], *text("myproject\n")] if "rep" in fim else []
        for chunk in extra:
            if "sep" in fim:
                extra_ids += [fim["sep"], *text(chunk.get("filename", "tmp") + "\n")]
            else:
                extra_ids += text("\n\n--- snippet ---\n\n")
            extra_ids += text(chunk["text"])
        if "sep" in fim:
            extra_ids += [fim["sep"], *text("filename\n")]
        window = min(FIM_WINDOW, self.ctx // 2)  # half a small context: the rest for the files and the reply
        prompt_ids = text(prompt) if prompt else []
        pre_ids, suf_ids = text(prefix), text(suffix)
        pre_ids = pre_ids[len(pre_ids) - min(len(pre_ids), 3 * (window // 4)):]
        suf_ids = suf_ids[:max(0, window // 4 - (2 + len(prompt_ids)))]
        # (a reply of unknown length, n_predict < 16, keeps room for 16 tokens all the same: the layout then fits)
        n_extra = min(max(0, self.ctx - window - 2 * max(n_predict, 16)), len(extra_ids))
        bos = [tok.bos_id] if tok.add_bos else []
        return (extra_ids[len(extra_ids) - n_extra:] + bos + [fim["pre"], *pre_ids, *prompt_ids, fim["suf"], *suf_ids,
                                                             fim["mid"]])

    def prompt_tokens(self, prompt_or_messages: str | Sequence[dict] | Sequence[int], *, response_prefix: str = "",
                      **template_kwargs) -> list[int]:
        """A raw prompt is tokenized as is (with BOS if the model wants one); a message list goes through
        the GGUF's chat template first, and response_prefix (the start of the assistant's reply, which
        the model continues) follows its generation prompt; a list of token ids is used as is."""
        if isinstance(prompt_or_messages, str):
            return self.tokenize(prompt_or_messages)
        if not prompt_or_messages:
            raise ConfigError("the prompt is empty: give text, token ids, or at least one message.")
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt_or_messages):
            ids = [int(t) for t in prompt_or_messages]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size}).")
            return ids
        if not all(isinstance(m, dict) for m in prompt_or_messages):
            raise ConfigError("a prompt list must hold either token ids or message dicts "
                              "({'role': ..., 'content': ...}), not a mix.")
        text = self.chat_text(prompt_or_messages, response_prefix=response_prefix, **template_kwargs)
        bos = self.tokenizer.bos_id
        has_bos = bos is not None and text.startswith(self.tokenizer.decode([bos], skip_special=False))
        return self.tokenize(text, add_special=not has_bos)

    # -- forward --------------------------------------------------------------------------------
    def check_len(self, n: int) -> None:
        if n > self.ctx:
            raise ConfigError(f"{n} tokens exceed the context of {self.ctx}; shorten the input or load the "
                              f"model with a larger ctx (--ctx, up to the model's {self.config.context_length}).")

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the next-token logits after each position."""
        if isinstance(token_ids, str) or not all(isinstance(t, (int, np.integer)) for t in token_ids):
            raise ConfigError("logits() takes a list of token ids; use model.tokenize(text) first.")
        ids = self.prompt_tokens(list(token_ids))
        self.check_len(len(ids))
        return self.session().logits(ids)

    def mtp_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the MTP block's logits at each position p, its guess at the token
        after the next (spec="mtp" only: model/mtp.py)."""
        ids = self.prompt_tokens(list(token_ids))
        self.check_len(len(ids))
        return self.session().mtp_logits(ids)

    # -- generation -----------------------------------------------------------------------------
    def generate_stream(
        self,
        prompt_or_messages: str | Sequence[dict] | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        cache_prompt: bool = True,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        logprobs: bool = False,
        top_logprobs: int = 0,
        response_format: dict | None = None,
        grammar: str | None = None,
        json_schema: dict | None = None,
        spec_max: int | None = None,
        prompt_logprobs: bool = False,
        **template_kwargs,
    ) -> Iterator[GenerationChunk]:
        """Stream a generation. cache_prompt: reuse the KV cache for the longest token prefix this prompt
        shares with what the cache holds (the previous request's prompt and output), as llama.cpp does;
        timings["cache_n"] says how many prompt tokens were reused.

        presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) act on the tokens generated so far;
        repeat_penalty (llama.cpp's, 1 = off) on the last repeat_last_n tokens of prompt and output.
        logprobs: each chunk's `logprobs` holds a TokenLogprob per token (the model's log-probability and
        the top_logprobs most likely alternatives, 0..20; top_logprobs > 0 implies logprobs).
        Constrained output (llguidance): response_format as OpenAI's ({"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"schema": {...}}}), or llama.cpp's grammar (GBNF text) or
        json_schema (a schema dict); at most one of them. spec_max: with speculative decoding on
        (EngineConfig.spec), this request's drafted tokens per verify pass at most (0: none; the config's
        spec_max bounds it). prompt_logprobs (with logprobs): the first chunk's `prompt_logprobs` hold a
        TokenLogprob for each prompt token after the first (the model's log-probability of it given the
        tokens before it: what OpenAI's echo with logprobs reports; the prompt is then prefilled whole)."""
        constraint = request_grammar(response_format, grammar, json_schema)
        s = self.session()
        row, chunks = s.admit(prompt_or_messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, min_p=min_p, seed=seed, stop=stop, cache_prompt=cache_prompt,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, logprobs=logprobs,
                              top_logprobs=top_logprobs, constraint=constraint, spec_max=spec_max,
                              prompt_logprobs=prompt_logprobs, **template_kwargs)
        try:
            yield from chunks
            while row in s.active_rows:
                yield from s.step().get(row, [])
        finally:
            if row in s.active_rows:  # the consumer stopped early: what was written stays reusable
                s.release(row)

    def generate(self, prompt_or_messages: str | Sequence[dict], **kwargs) -> Generation:
        """Generate to completion; keyword arguments as for generate_stream."""
        parts, ids, lps, plps = [], [], None, None
        for chunk in self.generate_stream(prompt_or_messages, **kwargs):
            plps = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else plps
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                lps = lps if lps is not None else []
                lps.extend(chunk.logprobs)
        return Generation("".join(parts), ids, chunk.prompt_token_ids or [], chunk.finish_reason or "length",
                          chunk.timings or {}, lps, plps)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text (a byte token's single byte, which may be part of
        a UTF-8 sequence): the `bytes` of OpenAI's logprobs."""
        return self.tokenizer.piece(token_id)


def enable_compilation_cache() -> None:
    """Keep compiled programs on disk (cache_dir()/xla) so a second start skips XLA compilation."""
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: a restart compiles none
    log.info("compiled programs are kept in %s (a restart reuses them; STRATA_JAX_COMPILATION_CACHE=0 turns "
             "this off)", cache_dir() / "xla")


def pick_devices(ids: tuple[int, ...] | None, device: Any, moe: bool = True) -> list[Any]:
    """The devices a model runs on: `devices` by JAX index; else `device`; else, for a MoE model (moe), every
    GPU where there are several; else JAX's first device."""
    if ids is not None:
        have = jax.devices()
        if max(ids) >= len(have):
            raise ConfigError(f"devices={','.join(map(str, ids))}: there is no device {max(ids)} (JAX sees "
                              f"{len(have)}: {', '.join(str(d) for d in have)}).")
        return [have[i] for i in ids]
    if device is not None:
        return [device]
    have = jax.devices()
    return list(have) if moe and have[0].platform == "gpu" and len(have) > 1 else [have[0]]


def _check_cards(config: EngineConfig, cfg: ModelConfig) -> None:
    """What several cards do not serve yet, refused by name."""
    if not cfg.is_moe:
        raise ConfigError(f"several devices split the expert cache, and {cfg.arch} has no experts: run it on one "
                          "(--devices 0).")


def load(path: str | os.PathLike[str] | None = None, config: EngineConfig | None = None, *, device: Any = None,
         **options: Any) -> Model:
    """Load a GGUF model (the embedded default model when path is None) on `device` (default: JAX's first).

    config: an EngineConfig; keyword options (ctx, dtype, expert_slots, vram_budget, policy, ...:
    EngineConfig's fields, documented there) build one, or change the given one. Every option is
    validated before the file is opened."""
    if config is None:
        config = EngineConfig.create(**options)
    elif not isinstance(config, EngineConfig):
        raise ConfigError(f"config={config!r} is not an EngineConfig; build one with EngineConfig.create(...).")
    elif options:
        config = config.replace(**options)
    if config.compilation_cache:
        enable_compilation_cache()
    if path is None:
        from strata_jax.dev.default_model import default_model_path

        path = default_model_path()
    return Model(GGUFFile(path), config, device)
