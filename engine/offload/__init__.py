"""Expert offload: the routed experts live in host memory, a few per layer on the device.

- `plan`: how a device budget is spent (`OffloadPlan`: dense parts, decode slots, workspace, expert slots);
- `cache`: one MoE layer's `ExpertCache` (slots, copies on a side `Lane`, reads in place);
- `stream`: long chunks stream every layer's experts whole (`ExpertStream`);
- `policy`: what a forward does with the link, by its token count (`ExpertCachePolicy`, `Link`);
- `runtime`: every layer's cache, their counters and the budget at run time (`ExpertOffload`);
- `install`: moving a model's routed experts into host memory and the caches onto its layers;
- `stats`: what the caches did (`OffloadStats`).
"""

from engine.offload.install import expert_bytes, expert_store, held_experts, install, quantized_store
from engine.offload.plan import (
    BudgetError,
    GiB,
    OffloadPlan,
    budget_for,
    dense_bytes,
    kv_bytes,
    plan,
    recurrent_bytes,
    state_bytes,
    workspace_bytes,
)
from engine.offload.policy import ExpertCachePolicy, Link, measure_link
from engine.offload.runtime import ExpertOffload
from engine.offload.stats import OffloadStats, hit_ratio

__all__ = [
    "BudgetError",
    "ExpertCachePolicy",
    "ExpertOffload",
    "GiB",
    "Link",
    "OffloadPlan",
    "OffloadStats",
    "budget_for",
    "dense_bytes",
    "expert_bytes",
    "expert_store",
    "held_experts",
    "hit_ratio",
    "install",
    "kv_bytes",
    "measure_link",
    "plan",
    "quantized_store",
    "recurrent_bytes",
    "state_bytes",
    "workspace_bytes",
]
