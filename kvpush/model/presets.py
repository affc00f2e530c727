"""Named model shapes: ``tiny`` (the default), ``kv-heavy``, and one tiny
model per family whose KV cache vLLM shapes differently (``mla``, ``swa``,
``hybrid``, ``moe``, ``gdn``, ``shortconv``; :mod:`kvpush.model.families`,
docs/model-families.md). ``gdn`` is bfloat16, the one dtype vLLM's CPU
build runs gated delta net in; ``kvpush up --model-preset gdn`` serves it so.

``kv-heavy`` is shaped so that moving the KV cache matters: 8 layers, 8 KV
heads of dim 128, hidden 256, float32, so ``2 * 8 * 8 * 128 * 4`` =
65,536 bytes (64 KiB) of KV per token, 32x the tiny model's 2,048; an
8k-token prompt is 512 MiB of KV. Its ``max_position_embeddings`` is 8192,
so ``--max-model-len`` is 8192. A preset also sizes the launcher's KV
space per instance (``VLLM_CPU_KVCACHE_SPACE``): 1 GB holds only two
8k-token kv-heavy prompts; 4 GB holds eight.

``kvpush make-model --preset NAME DIR`` makes one; ``kvpush up
--model-preset NAME`` makes it on first use under
``$KVPUSH_HOME/models/<dir_name>`` and applies its KV space and model
length unless they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpush.model.families import kv_bytes_per_token
from kvpush.model.spec import ModelSpec


@dataclass(frozen=True)
class Preset:
    """A model shape and the launcher settings it needs."""

    spec: ModelSpec
    dir_name: str
    kv_cache_space_gb: int
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers that keep one (keys and
        values per KV head, or MLA's latent), in the spec's dtype."""
        return kv_bytes_per_token(self.spec)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(ModelSpec(), "tiny-qwen3", 1, 4096),
    "kv-heavy": Preset(
        ModelSpec(
            num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=128
        ),
        "kv-heavy-qwen3",
        kv_cache_space_gb=4,
        max_model_len=8192,
    ),
    "mla": Preset(
        ModelSpec(family="mla", num_kv_heads=4), "tiny-mla-deepseek-v2", 1, 4096
    ),
    "swa": Preset(ModelSpec(family="swa", num_layers=6), "tiny-swa-gemma3", 1, 4096),
    "hybrid": Preset(
        ModelSpec(family="hybrid", num_layers=6), "tiny-hybrid-nemotron-h", 1, 4096
    ),
    "moe": Preset(ModelSpec(family="moe"), "tiny-moe-qwen3", 1, 4096),
    "gdn": Preset(
        ModelSpec(family="gdn", num_layers=4, dtype="bfloat16"),
        "tiny-gdn-qwen3-next",
        1,
        4096,
    ),
    "shortconv": Preset(
        ModelSpec(family="shortconv", num_layers=6), "tiny-shortconv-lfm2", 1, 4096
    ),
}


def preset(name: str) -> Preset:
    """The preset called ``name``; ValueError naming the choices otherwise."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}"
        )
    return PRESETS[name]


def preset_dir(home: Path, name: str) -> Path:
    """Where ``kvpush up --model-preset name`` keeps the model."""
    return Path(home) / "models" / preset(name).dir_name


def ensure_preset(home: Path, name: str) -> Path:
    """The preset's model under ``home``, made on first use."""
    from kvpush.model.make import ensure_model

    return ensure_model(preset_dir(home, name), preset(name).spec)
