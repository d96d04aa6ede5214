"""Expert offloading: cache policies, the device slot table, the host store, and the trace simulator."""

from strata_jax.offload.policies import (LFU, LRFU, LRU, POLICIES, CacheState, Plan, Policy, belady_policy,
                                         get_policy, lrfu_policy, static_policy, usage_profile)
from strata_jax.offload.simulate import load_trace, simulate

__all__ = ["LFU", "LRFU", "LRU", "POLICIES", "CacheState", "Plan", "Policy", "belady_policy", "get_policy",
           "load_trace", "lrfu_policy", "simulate", "static_policy", "usage_profile"]
