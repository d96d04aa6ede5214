"""Layer runs: identical layers compiled once.

XLA compiles an unrolled layer in ~0.5-0.8 s per program on a GPU (docs/benchmarks.md, "Compilation per
layer"), so a 48-layer model spends minutes compiling the same layer over and over. Layers whose params
have the same structure, types and shapes and the same static properties (a sliding window, an expert
pool) are alike; a quantized file mixes types by layer, often with a period (Q4_K_M's Q6_K layers every
third layer in the middle), so a run is `period` distinct layers repeated `repeats` times. Each position
of the period has its params stacked at load [repeats, ...]; the forward pass scans over the repeats and
compiles the period once. Consecutive alike positions of a period (qwen4exp: three DeltaNet layers, then
attention) form a group, stacked [repeats * count, ...] and scanned inside the period's scan, so the
period compiles each distinct layer once. Layers outside any run stay unrolled.

Inside the scan a layer's quantized matrices are views (QTensor.index: the fused kernel reads the
stack in place by slot) and its index is a core.layer_ref.LayerRef.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.layer_ref import LayerRef
from strata_jax.core.qtensor import QTensor

MAX_PERIOD = 8  # layers per period a plan tries


@dataclasses.dataclass(frozen=True)
class Run:
    start: int  # first layer
    period: int  # layers per repeat
    repeats: int  # 1: unrolled
    groups: tuple[int, ...] = ()  # the period's positions as runs of alike ones (sum: period); () = all 1

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return self.groups or (1,) * self.period

    def group_layers(self, g: int) -> tuple[int, ...]:
        """The layers of group g over every repeat, in stacking order (repeat-major): the candidates of
        the traced index r * count + s, s the layer's place in the group."""
        sizes = self.group_sizes
        j0 = sum(sizes[:g])
        return tuple(self.start + q * self.period + j0 + s for q in range(self.repeats) for s in range(sizes[g]))


def signature(layer_params: Any, static: Hashable = ()) -> Hashable:
    """What must be equal for two layers to share one compiled body: the params' tree structure (GGML
    types and projection splits included), every leaf's shape, dtype and memory kind, and the static
    properties the forward pass and the expert provider read (`static`)."""
    leaves, tree = jax.tree.flatten(layer_params)
    kind = lambda a: getattr(getattr(a, "sharding", None), "memory_kind", None)  # noqa: E731 (a host table stays apart)
    return tree, tuple((tuple(a.shape), str(a.dtype), kind(a)) for a in leaves), static


def plan_runs(signatures: Sequence[Hashable], max_period: int = MAX_PERIOD,
              starts: Sequence[int] = ()) -> tuple[Run, ...]:
    """Cover the layers with runs, greedily from the first: at each layer the period and repeat count
    that save the most compiled layers (period x (repeats - 1)), the shorter period on a tie; a layer no
    run starts at is a run of one. starts: layers a run must begin at (what the forward pass runs
    before a segment, e.g. qwen4exp's PLE: no run spans them)."""
    sig = list(signatures)
    n, i, out = len(sig), 0, []
    cuts = sorted(set(starts) | {n})
    while i < n:
        end = next(c for c in cuts if c > i)
        best = Run(i, 1, 1)
        for p in range(1, min(max_period, (end - i) // 2) + 1):
            r = 1
            while i + (r + 1) * p <= end and sig[i + r * p: i + (r + 1) * p] == sig[i: i + p]:
                r += 1
            if r > 1 and p * (r - 1) > best.period * (best.repeats - 1):
                best = Run(i, p, r, _groups(sig[i: i + p]))
        out.append(best)
        i = best.stop
    return tuple(out)


def _groups(period_sigs: Sequence[Hashable]) -> tuple[int, ...]:
    """A period's positions as counts of consecutive alike ones; () when none repeats."""
    sizes = [1]
    for a, b in zip(period_sigs, period_sigs[1:]):
        if a == b:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes) if len(sizes) < len(period_sigs) else ()


def describe(runs: Sequence[Run]) -> str:
    """`48 layers, 5 compiled layer bodies: scanned 0-5 (6 x 1 layer), 6-41 (12 x 3 layers), ...` for the log."""
    bodies = sum(len(r.group_sizes) for r in runs)
    n = runs[-1].stop if runs else 0
    parts = [f"{r.start}-{r.stop - 1} ({r.repeats} x {r.period} layer{'s' if r.period > 1 else ''})" for r in runs
             if r.repeats > 1]
    return f"{n} layers, {bodies} compiled layer bodies" + (f": scanned {', '.join(parts)}" if parts else "")


@struct.dataclass
class LayerRun:
    """A run's params: per group of the period (Run.group_layers), its layers' params with every leaf
    stacked [repeats * count, ...]."""

    stacked: tuple[Any, ...]
    run: Run = struct.field(pytree_node=False)


def _stack(trees: Sequence[Any], free: bool) -> Any:
    def one(*xs):
        y = jnp.stack(xs)
        if free:
            for x in xs:
                x.delete()
        return y

    return jax.tree.map(one, *trees)


def stack_layers(layers: Sequence[Any], runs: Sequence[Run], free: bool = False) -> tuple[Any, ...]:
    """The layer params as the forward pass takes them: each run of more than one repeat as a LayerRun,
    the other layers as they are. free: delete each source array once stacked (device memory peaks at
    one leaf's stack more, not a second copy of the model)."""
    out: list[Any] = []
    for run in runs:
        if run.repeats == 1:
            out.extend(layers[run.start: run.stop])
            continue
        stacked = tuple(_stack([layers[i] for i in run.group_layers(g)], free) for g in range(len(run.group_sizes)))
        out.append(LayerRun(stacked, run))
    return tuple(out)


def _hit(stack, i):
    return (jnp.arange(stack.shape[0]) == i).reshape((-1,) + (1,) * (stack.ndim - 1))


def masked_take(stack, i):
    """stack[i] at a traced i inside a loop, by a masked sum rather than a dynamic slice: on a GPU, XLA runs
    a slice at a loop-dependent offset that no consumer fuses as a DynamicSliceFusionV2 memcpy, which keeps
    the loop out of the CUDA graphs (docs/benchmarks.md). Exact; for small stacks (it reads all of it).
    An i past the stack reads zeros."""
    return jnp.sum(jnp.where(_hit(stack, i), stack, jnp.zeros((), stack.dtype)), axis=0, dtype=stack.dtype)


def masked_put(stack, i, value):
    """stack with stack[i] = value at a traced i inside a loop, by a select (masked_take's reason)."""
    return jnp.where(_hit(stack, i), jnp.asarray(value)[None].astype(stack.dtype), stack)


# a stacked leaf of at most this many bytes per layer is read at a traced index by a masked sum over its
# stack (masked_take), not a dynamic slice (qtiny's norm and conv weights, docs/benchmarks.md); reading a
# small stack whole costs less
MASKED_VIEW_BYTES = 256 << 10


def view(stacked: Any, r) -> Any:
    """Layer r (traced or int) of stacked params: matrices as views of their stacks, the rest sliced (a
    small leaf at a traced r by a masked sum, exact: every other layer contributes zeros)."""
    def one(a):
        if isinstance(a, QTensor):
            return QTensor(a.data, a.qtype, a.n_cols, r)
        if isinstance(r, int) or a.nbytes > MASKED_VIEW_BYTES * a.shape[0]:
            return jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)
        return masked_take(a, r)

    return jax.tree.map(one, stacked, is_leaf=lambda a: isinstance(a, QTensor))


def detach_provider(carry: tuple) -> tuple[tuple, tuple]:
    """run_layers' detach for a carry whose last element is the ExpertProvider (or None)."""
    *rest, experts = carry
    if experts is None:
        return carry, ((), ())
    experts, counts = experts.detach_counts()
    return (*rest, experts), counts


def attach_provider(carry: tuple, keys: tuple, values: tuple) -> tuple:
    """run_layers' attach for a carry whose last element is the ExpertProvider (or None)."""
    *rest, experts = carry
    return carry if experts is None else (*rest, experts.attach_counts(keys, values))


def _where(run: Run, i: int) -> tuple[int, int]:
    """(group, index in its stack) of layer i of the run."""
    q, j = divmod(i - run.start, run.period)
    for g, c in enumerate(run.group_sizes):
        if j < c:
            return g, q * c + j
        j -= c
    raise AssertionError("unreachable")


def layers_of(segments: Sequence[Any]) -> tuple[Any, ...]:
    """Every layer's params in order (views where they sit in a run): what the segments hold, as the
    unstacked per-layer tuple a reader or a test that edits one field expects; forward takes either."""
    out: list[Any] = []
    for seg in segments:
        if isinstance(seg, LayerRun):
            out.extend(view(seg.stacked[g], k) for g, k in map(lambda i: _where(seg.run, i),
                                                                 range(seg.run.start, seg.run.stop)))
        else:
            out.append(seg)
    return tuple(out)


def layer_at(segments: Sequence[Any], i: int) -> Any:
    """Block i's params from the forward pass's segments (a view where it sits in a run)."""
    at = 0
    for seg in segments:
        if isinstance(seg, LayerRun):
            if seg.run.start <= i < seg.run.stop:
                g, k = _where(seg.run, i)
                return view(seg.stacked[g], k)
            at = seg.run.stop
        else:
            if at == i:
                return seg
            at += 1
    raise IndexError(f"no layer {i}")


def _loop(step: Callable[[Any, jax.Array], tuple[Any, Any]], carry: Any, n: int) -> tuple[Any, Any]:
    """lax.scan(step, carry, arange(n)) without the scan's own memcpy-like fusions: the index travels in the
    carry (not read from an arange) and each step's outputs go into their stacks by a select (not a dynamic
    update). On the GPU, XLA runs a plain dynamic slice or update with a loop-dependent offset as a
    DynamicSliceFusionV2 thunk, which keeps the whole loop out of the command buffers: the host then
    launches every layer (docs/benchmarks.md, "Unrolling in the graph"). The outputs here are small (a
    layer's routed ids, counts), so rewriting their stacks each step costs little."""
    shapes = jax.eval_shape(lambda c: step(c, jnp.int32(0))[1], carry)
    stacks = jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), shapes)

    def body(state, _):
        carry, i, stacks = state
        carry, out = step(carry, i)
        return (carry, i + 1, jax.tree.map(lambda st, o: masked_put(st, i, o), stacks, out)), None

    (carry, _, stacks), _ = jax.lax.scan(body, (carry, jnp.int32(0), stacks), None, length=n)
    return carry, stacks


Block = Callable[[Any, Any, "int | LayerRef"], tuple[Any, Any]]


def run_layers(segments: Sequence[Any], carry: Any, block: Block, *, unroll: bool = False,
               detach: Callable[[Any], tuple[Any, tuple]] | None = None,
               attach: Callable[[Any, tuple, tuple], Any] | None = None,
               enter: Callable[[Any, int], Any] | None = None) -> tuple[Any, list[Any]]:
    """Thread `carry` through every layer: block(carry, params, i) -> (carry, out) with i the block index,
    an int for an unrolled layer and a LayerRef inside a scanned run. Returns the carry and every layer's
    out in layer order.

    unroll: run the runs' layers one by one too (static views). detach(carry) -> (carry, (keys, values))
    and attach(carry, keys, values): what the carry accumulates with a static structure that grows per
    layer (the expert provider's pending counts) is taken out before a scan and after each layer in it,
    the values coming back stacked in the group's stacking order, and put back after it. enter(carry, i):
    run before each segment (before each layer when unrolled), i its first layer."""
    outs: list[Any] = []
    at = 0
    for seg in segments:
        if not isinstance(seg, LayerRun):
            if enter is not None:
                carry = enter(carry, at)
            carry, o = block(carry, seg, at)
            outs.append(o)
            at += 1
            continue
        run = seg.run
        if unroll:
            for i in range(run.start, run.stop):
                if enter is not None:
                    carry = enter(carry, i)
                g, k = _where(run, i)
                carry, o = block(carry, view(seg.stacked[g], k), i)
                outs.append(o)
            at = run.stop
            continue
        if enter is not None:
            carry = enter(carry, run.start)
        before = ((), ())
        if detach is not None:
            carry, before = detach(carry)
        keys: dict[int, tuple] = {}  # per group: the counts' static keys, as the last trace made them

        def one(carry, params, ref, g):
            carry, o = block(carry, params, ref)
            side = ((), ())
            if detach is not None:
                carry, side = detach(carry)
            keys[g] = side[0]
            return carry, (o, side[1])

        def period(carry, r, seg=seg, run=run):
            ys, values = [], []
            for g, c in enumerate(run.group_sizes):
                ids = run.group_layers(g)
                if c == 1:
                    carry, (o, v) = one(carry, view(seg.stacked[g], r), LayerRef(ids, r), g)
                else:  # the group's layers: a loop inside the period's, index r * c + s into its stack
                    inner = lambda carry, s, g=g, c=c, ids=ids: one(  # noqa: E731
                        carry, view(seg.stacked[g], r * c + s), LayerRef(ids, r * c + s), g)
                    carry, (o, v) = _loop(inner, carry, c)
                ys.append(o)
                values.append(v)
            return carry, (ys, values)

        carry, (ys, values) = _loop(period, carry, run.repeats)
        # a group's outputs and counts come back [repeats, count, ...] (count > 1) or [repeats, ...]:
        # flat in its stacking order
        flat = lambda y, c: y.reshape((run.repeats * c,) + y.shape[2:]) if c > 1 else y  # noqa: E731
        ys = [jax.tree.map(lambda y, c=c: flat(y, c), y) for y, c in zip(ys, run.group_sizes)]
        values = [jax.tree.map(lambda v, c=c: flat(v, c), v) for v, c in zip(values, run.group_sizes)]
        if attach is not None:
            carry = attach(carry, *before)
            for g, v in enumerate(values):
                carry = attach(carry, keys[g], v)
        for i in range(run.start, run.stop):
            g, k = _where(run, i)
            outs.append(jax.tree.map(lambda y, k=k: y[k], ys[g]))
        at = run.stop
    return carry, outs
