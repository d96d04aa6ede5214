"""What a routing trace says about caching experts: per-layer popularity and its skew, reuse distance,
next-token overlap, and hit rates of every policy against Belady's optimum (offload/simulate.py).

Everything is a pure function of a trace int [T, L, k] (tokens, MoE layers, routed ids; -1 padding), so
the same numbers come from the CLI (`strata-jax trace report`), a notebook or a test. An expert counts
once per (token, layer) however often a row repeats it, as the engine's cache sees it.

Shape legend: strata_jax/core/shapes.py (here E: experts per layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from strata_jax.offload.simulate import n_experts_of, simulate, unique_requests

POLICIES = ("lru", "lfu", "lrfu", "static", "belady")
FRACTIONS = (0.125, 0.25, 0.5)  # of all experts cached: the report's columns


def used_TLE(trace_TLk, n_experts: int | None = None) -> np.ndarray:
    """bool [T, L, E]: whether token t routed expert e at layer l."""
    t = np.asarray(trace_TLk)
    E = n_experts or n_experts_of(t)
    T, L, _ = t.shape
    out = np.zeros((T, L, E + 1), bool)  # column E takes the -1 padding
    np.put_along_axis(out, np.where(t >= 0, t, E), True, axis=-1)
    return out[..., :E]


def frequency_LE(trace_TLk, n_experts: int | None = None) -> np.ndarray:
    """int [L, E]: tokens that routed each expert, per layer."""
    return used_TLE(trace_TLk, n_experts).sum(0)


def top_share(freq_LE: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """float [L]: share of a layer's expert uses that go to its most used `fraction` of experts (at least
    one): 0.1 for a uniform router at fraction 0.1, near 1 for a skewed one."""
    n = max(1, math.ceil(fraction * freq_LE.shape[1]))
    top = -np.sort(-freq_LE, axis=1)[:, :n].sum(1)
    total = freq_LE.sum(1)
    return np.where(total > 0, top / np.maximum(total, 1), 0.0)


def reuse_distances(trace_TLk, n_experts: int | None = None) -> list[np.ndarray]:
    """Per layer, int [uses]: for every use of an expert that layer used before, the tokens since its last
    use (1: the previous token used it too). First uses are left out (cold: no cache helps them)."""
    used = used_TLE(trace_TLk, n_experts)
    T, L, E = used.shape
    out = []
    for layer in range(L):
        last = np.full(E, -1)
        ds = []
        for t in range(T):
            ids = np.flatnonzero(used[t, layer])
            seen = ids[last[ids] >= 0]
            ds.append(t - last[seen])
            last[ids] = t
        out.append(np.concatenate(ds) if ds else np.zeros(0, int))
    return out


def next_token_overlap(trace_TLk) -> np.ndarray:
    """float [L]: the mean share of a token's experts that the previous token routed too, per layer."""
    used = used_TLE(trace_TLk)
    if used.shape[0] < 2:
        return np.zeros(used.shape[1])
    both = (used[1:] & used[:-1]).sum(-1)
    now = used[1:].sum(-1)
    return np.where(now > 0, both / np.maximum(now, 1), 0.0).mean(0)


def hit_rates(trace_TLk, fractions: Sequence[float] = FRACTIONS, policies: Sequence[str] = POLICIES, *,
              per_layer: bool = False, n_experts: int | None = None) -> dict[str, list[float]]:
    """{policy: [hit rate at each fraction of all experts cached]}: the shared cache of `expert_slots`
    (per_layer: a cache of fraction x E per layer). A size smaller than one token's experts is nan."""
    t = np.asarray(trace_TLk)
    T, L, _ = t.shape
    E = n_experts or n_experts_of(t)
    need = int((unique_requests(t) >= 0).sum(-1).max(initial=1))
    out: dict[str, list[float]] = {}
    for p in policies:
        row = []
        for f in fractions:
            per = max(1, round(f * E))
            slots = per * L if per_layer else max(1, round(f * E * L))
            if (per if per_layer else slots) < need:
                row.append(float("nan"))
                continue
            row.append(simulate(t, p, slots, per_layer=per_layer, n_experts=E)["hit_rate"])
        out[p] = row
    return out


def mixed_rows(trace_TLk, fractions: Sequence[float] = FRACTIONS, promote_after: Sequence[int] = (1, 2, 4), *,
               cold_ratio: float = 0.6, policy: str = "lru", per_layer: bool = False,
               n_experts: int | None = None) -> list[dict]:
    """Mixed-precision experts (--cold-experts) replayed: per cache fraction and promote_after, the hit rate,
    the share of lookups served low-bit, and the bytes over PCIe against plain offloading with the same policy
    (a low-bit expert weighing cold_ratio of a high-bit one: IQ2_XXS against IQ3_S is ~0.6)."""
    t = np.asarray(trace_TLk)
    T, L, _ = t.shape
    E = n_experts or n_experts_of(t)
    need = int((unique_requests(t) >= 0).sum(-1).max(initial=1))
    rows = []
    for f in fractions:
        per = max(1, round(f * E))
        slots = per * L if per_layer else max(1, round(f * E * L))
        if (per if per_layer else slots) < need:
            continue
        plain = simulate(t, policy, slots, per_layer=per_layer, n_experts=E)
        for after in promote_after:
            r = simulate(t, policy, slots, per_layer=per_layer, n_experts=E, promote_after=after)
            moved = (r["misses"] - r["cold"]) + cold_ratio * r["cold"]
            rows.append({"fraction": f, "promote_after": after, "hit_rate": r["hit_rate"], "cold_share": r["cold_share"],
                         "plain_hit_rate": plain["hit_rate"],
                         "bytes_vs_plain": moved / plain["misses"] if plain["misses"] else float("nan")})
    return rows


def report(trace_TLk, fractions: Sequence[float] = FRACTIONS, policies: Sequence[str] = POLICIES, *,
           per_layer: bool = False, n_experts: int | None = None, promote_after: Sequence[int] = (),
           cold_ratio: float = 0.6) -> dict:
    """Everything above as one record: shape, per-layer popularity, reuse and overlap, hit rates (and, given
    promote_after, mixed_rows with LRU)."""
    t = np.asarray(trace_TLk)
    T, L, K = t.shape
    E = n_experts or n_experts_of(t)
    freq = frequency_LE(t, E)
    dists = reuse_distances(t, E)
    return {
        "tokens": T, "layers": L, "experts": E, "k": K,
        "top10_share": top_share(freq, 0.1).tolist(),
        "experts_used": (freq > 0).sum(1).tolist(),
        "reuse_median": [float(np.median(d)) if d.size else float("nan") for d in dists],
        "reuse_next_token": [float((d == 1).mean()) if d.size else float("nan") for d in dists],
        "next_token_overlap": next_token_overlap(t).tolist(),
        "fractions": list(fractions), "per_layer": per_layer,
        "hit_rates": hit_rates(t, fractions, policies, per_layer=per_layer, n_experts=E),
        "cold_ratio": cold_ratio,
        "mixed": mixed_rows(t, fractions, promote_after, cold_ratio=cold_ratio, per_layer=per_layer, n_experts=E)
        if promote_after else [],
    }


def format_report(r: dict) -> str:
    """The record as text: the trace's shape, a line per layer, a line per policy."""
    lines = [f"{r['tokens']} tokens x {r['layers']} MoE layers, {r['experts']} experts per layer, top-{r['k']}", "",
             "layer  experts used  top-10% share  reuse median  reused next token  next-token overlap"]
    for i in range(r["layers"]):
        lines.append(f"{i:>5}  {r['experts_used'][i]:>12}  {r['top10_share'][i]:>13.1%}  "
                     f"{r['reuse_median'][i]:>12.1f}  {r['reuse_next_token'][i]:>17.1%}  "
                     f"{r['next_token_overlap'][i]:>18.1%}")
    cache = "a cache per layer" if r["per_layer"] else "one shared cache"
    lines += ["", f"hit rate ({cache}) at this share of all experts cached:",
              "policy  " + "".join(f"{f:>9.1%}" for f in r["fractions"])]
    for p, row in r["hit_rates"].items():
        lines.append(f"{p:<8}" + "".join(f"{v:>9.1%}" if not math.isnan(v) else f"{'-':>9}" for v in row))
    if r.get("mixed"):
        lines += ["", f"mixed precision (LRU; a low-bit expert is {r['cold_ratio']:.2f} of a high-bit one's bytes):",
                  "cached  promote after  hit rate  low-bit share  PCIe bytes vs plain (its hit rate)"]
        for m in r["mixed"]:
            lines.append(f"{m['fraction']:>6.1%}  {m['promote_after']:>13}  {m['hit_rate']:>8.1%}  {m['cold_share']:>13.1%}"
                         f"  {m['bytes_vs_plain']:>19.1%} ({m['plain_hit_rate']:.1%})")
    return "\n".join(lines)


def plot_report(trace_TLk, r: dict, folder) -> list[str]:
    """PNG plots into `folder` (matplotlib): hit rate against cache size per policy, expert popularity per
    layer, reuse distances. Returns the files written."""
    import matplotlib  # noqa: PLC0415 - an optional dependency (strata-jax[research])
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, row in r["hit_rates"].items():
        ax.plot([100 * f for f in r["fractions"]], [100 * v for v in row], marker="o", label=p)
    ax.set(xlabel="experts cached (% of all)", ylabel="hit rate (%)",
           title="Expert-cache hit rate by policy" + (" (a cache per layer)" if r["per_layer"] else ""))
    ax.legend()
    ax.grid(alpha=0.3)
    files.append(_save(fig, folder / "hit_rate.png"))
    freq = frequency_LE(trace_TLk, r["experts"])
    fig, ax = plt.subplots(figsize=(7, 4))
    im = ax.imshow(freq / max(r["tokens"], 1), aspect="auto", cmap="viridis")
    ax.set(xlabel="expert id", ylabel="MoE layer", title="Share of tokens routing each expert")
    fig.colorbar(im, ax=ax, label="share of tokens")
    files.append(_save(fig, folder / "popularity.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    d = np.concatenate(reuse_distances(trace_TLk, r["experts"]) or [np.zeros(0, int)])
    if d.size:
        ax.hist(d, bins=np.unique(np.geomspace(1, max(int(d.max()), 2), 30).astype(int)), log=True)
        ax.set_xscale("log")
    ax.set(xlabel="reuse distance (tokens since the expert's last use in its layer)", ylabel="uses",
           title="Reuse distance, all layers")
    files.append(_save(fig, folder / "reuse_distance.png"))
    return files


def _save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)
    return str(path)
