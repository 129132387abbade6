"""GPU kernels, chosen by `engine.ops.kernels_for` when the model sits on a CUDA device:
fla-core's Triton Gated DeltaNet (chunked prefill, fused recurrent decode), SDPA/flash attention
with grouped KV heads, grouped-GEMM experts. Host transfers of states are the engine's
(`engine.host_transfers`): kernels import no engine type."""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import replace

import engine.ops.deltanet as reference_deltanet
from engine.ops.gpu import attention, conv, gates, moe, norm, recurrent
from engine.ops.kernels import Kernels

log = logging.getLogger(__name__)

deltanet: types.ModuleType
try:
    from engine.ops.gpu import deltanet
except ImportError as exc:  # fla-core missing: the reference scan still runs on the GPU, slowly
    log.warning("fla-core not importable (%s): Gated DeltaNet uses the reference kernels", exc)
    deltanet = reference_deltanet


KERNELS = Kernels(
    name="gpu" if deltanet is not reference_deltanet else "gpu-no-fla",
    causal_attention=attention.causal_attention,
    decode_attention=attention.decode_attention,
    slot_prefill_attention=attention.slot_prefill_attention,
    causal_conv=conv.causal_conv,
    chunk_gated_delta_rule=deltanet.chunk_gated_delta_rule,
    causal_conv_spans=conv.causal_conv_spans,
    chunk_gated_delta_rule_spans=deltanet.chunk_gated_delta_rule_spans,
    decode_conv_slots=conv.decode_conv_slots,
    decode_gated_delta_rule_slots=recurrent.checked(deltanet.decode_gated_delta_rule),
    moe_experts=moe.experts_grouped,
    route=moe.route,
    router=moe.router,
    add_rms_norm=norm.add_rms_norm,
    gated_rms_norm=norm.gated_rms_norm,
    norm_rope=norm.norm_rope,
    deltanet_gates=gates.deltanet_gates,
    silu_mul=gates.silu_mul,
    sigmoid_mul=gates.sigmoid_mul,
    add_sigmoid_mul=gates.add_sigmoid_mul,
)
# a decode step's conv, gates, recurrent step and gated norm: one launch for steps of up to
# `recurrent.FUSED_ROWS` rows, else the four kernels
KERNELS = replace(
    KERNELS, deltanet_decode=recurrent.decode_step(functools.partial(reference_deltanet.decode_step, ops=KERNELS))
)
