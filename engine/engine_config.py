"""`EngineConfig`: every choice of how the engine runs a model, in one frozen value.

The model itself (its folder or preset) and its shape (`ModelConfig`) are not here: this is how
to run it. `ft serve` builds one from its flags (a memory-fitting step may fill the sizes) and
hands it to `Engine.load`; derived values are properties. Fields are plain values so that a
config can be written, compared and replaced (`dataclasses.replace`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel import ExpertParallel

# tokens per prefill forward by device type: a GPU's GEMMs keep its tensor cores busier the more rows they take
DEFAULT_CHUNK = {"cuda": 8192, "cpu": 4096}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs its model.

    - `device`: torch device name (`cpu`, `cuda`, `cuda:1`).
    - `dtype`: the weights' and states' dtype; None keeps the checkpoint's (a GGUF file
      dequantizes to bf16 on a GPU, fp32 on the CPU).
    - `max_running`: sequences decoded together (one batched forward a step): the decode slots
      and CUDA graphs warm-up prepares, the slots an offload plan counts, and the requests the
      gateway runs at once.
    - `prefill_chunk`: tokens of one prefill forward; None: `DEFAULT_CHUNK` of the device.
    - `max_context`: tokens a sequence may reach, prompt and output (longer prompts are refused);
      None: the model's. A memory plan sets what its decode slots and expert cache leave room for.
    - `decode_step_prefill`: prefill tokens a step carries beside decode rows (a long prompt
      then goes in chunks of this many while other sequences decode); None: the whole chunk.
    - `cuda_graphs`: decode steps and short prefills replay CUDA graphs (on a GPU).
    - `gpu_memory_gib`: a device memory budget: the routed experts stay in host memory and
      the device holds the dense weights, the decode slots and an expert cache within it
      (`engine.offload`); None: everything on the device.
    - `keep_quantized`: a quantized checkpoint's weights stay packed and run through the
      Triton kernels; None: on a GPU, and for offloaded experts on a GPU.
    - `step_log_ms`: log every prefill forward (and, in the gateway, every step) slower than
      this many ms, split by part; a sync after each forward: a diagnostic, not a serving mode.
    - `expert_parallel`: this process's rank in a `torch.distributed` group that splits the routed
      experts (`engine.parallel`: the group is initialised before loading); None: one process
      holds them all. With a memory budget, each rank offloads its own experts within it.
    - `head_split`: under expert parallel, the attention and DeltaNet layers split by heads over
      the ranks too (`engine.head_split`); False: replicated on every rank. Not with a memory budget.
    """

    device: str = "cpu"
    dtype: torch.dtype | None = None
    max_running: int = 4
    prefill_chunk: int | None = None
    max_context: int | None = None
    decode_step_prefill: int | None = None
    cuda_graphs: bool = True
    gpu_memory_gib: float | None = None
    keep_quantized: bool | None = None
    step_log_ms: float | None = None
    expert_parallel: ExpertParallel | None = None
    head_split: bool = False

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running: expected at least 1 sequence, got {self.max_running}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: expected at least 1 token, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context: expected at least 2 tokens, got {self.max_context}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ValueError(f"gpu_memory_gib: expected a size > 0, got {self.gpu_memory_gib}")
        if self.head_split and self.expert_parallel is None:
            raise ValueError("head_split: the heads are split over the ranks of expert parallel, and there are none")
        if self.head_split and self.offloaded:
            raise ValueError("head_split: not with offloaded experts (a memory budget): run the layers replicated")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per prefill forward."""
        return self.prefill_chunk or DEFAULT_CHUNK.get(self.torch_device.type, 4096)

    @property
    def decode_slots(self) -> int:
        """Decode slots for `max_running` sequences: the runner's batch bucket (a power of two)."""
        return 1 << (self.max_running - 1).bit_length()

    @property
    def offloaded(self) -> bool:
        """Whether the routed experts are offloaded to host memory (a device memory budget)."""
        return self.gpu_memory_gib is not None

    @property
    def graphs(self) -> bool:
        """Whether CUDA graphs may run: asked for, on a GPU."""
        return self.cuda_graphs and self.torch_device.type == "cuda"

    @property
    def quantized_on_load(self) -> bool | None:
        """`keep_quantized` as loading applies it: under a budget on a GPU, None becomes True (the
        offloaded experts live and move in their quantized form)."""
        if self.keep_quantized is None and self.offloaded:
            return self.torch_device.type == "cuda"
        return self.keep_quantized
