"""Kernel choices: which implementation the jitted programs trace for each choice point.

A `Kernels` value is a static argument of every jitted program (part of its cache key), built once by
the engine config (strata_jax/engine/config.py); nothing reads the environment at trace time.
"""

from __future__ import annotations

import dataclasses

QMATVEC = ("auto", "on", "off")
MOE_PREFILL = ("dense", "blocked", "grouped")
MLA_FORMS = ("auto", "absorbed", "naive")
FLOAT_STACK = ("copy", "kernel")


@dataclasses.dataclass(frozen=True)
class Kernels:
    # the fused dequantize + mat-vec Pallas kernel (model/qmatvec.py): "auto" takes it where it is faster
    # (GPU, K-quants and IQ3_S routed experts, enough programs: qmatvec.use_kernel), "on" wherever it
    # supports the type (on CPU through Pallas' interpreter: tests), "off" never
    qmatvec: str = "auto"
    # the prefill MoE formulation (model/layers/moe.py): "dense" (every token through every expert, a scan over
    # expert groups), "blocked" (the same scan, each expert through blocks of only its tokens) or "grouped"
    # (tokens sorted by expert, ragged_dot)
    moe_prefill: str = "dense"
    # deepseek2's latent attention (model/layers/mla.py): "absorbed" (queries against the cached latents),
    # "naive" (the latents expanded to every head's keys and values), or "auto": per step, the form with
    # fewer multiply-adds for its tokens per row (decode absorbed, long prefill chunks naive)
    mla: str = "auto"
    # a layer's slice of the stacked recurrent state inside the layer scan (model/hybrid.py): read and written
    # by the row kernels of core/hostrows.py ("on"), by dynamic slices ("off"; XLA's memcpy thunk for one
    # keeps the scan out of its command buffers on a GPU), "auto": the kernels on a GPU
    state_rows: str = "auto"
    # an offloaded model's many-token MoE step (dense/blocked prefill): "on" reads the experts the cache holds
    # from their slots and copies only the others from the host store; "off" copies every expert of a group
    prefill_cached: str = "off"
    # a scanned layer's float matrix (qwen4exp's F16 hyper-connection matrices) in a few-token product: "copy"
    # (its slice of the stack, a copy XLA runs as a loop-dependent dynamic-slice fusion, which keeps the layer
    # loop out of the CUDA graphs) or "kernel" (the fused kernel reads it in the stack by slot; slower on qseed:
    # docs/benchmarks.md, PART=27)
    float_stack: str = "copy"
    # split-K in the fused kernel (qmatvec.block_config): "auto" cuts a call of few tiles (qseed's routed gate+up,
    # the [3072, 4096] output projections) along its rows into more programs, whose partial sums are added after;
    # "off" never (the default until a GPU run says which is faster)
    qmatvec_split: str = "off"
    # layer-major prefill (model/forward.py): a many-token step of more than this many tokens (a multiple of it)
    # runs each block over sub-chunks of this size in turn, the MoE layer's experts streamed once for all of
    # them: a long chunk streams every expert once with a sub-chunk's activations. 0: off (the default until a
    # GPU measures it)
    prefill_subchunk: int = 0
    # the device platform "auto" decides for ("gpu", "cpu", ...)
    platform: str = "cpu"

    def __post_init__(self):
        if self.qmatvec not in QMATVEC:
            raise ValueError(f"qmatvec={self.qmatvec!r}: choose one of {QMATVEC}")
        if self.moe_prefill not in MOE_PREFILL:
            raise ValueError(f"moe_prefill={self.moe_prefill!r}: choose one of {MOE_PREFILL}")
        if self.state_rows not in QMATVEC:
            raise ValueError(f"state_rows={self.state_rows!r}: choose one of {QMATVEC}")
        if self.prefill_cached not in ("on", "off"):
            raise ValueError(f"prefill_cached={self.prefill_cached!r}: choose 'on' or 'off'")
        if self.float_stack not in FLOAT_STACK:
            raise ValueError(f"float_stack={self.float_stack!r}: choose one of {FLOAT_STACK}")
        if self.prefill_subchunk < 0:
            raise ValueError(f"prefill_subchunk={self.prefill_subchunk!r}: give 0 (off) or a token count")
        if self.qmatvec_split not in ("auto", "off"):
            raise ValueError(f"qmatvec_split={self.qmatvec_split!r}: choose 'auto' or 'off'")
        if self.mla not in MLA_FORMS:
            raise ValueError(f"mla={self.mla!r}: choose one of {MLA_FORMS}")
