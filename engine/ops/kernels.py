"""The ops the model calls, as one bundle (`Kernels`): the reference implementations by default; the GPU's
(engine/ops/gpu/) replace them field by field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.ops import attention, conv, deltanet, gates, moe, norm, rope


@dataclass(frozen=True)
class Kernels:
    name: str
    causal_attention: Callable = attention.causal_attention
    decode_attention: Callable = attention.decode_attention  # one query per slot of stacked caches, its new KV row written
    slot_prefill_attention: Callable = attention.slot_prefill_attention  # a few queries of one slot
    causal_conv: Callable = conv.causal_conv
    chunk_gated_delta_rule: Callable = deltanet.chunk_gated_delta_rule
    causal_conv_spans: Callable = conv.causal_conv_spans  # several sequences' rows, each on its own state
    chunk_gated_delta_rule_spans: Callable = deltanet.chunk_gated_delta_rule_spans  # the same
    decode_conv_slots: Callable = conv.decode_conv_slots  # one token of each of B slotted states, in place
    decode_gated_delta_rule_slots: Callable = deltanet.decode_gated_delta_rule_slots  # the same
    deltanet_decode: Callable = deltanet.decode_step  # a decode step's conv, gates, recurrent step and gated norm
    moe_experts: Callable = moe.experts_loop
    route: Callable = moe.route  # router logits -> (weights, expert ids) of the top k
    router: Callable = moe.router  # x through the router and the shared expert's gate, then `route`
    add_rms_norm: Callable = norm.add_rms_norm  # (x + residual, its norm): the residual add fused in
    gated_rms_norm: Callable = norm.gated_rms_norm
    norm_rope: Callable = rope.norm_rope  # q_norm / k_norm, then the partial rotary embedding
    deltanet_gates: Callable = gates.deltanet_gates
    silu_mul: Callable = gates.silu_mul
    sigmoid_mul: Callable = gates.sigmoid_mul
    add_sigmoid_mul: Callable = gates.add_sigmoid_mul


REFERENCE = Kernels(name="reference")
