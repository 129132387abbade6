"""Model configuration read from an HF `config.json` (Qwen3-Next and Qwen3.5/3.6-MoE, text only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}


class ConfigError(ValueError):
    """The model folder's config cannot be served by this engine."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "qwen3_next" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        text = raw.get("text_config") or raw
        return cls._from_text_config(arch, text, raw)

    @classmethod
    def _from_text_config(cls, arch: str, c: dict, outer: dict) -> ModelConfig:
        try:
            n_layers = c["num_hidden_layers"]
            layer_types = c.get("layer_types") or [
                "full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear_attention"
                for i in range(n_layers)
            ]
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            eos = c.get("eos_token_id", outer.get("eos_token_id"))
            return cls(
                arch=arch,
                vocab_size=c["vocab_size"],
                hidden_size=c["hidden_size"],
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=c["num_attention_heads"],
                num_key_value_heads=c["num_key_value_heads"],
                head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))),
                linear_num_key_heads=c["linear_num_key_heads"],
                linear_num_value_heads=c["linear_num_value_heads"],
                linear_key_head_dim=c["linear_key_head_dim"],
                linear_value_head_dim=c["linear_value_head_dim"],
                linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4),
                num_experts=c["num_experts"],
                num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c["moe_intermediate_size"],
                shared_expert_intermediate_size=c["shared_expert_intermediate_size"],
                norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=c.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
                eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing {exc.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json (is this an HF model folder?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(raw)
