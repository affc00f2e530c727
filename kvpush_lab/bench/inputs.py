"""What the workload is built from: the model, its vocabulary, length traces.

The thin I/O shell around :mod:`kvpush_lab.bench.workload`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from kvpush import env
from kvpush.model import ModelSpec, default_model_dir
from kvpush.model.kv_size import num_layers
from kvpush.model.presets import ensure_preset, preset_dir
from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.lengths import read_trace
from kvpush_lab.bench.workload import Traces


def model_spec(config: BenchConfig) -> ModelSpec | None:
    """The spec of a non-default model size (None: the default tiny model)."""
    sizes = (
        config.model_layers,
        config.model_hidden_size,
        config.model_kv_heads,
        config.model_head_dim,
    )
    if sizes == (None, None, None, None):
        return None
    base = ModelSpec()
    kv_heads = config.model_kv_heads or base.num_kv_heads
    hidden = config.model_hidden_size or base.hidden_size
    heads = kv_heads * -(-base.num_heads // kv_heads)  # a multiple of kv_heads
    return ModelSpec(
        num_layers=config.model_layers or base.num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=config.model_head_dim or base.head_dim,
        intermediate_size=2 * hidden,
    )


def resolve_model(config: BenchConfig, console: Console) -> Path:
    """The model directory to serve, building a generated model if needed."""
    if config.model is not None:
        if not (config.model / "config.json").is_file():
            raise ValueError(f"model {config.model} is not a model directory")
        return config.model
    home = env.kvpush_home()
    if config.model_preset is not None:
        target = preset_dir(home, config.model_preset)
        with console.status(f"preparing the model in {target}"):
            return ensure_preset(home, config.model_preset)
    spec = model_spec(config)
    if spec is None:
        target, spec = default_model_dir(home), ModelSpec()
    else:
        name = model_dir_name(spec)
        target = home / "models" / name
    from kvpush.model import ensure_model  # torch: only to build one

    with console.status(f"preparing the model in {target}"):
        return ensure_model(target, spec)


def model_dir_name(spec: ModelSpec) -> str:
    """The directory name of a generated model size (the head size only
    when it is not the tiny model's, so older names stay)."""
    name = f"tiny-qwen3-l{spec.num_layers}-h{spec.hidden_size}-kv{spec.num_kv_heads}"
    if spec.head_dim != ModelSpec().head_dim:
        name += f"-d{spec.head_dim}"
    return name


def describe_model(model_dir: Path) -> str:
    """Name and shape of a model, from its config.json."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return model_dir.name
    try:
        layers: int | str = num_layers(cfg)
    except (KeyError, TypeError, ValueError):
        layers = "?"
    shape = [
        f"{layers} layers",
        f"hidden {cfg.get('hidden_size', '?')}",
        f"{cfg.get('num_attention_heads', '?')} heads / "
        f"{cfg.get('num_key_value_heads', '?')} KV heads of "
        f"{cfg.get('head_dim', '?')}",
        f"vocab {cfg.get('vocab_size', '?')}",
    ]
    return f"{model_dir.name} ({', '.join(shape)})"


def normal_token_ids(model_dir: Path) -> list[int]:
    """Token ids of the model's tokenizer that are neither special nor added:
    any sequence of them encodes to exactly that many prompt tokens."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {e}") from e
    excluded = set(tokenizer.all_special_ids)
    excluded |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return sorted(set(tokenizer.get_vocab().values()) - excluded)


def load_traces(config: BenchConfig) -> Traces:
    """Lengths from the trace files the config names (if any)."""
    prompt, output = config.prompt_spec, config.output_spec
    prompt_lens = (
        read_trace(prompt.path, "prompt_len")
        if prompt.kind == "trace" and prompt.path and not config.prompt_len_sweep
        else []
    )
    output_lens = (
        read_trace(output.path, "output_len")
        if output.kind == "trace" and output.path
        else []
    )
    return Traces(tuple(prompt_lens), tuple(output_lens))
