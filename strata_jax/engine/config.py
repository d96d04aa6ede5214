"""EngineConfig: every runtime option of a loaded model, validated once, before the file is opened.

`EngineConfig.create(**options)` checks each option and raises a ConfigError naming it and the fix;
with flags=True (the CLI) the errors name the command-line flag instead and numbers may arrive as text.
The environment sets defaults here and nowhere else: STRATA_JAX_QMATVEC (1 on, 0 off, unset auto) and
STRATA_JAX_MOE_PREFILL (dense | grouped) give `kernels`, STRATA_JAX_COMPILATION_CACHE (0 off) gives
`compilation_cache`. Later steps finish the config: `check_model` once the GGUF header is read (warns
about options the model ignores, refuses those it cannot take), `resolved` once the device is known (fills
the platform defaults), and load's context planner fills ctx (offload/sizing.py plan_context).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from strata_jax.core.errors import ConfigError
from strata_jax.engine.draft import check_spec
from strata_jax.model.config import ROPE_SCALINGS
from strata_jax.model.kernels import FLOAT_STACK, MOE_PREFILL, Kernels
from strata_jax.core.units import parse_size

log = logging.getLogger("strata_jax")

DTYPES = ("auto", "float32", "bfloat16", "float16")
POOLS = ("per-layer", "shared")  # strata_jax.offload.slot_table.POOLS
PLE_TABLES = ("auto", "device", "host")  # where qwen4exp's PLE table lives (model/layers/ple.py's memory kinds)
# ple_table="auto" keeps a table up to this size on the device (unless the experts are offloaded): the
# real one (tens of GB) never fits beside an expert cache, a test model's (KBs) costs nothing there
PLE_DEVICE_MAX = 1 << 30
MIN_PREFILL_CHUNK = 16  # the smallest prefill bucket (engine/session.py's bucket())
AUTO_PREFILL_MAX = 4096  # prefill_chunk "auto" takes at most this
# decode steps per jitted call on a GPU, where the host's launch of a step costs as much as the step
# (docs/benchmarks.md); elsewhere the launch is cheap next to the compute and tokens stream one by one
DECODE_CHUNK_GPU = 16
SPEC_DRAFTERS = ("lookup", "mtp", "draft:PATH")  # speculative decoding's drafters (engine/lookup.py, engine/draft.py)


def default_decode_chunk(platform: str) -> int:
    return DECODE_CHUNK_GPU if platform == "gpu" else 1

LAYER_SCAN = ("on", "off")
EXPERT_FETCH = ("auto", "kernel", "loop")

# the command-line flag of each option that has one (create(flags=True) names these in its errors)
FLAGS = {
    "devices": "--devices", "ctx": "--ctx", "dtype": "--dtype", "kv": "--kv", "kv_resident": "--kv-resident", "prefill_chunk": "--prefill-chunk",
    "decode_chunk": "--decode-chunk",
    "expert_slots": "--expert-slots", "vram_budget": "--vram-budget", "vram_reserve": "--vram-reserve",
    "policy": "--policy", "prefetch": "--prefetch-depth", "expert_pools": "--expert-pools", "parallel": "--parallel",
    "expert_fetch": "--expert-fetch",
    "expert_cache_state": "--expert-cache-state", "cold_experts": "--cold-experts", "promote_after": "--promote-after",
    "ple_table": "--ple-table", "spec": "--spec", "spec_max": "--spec-max",
    "rope_scaling": "--rope-scaling", "rope_scale": "--rope-scale", "yarn_orig_ctx": "--yarn-orig-ctx",
    "layer_scan": "--layer-scan", "conversation_cache_mib": "--conversation-cache-mib",
    "conversation_cache_dir": "--conversation-cache-dir", "conversation_cache_disk_mib": "--conversation-cache-disk-mib",
}

# options that only a MoE model's expert cache reads, with their defaults (check_model warns on a dense model;
# vram_budget and vram_reserve size every model's context too)
_EXPERT_OPTIONS = {"expert_slots": None, "policy": "lru", "prefetch": 0, "expert_pools": "per-layer",
                   "expert_cache_state": None, "expert_fetch": "auto", "cold_experts": None}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # context length in tokens: sizes the KV cache; None = the model's trained length, or the largest
    # context that fits the VRAM budget beside the fewest expert slots a step needs (offload/sizing.py)
    ctx: int | None = None
    # compute dtype; "auto" = bfloat16 on an accelerator, float32 on CPU (resolved() fills it)
    dtype: str = "auto"
    # the KV cache's storage: f16 (the compute dtype), q8_0 or q4_0 (32-value blocks with a float16
    # scale, model/kvquant.py), or "K,V" with separate key and value types such as "q8_0,q4_0"
    kv: str = "f16"
    # KV streaming: positions of each attention layer's cache (per row) kept on the device; the others live in
    # pinned host memory, written and read back inside each step (model/kvquant.py StreamedKV). None: all on
    # the device
    kv_resident: int | None = None
    # the devices (JAX's indices) whose memory holds the expert cache: several split its slot pools, dense
    # weights and KV replicated on each (core/cards.py); None: every GPU where there are several, else the
    # first device
    devices: tuple[int, ...] | None = None
    # prompt tokens per jitted prefill call at most, a power of two >= 16 so prefill compiles O(log n)
    # shapes (a prompt's last chunk takes the smallest that holds it); "auto": the longest up to
    # AUTO_PREFILL_MAX whose activations take at most 1/8 of the device memory and cost no context
    # against 512 (512 where no memory figure is known: engine/model.py resolve_prefill_chunk)
    prefill_chunk: int | str = "auto"
    # decode steps per jitted call (the token loop runs on the device); None = 16 on a GPU, where a
    # step's launch costs as much as the step, 1 elsewhere, where tokens then stream one by one
    decode_chunk: int | None = None
    # dequantize dense weights at load (faster steps, more memory) or keep GGML blocks; None = on CPU only
    dequantize_dense: bool | None = None
    # MoE: total expert slots on the device; None = as many as vram_budget holds
    expert_slots: int | None = None
    # device bytes to use (given as 32GiB, 24GB, or bytes): sizes the context and the expert cache; None =
    # the device's free memory (none known on CPU: no limit)
    vram_budget: int | None = None
    # bytes kept free for XLA workspace and fragmentation; None = 1 GiB (offload/sizing.py)
    vram_reserve: int | None = None
    # MoE: the cache policy: lru, lfu, lrfu, lrfu(L), static:FILE.npy (a saved profile or trace), or a Policy
    policy: Any = "lru"
    # MoE: MoE layers ahead whose predicted experts each layer prefetches (0 = off: fetches are not yet
    # overlapped with compute, so the mispredicted traffic costs more than the misses it saves)
    prefetch: int = 0
    # MoE: a slot pool per MoE layer (an equal share each) or one shared by layers of the same expert types
    expert_pools: str = "per-layer"
    # how a step copies its misses from the host store: "kernel" one call per layer reading the pinned store
    # (core/hostrows.py), "loop" a copy per miss; "auto" the kernel on a GPU where it builds
    expert_fetch: str = "auto"
    # MoE, offloading: a directory for the expert cache's state (which expert sits in which slot, the
    # policy's metadata), restored at load when it was saved for this model, slot plan and policy, and
    # saved by Model.save_expert_cache (serve on shutdown, generate at its end); None = start cold
    expert_cache_state: str | None = None
    # MoE, offloading: a second GGUF of the same model with lower-bit experts (mixed precision): a miss is
    # served from its copy (fewer bytes over PCIe, nothing evicted) until the expert has been used
    # promote_after times that way (or while the cache has free slots), then fetched into the cache at the
    # model's own type (0: always; -1: never, every miss low-bit)
    cold_experts: str | None = None
    promote_after: int = 2
    # KV-cache rows (requests decoded at once, a server's --parallel) the expert cache leaves room for
    parallel: int = 1
    # qwen4exp's PLE n-gram table: "device", "host" (pinned host memory: only the rows a step gathers
    # cross the bus) or "auto": host when the experts are offloaded or the table is over 1 GiB
    ple_table: str = "auto"
    # RoPE scaling over the file's rope.scaling.* (llama.cpp's flags): "none", "linear" or "yarn"; the factor
    # (the context multiple); YaRN's original context (default: the file's). None: the file's. A scaled
    # model's trained context, which ctx defaults to, becomes the original context x the factor
    rope_scaling: str | None = None
    rope_scale: float | None = None
    yarn_orig_ctx: int | None = None
    # speculative decoding: None (off), "lookup" (drafts are n-gram matches over the prompt and output so
    # far), "mtp" (the model's MTP block drafts: model/mtp.py) or "draft:PATH" (a small GGUF with the same
    # vocabulary drafts greedily: engine/draft.py); the
    # drafts are verified in one multi-token pass that shares its expert fetches
    spec: str | None = None
    # drafted tokens per verify pass at most
    spec_max: int = 4
    # keep the routed experts of every token (Model.routing_trace(), for the offload simulator)
    record_routing: bool = False
    # which kernel each jitted program traces (model/kernels.py); default from the environment
    kernels: Kernels = dataclasses.field(default_factory=Kernels)
    # keep compiled programs on disk so a second start skips XLA compilation
    compilation_cache: bool = True
    # alike layers (same types, shapes, expert pool) compiled once as a scanned body over their stacked
    # params (model/runs.py), "on"; "off" unrolls every layer (compile time grows with the layer count)
    layer_scan: str = "on"
    # host RAM for finished conversations whose rows were taken (engine/convcache.py), MiB; 0: none
    conversation_cache_mib: int = 0
    # a folder keeping them across restarts (None: none), and its cap in MiB
    conversation_cache_dir: str | None = None
    conversation_cache_disk_mib: int = 8192

    def __post_init__(self):
        # a directly built config is checked too (keyword names in errors); create() normalized it already
        for name, value in _check_all(self.options(), {}, text=False).items():
            object.__setattr__(self, name, value)

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, *, flags: bool | Mapping[str, str] = False, **options: Any) -> "EngineConfig":
        """A validated config from keyword options; what is not given takes its default, or the
        environment's for kernels and compilation_cache. flags: True (or an option -> flag mapping) when
        the options come from a command line: errors name the flags and integers may be text."""
        names = FLAGS if flags is True else dict(flags or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                              f"the engine options are: {', '.join(OPTIONS)}.")
        if "kernels" not in options:
            options["kernels"] = kernels_from_env()
        if "compilation_cache" not in options:
            options["compilation_cache"] = compilation_cache_from_env()
        return cls(**_check_all(options, names, text=bool(flags)))

    def options(self) -> dict[str, Any]:
        """The fields as keyword options (shallow: kernels stays a Kernels)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **options: Any) -> "EngineConfig":
        """A copy with these options changed, validated as create() validates them."""
        return EngineConfig.create(**{**self.options(), **options})

    # -- later steps ----------------------------------------------------------------------------------
    def check_model(self, model_config) -> "EngineConfig":
        """Against the model (a ModelConfig, once the GGUF header is read): a warning for ctx past the
        trained length and for expert-cache options a dense model ignores; a ConfigError for a kv type
        the model's cache cannot take."""
        from strata_jax.model.kvquant import check_model_kv  # noqa: PLC0415 - jax loads with the model

        trained = model_config.context_length
        if self.ctx is not None and self.ctx > trained:
            log.warning("ctx %d exceeds the model's trained context %d; quality may degrade past it", self.ctx, trained)
        if self.kv != "f16":
            check_model_kv(self.kv, model_config)
        if not model_config.is_moe:
            given = [k for k, default in _EXPERT_OPTIONS.items() if getattr(self, k) != default]
            if given:
                log.warning("%s ignored: %s is a dense model, it has no expert cache",
                            ", ".join(given), model_config.arch)
        if self.ple_table != "auto" and getattr(model_config, "ple", None) is None:
            log.warning("ple_table=%r ignored: the model has no PLE table", self.ple_table)
        if self.prefetch and model_config.is_hybrid:
            # model/hybrid.py does not prefetch (each qwen4exp MoE layer routes its own hyper-connection mix,
            # which only that layer computes: no earlier residual stream predicts it)
            raise ConfigError(f"prefetch={self.prefetch} (--prefetch-depth) is not supported for "
                              f"{model_config.arch}: the hybrid forward (gated DeltaNet layers) does not prefetch "
                              "experts; use prefetch=0.")
        return self

    def resolved(self, platform: str) -> "EngineConfig":
        """The platform defaults filled in for a device of this platform ("gpu", "cpu", ...)."""
        dtype = self.dtype if self.dtype != "auto" else "float32" if platform == "cpu" else "bfloat16"
        return dataclasses.replace(
            self, dtype=dtype,
            decode_chunk=self.decode_chunk if self.decode_chunk is not None else default_decode_chunk(platform),
            dequantize_dense=self.dequantize_dense if self.dequantize_dense is not None else platform == "cpu",
            kernels=dataclasses.replace(self.kernels, platform=platform))


OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def check_option(name: str, value: Any, *, flag: bool = False) -> Any:
    """One option checked and normalized as EngineConfig checks it, for a caller that takes it on its own
    (the server's --parallel); flag=True names its command-line flag in the error."""
    return _check_all({name: value}, FLAGS if flag else {}, text=flag)[name]


# -- the environment's defaults ---------------------------------------------------------------------------

def kernels_from_env() -> Kernels:
    """Kernels from STRATA_JAX_QMATVEC (1 on, 0 off, unset or empty auto), STRATA_JAX_MOE_PREFILL,
    STRATA_JAX_STATE_ROWS (as QMATVEC), STRATA_JAX_PREFILL_CACHED (1 on, else off), STRATA_JAX_FLOAT_STACK
    (copy | kernel), STRATA_JAX_QMATVEC_SPLIT (1 auto, else off) and STRATA_JAX_PREFILL_SUBCHUNK (tokens, 0 off)."""
    q = os.environ.get("STRATA_JAX_QMATVEC", "")
    if q not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_QMATVEC={q!r} is invalid: set 1 (the fused kernel wherever it takes the "
                          "type), 0 (never) or leave it unset (auto: the kernel for the types and sizes model/qmatvec.py "
                          "picks it for).")
    moe = os.environ.get("STRATA_JAX_MOE_PREFILL", "") or "dense"
    if moe not in MOE_PREFILL:
        raise ConfigError(f"STRATA_JAX_MOE_PREFILL={moe!r} is invalid: set dense (the default), blocked or grouped, "
                          "or leave it unset.")
    rows = os.environ.get("STRATA_JAX_STATE_ROWS", "")
    if rows not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_STATE_ROWS={rows!r} is invalid: set 1 (the row kernels for the scanned "
                          "layers' recurrent state), 0 (dynamic slices) or leave it unset (auto: the kernels on a GPU).")
    cached = os.environ.get("STRATA_JAX_PREFILL_CACHED", "")
    if cached not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_PREFILL_CACHED={cached!r} is invalid: set 1 (a prefill reads the experts the "
                          "cache holds from their slots, copying only the others) or 0 / unset (it copies them all).")
    fs = os.environ.get("STRATA_JAX_FLOAT_STACK", "") or "copy"
    if fs not in FLOAT_STACK:
        raise ConfigError(f"STRATA_JAX_FLOAT_STACK={fs!r} is invalid: set kernel (a scanned layer's float matrices "
                          "read in their stack by the fused kernel), copy (the default) or leave it unset.")
    split = os.environ.get("STRATA_JAX_QMATVEC_SPLIT", "")
    if split not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_QMATVEC_SPLIT={split!r} is invalid: set 1 (the fused kernel splits the rows of a "
                          "call of few tiles into more programs, split-K), 0 or leave it unset (never).")
    sub = os.environ.get("STRATA_JAX_PREFILL_SUBCHUNK", "") or "0"
    if not sub.isdigit():
        raise ConfigError(f"STRATA_JAX_PREFILL_SUBCHUNK={sub!r} is invalid: give a token count (a prefill chunk runs "
                          "each layer over sub-chunks of that many tokens, its experts streamed once), or 0 / unset.")
    on_off = {"": "auto", "0": "off", "1": "on"}
    return Kernels(qmatvec=on_off[q], moe_prefill=moe, state_rows=on_off[rows],
                   prefill_cached="on" if cached == "1" else "off", float_stack=fs,
                   qmatvec_split="auto" if split == "1" else "off", prefill_subchunk=int(sub))


def compilation_cache_from_env() -> bool:
    v = os.environ.get("STRATA_JAX_COMPILATION_CACHE", "")
    if v not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_COMPILATION_CACHE={v!r} is invalid: set 0 (no on-disk cache of compiled "
                          "programs) or 1, or leave it unset (on).")
    return v != "0"


def xla_options_from_env(program: str = "decode") -> tuple[tuple[str, bool | int | float | str], ...]:
    """XLA debug options for one program alone ("decode" or "prefill") from STRATA_JAX_XLA_DECODE /
    STRATA_JAX_XLA_PREFILL, written as in XLA_FLAGS (`--xla_name=value ...`): XLA_FLAGS applies to every
    program of the process. E.g. a prefill whose streamed experts may overlap its compute:
    STRATA_JAX_XLA_PREFILL=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN (the
    set without WHILE and CONDITIONAL; per program, the list is whole: no +/- edits)."""
    var = f"STRATA_JAX_XLA_{program.upper()}"
    out = []
    for item in os.environ.get(var, "").split():
        name, eq, value = item.removeprefix("--").partition("=")
        if not name.startswith("xla_") or not eq:
            raise ConfigError(f"{var} has {item!r}: write each option as --xla_name=value, "
                              "separated by spaces, as in XLA_FLAGS.")
        out.append((name, _xla_value(value)))
    return tuple(sorted(out))


def _xla_value(text: str) -> bool | int | float | str:
    """An XLA option's value typed as its DebugOptions field wants it (compiler_options takes no text bool)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# -- the checks -------------------------------------------------------------------------------------------

def _show(name: str, value: Any) -> str:
    return f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"


def _bad(name: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"{_show(name, value)} is invalid: it must be {want}.")


def _int(value: Any, name: str, text: bool, low: int, want: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if text and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _bad(name, value, want) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(name, value, want)
    return int(value)


def _float(value: Any, name: str, low: float, want: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    try:
        v = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise _bad(name, value, want) from None
    if isinstance(value, bool) or not v >= low or v == float("inf"):
        raise _bad(name, value, want)
    return v


def _bool(value: Any, name: str, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise _bad(name, value, "True or False" + (" (or None: the platform default)" if optional else ""))
    return value


def _dtype(value: Any, name: str) -> str:
    if isinstance(value, str):
        if value in DTYPES:
            return value
    elif value is not None:
        import jax.numpy as jnp  # a dtype object (jnp.bfloat16, np.float32): its name

        try:
            n = jnp.dtype(value).name
        except TypeError:
            n = None
        if n in DTYPES:
            return n
    raise _bad(name, value, "one of " + ", ".join(DTYPES) + " (auto: bfloat16 on an accelerator, float32 on CPU)")


def _size(value: Any, name: str) -> int | None:
    if value is None:
        return None
    return parse_size(value, name)


def _policy(value: Any, name: str) -> Any:
    from strata_jax.offload.policies import Policy, get_policy

    if isinstance(value, Policy):
        return value
    if not isinstance(value, str):
        raise _bad(name, value, "a policy name (lru, lfu, lrfu, lrfu(LAMBDA), static:FILE.npy) or a Policy")
    if value.startswith("static:"):
        _check_profile(value[len("static:"):], name)
        return value
    try:
        get_policy(value)  # parses the name
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None
    return value


def _check_profile(path: str, name: str) -> None:
    """A static policy's .npy exists, is readable and has a profile's or a trace's rank; only its header
    is read here (a routing trace may be large), the manager reads the data."""
    import numpy as np

    save = "save a [layers, experts] profile or a [tokens, layers, k] routing trace with numpy.save"
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read the static policy's profile {path!r} ({e}); {save}") from None
    if getattr(arr, "ndim", None) not in (2, 3):
        raise ConfigError(f"{name}: {path!r} holds {getattr(arr, 'shape', 'no single array')}, not a profile or "
                          f"a trace; {save}")


def _gguf_file(value: Any, name: str) -> str | None:
    """An existing GGUF file (its first shard for a split model), or None."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise _bad(name, value, "the path of a GGUF file (the same model with lower-bit experts) or None")
    path = os.path.abspath(os.path.expanduser(os.fspath(value)))
    if not os.path.isfile(path):
        raise ConfigError(f"{_show(name, value)} is not a file: give the path of a GGUF of the same model with "
                          "lower-bit experts (e.g. an IQ2_XXS quantization of it).")
    return path


def _cache_state(value: Any, name: str) -> str | None:
    """A directory the expert cache's state can be saved in: it exists or its parent does, and is writable
    (checked now, so a run does not end unable to save)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise _bad(name, value, "a directory path (where the expert cache's state is kept; created if missing) "
                                "or None")
    path = os.path.abspath(os.path.expanduser(os.fspath(value)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{_show(name, value)} is a file, not a directory: give a directory for the expert "
                          "cache's state (created if missing), e.g. ~/.cache/strata-jax/expert-state.")
    where = path if os.path.isdir(path) else os.path.dirname(path)
    if not os.path.isdir(where):
        raise ConfigError(f"{_show(name, value)} is invalid: its parent directory {where} does not exist; create "
                          "it or give another directory.")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"{_show(name, value)} is invalid: {where} is not writable, so the expert cache's state "
                          "could not be saved there; give a writable directory.")
    return path


def _prefetch(value: Any, name: str, text: bool) -> int:
    if isinstance(value, bool):
        return int(value)
    return _int(value, name, text, 0, "a depth >= 0 (MoE layers ahead to prefetch; True/False mean 1/0)")


def _folder(value: Any, name: str) -> str:
    """A folder that exists or can be made, and is writable."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise _bad(name, value, "a folder path")
    path = os.fspath(value)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{_show(name, value)} is invalid: cannot create the folder ({e.strerror}); give a "
                          "writable folder.") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{_show(name, value)} is invalid: the folder is not writable; give a writable folder.")
    return path


def _devices(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        ids = tuple(int(str(i).strip()) for i in items)
    except ValueError:
        ids = ()
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"{name}={value!r} is invalid: give distinct device indices, e.g. 0,1 (JAX's devices: "
                          "nvidia-smi's order), or leave it unset (every GPU).")
    return ids


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _bad(name, value, " or ".join(map(repr, choices)))
    return value


def _prefill_chunk(value: Any, name: str, text: bool) -> int | str:
    if value == "auto":
        return value
    want = f"a power of two >= {MIN_PREFILL_CHUNK} (prompt tokens per jitted call), or 'auto'"
    v = _int(value, name, text, MIN_PREFILL_CHUNK, want)
    if v & (v - 1):
        raise _bad(name, v, want)
    return v


def _kv(value: Any, name: str) -> str:
    from strata_jax.model.kvquant import check_kv  # noqa: PLC0415 - jax loads with the model

    return check_kv(value, name)


def _kernels(value: Any, name: str) -> Kernels:
    if not isinstance(value, Kernels):
        raise _bad(name, value, "a strata_jax.model.kernels.Kernels")
    return value


def _check_all(options: dict[str, Any], names: Mapping[str, str], text: bool) -> dict[str, Any]:
    """Each given option checked and normalized, in field order (errors name names[option] or option)."""
    n = lambda k: names.get(k, k)  # noqa: E731
    checks = {
        "ctx": lambda v: _int(v, n("ctx"), text, 1, "a positive context length in tokens (or None: the "
                                                    "model's trained length, cut to what fits the VRAM budget)",
                              optional=True),
        "dtype": lambda v: _dtype(v, n("dtype")),
        "kv": lambda v: _kv(v, n("kv")),
        "kv_resident": lambda v: _int(v, n("kv_resident"), text, 1, "a positive number of KV-cache positions per "
                                      "layer kept on the device (the rest streamed from host memory), or None (all)",
                                      optional=True),
        "prefill_chunk": lambda v: _prefill_chunk(v, n("prefill_chunk"), text),
        "devices": lambda v: _devices(v, n("devices")),
        "decode_chunk": lambda v: _int(v, n("decode_chunk"), text, 1, "a positive integer (decode steps per jitted "
                                       "call; None: 16 on a GPU, 1 elsewhere)", optional=True),
        "dequantize_dense": lambda v: _bool(v, n("dequantize_dense"), optional=True),
        "expert_slots": lambda v: _int(v, n("expert_slots"), text, 1, "a positive integer (total expert slots) or "
                                       "None (as many as the VRAM budget holds)", optional=True),
        "vram_budget": lambda v: _size(v, n("vram_budget")),
        "vram_reserve": lambda v: _size(v, n("vram_reserve")),
        "policy": lambda v: _policy(v, n("policy")),
        "prefetch": lambda v: _prefetch(v, n("prefetch"), text),
        "expert_pools": lambda v: _choice(v, n("expert_pools"), POOLS),
        "expert_cache_state": lambda v: _cache_state(v, n("expert_cache_state")),
        "cold_experts": lambda v: _gguf_file(v, n("cold_experts")),
        "promote_after": lambda v: _int(v, n("promote_after"), text, -1, "an integer >= -1 (low-bit uses of an expert "
                                        "before it is fetched into the cache at the model's own type; 0: always, "
                                        "-1: never)"),
        "parallel": lambda v: _int(v, n("parallel"), text, 1, "an integer >= 1 (requests decoded at once, each "
                                   f"holding a KV-cache row of {n('ctx')} tokens)"),
        "ple_table": lambda v: _choice(v, n("ple_table"), PLE_TABLES),
        "rope_scaling": lambda v: v if v is None else _choice(v, n("rope_scaling"), ROPE_SCALINGS),
        "rope_scale": lambda v: _float(v, n("rope_scale"), 1.0, "a factor >= 1 (the context multiple: 4 fits "
                                      "4x the original context)", optional=True),
        "yarn_orig_ctx": lambda v: _int(v, n("yarn_orig_ctx"), text, 1, "a positive context length (the model's "
                                        "original trained context)", optional=True),
        "spec": lambda v: v if v is None else check_spec(v, n("spec")),
        "spec_max": lambda v: _int(v, n("spec_max"), text, 1, "a positive integer (drafted tokens per verify pass)"),
        "conversation_cache_mib": lambda v: _int(v, n("conversation_cache_mib"), text, 0, "an integer >= 0 (MiB of "
                                                 "host RAM for conversations whose KV-cache rows were taken; 0: none)"),
        "conversation_cache_dir": lambda v: v if v is None else _folder(v, n("conversation_cache_dir")),
        "conversation_cache_disk_mib": lambda v: _int(v, n("conversation_cache_disk_mib"), text, 1, "a positive "
                                                      "integer (MiB of disk for saved conversations)"),
        "record_routing": lambda v: _bool(v, n("record_routing")),
        "kernels": lambda v: _kernels(v, n("kernels")),
        "compilation_cache": lambda v: _bool(v, n("compilation_cache")),
        "layer_scan": lambda v: _choice(v, n("layer_scan"), LAYER_SCAN),
        "expert_fetch": lambda v: _choice(v, n("expert_fetch"), EXPERT_FETCH),
    }
    return {k: checks[k](options[k]) for k in checks if k in options}
