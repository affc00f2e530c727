"""Build a tiny causal LM and its tokenizer, deterministically and offline.

The architecture is the spec's family (:mod:`kvpush.model.families`): Qwen3
by default.

The output directory is a regular Hugging Face model directory (config,
safetensors weights, tokenizer files, generation config) that transformers and
vLLM can load.  ``kvpush_model.json`` is written last and marks the directory
as complete; :func:`ensure_model` reuses a directory whose marker matches.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from kvpush.model.corpus import iter_documents
from kvpush.model.families import hf_config
from kvpush.model.spec import SPEC_FILENAME, ModelSpec

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
VOCAB_MULTIPLE = 64
WEIGHTS_FILENAME = "model.safetensors"
REQUIRED_FILES: tuple[str, ...] = ("config.json", WEIGHTS_FILENAME, "tokenizer.json")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_DTYPE_CASTS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "float32": torch.nn.Module.float,
    "bfloat16": torch.nn.Module.bfloat16,
}
_DETERMINISM_ENV: dict[str, str] = {
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
}


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    """Temporarily set environment variables, restoring the old values afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def train_tokenizer(spec: ModelSpec) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the procedural corpus.

    Training runs single-threaded so that the learned merges, and thus the
    saved ``tokenizer.json``, are identical from run to run.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _patched_env(_DETERMINISM_ENV):
        docs = iter_documents(spec.seed, spec.corpus_bytes)
        tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, spec: ModelSpec) -> PreTrainedTokenizerFast:
    """Wrap a trained tokenizer with the ChatML special tokens and template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def padded_vocab_size(tokenizer_vocab: int) -> int:
    """Round a tokenizer vocabulary size up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def build_config(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerFast
) -> PretrainedConfig:
    """Return the configuration of ``spec``'s family matching ``tokenizer``."""
    return hf_config(
        spec.family,
        spec,
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )


def _reinitialise(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Draw every weight from ``normal(0, init_std)`` but the norms', which
    keep transformers' own initialisation: the scale of one (ones, or zeros
    where a norm multiplies by ``1 + weight``, as Gemma's and most of
    Qwen3-Next's do)."""
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, spec.init_std, generator=generator)
                param.copy_(values)


def build_model(spec: ModelSpec, config: PretrainedConfig) -> PreTrainedModel:
    """Instantiate and deterministically initialise the model in ``spec.dtype``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config)
    model.float()
    _reinitialise(model, spec)
    _DTYPE_CASTS[spec.dtype](model)
    model.eval()
    return model


def _generation_config(config: PretrainedConfig) -> GenerationConfig:
    """Return a greedy generation config carrying the special token ids."""
    return GenerationConfig(
        do_sample=False,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' progress bars while saving, restoring the previous setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_artifacts(staging: Path, spec: ModelSpec) -> None:
    """Write tokenizer, weights and configs (but not the marker) into ``staging``."""
    tokenizer = wrap_tokenizer(train_tokenizer(spec), spec)
    config = build_config(spec, tokenizer)
    model = build_model(spec, config)
    with _quiet_progress():
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging, safe_serialization=True)
        _generation_config(config).save_pretrained(staging)


def _publish(staging: Path, out_dir: Path, spec: ModelSpec) -> None:
    """Move staged files into ``out_dir`` one by one, then write the marker."""
    marker = out_dir / SPEC_FILENAME
    marker.unlink(missing_ok=True)
    for item in sorted(staging.iterdir()):
        target = out_dir / item.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(item, target)
    tmp_marker = staging / SPEC_FILENAME
    tmp_marker.write_text(spec.to_json(), encoding="utf-8")
    os.replace(tmp_marker, marker)


def make_model(out_dir: Path, spec: ModelSpec) -> Path:
    """Build the tiny model and tokenizer described by ``spec`` into ``out_dir``.

    The result is byte-identical for equal specs.  Files are built in a
    staging directory next to ``out_dir`` and moved in atomically, with
    ``kvpush_model.json`` written last, so an interrupted build is never
    mistaken for a complete one.  Other files already in ``out_dir`` are kept.

    Returns:
        ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent)
    )
    try:
        _write_artifacts(staging, spec)
        _publish(staging, out_dir, spec)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def is_complete(out_dir: Path, spec: ModelSpec) -> bool:
    """Return whether ``out_dir`` holds a finished build of exactly ``spec``."""
    out_dir = Path(out_dir)
    try:
        stored = ModelSpec.from_json(
            (out_dir / SPEC_FILENAME).read_text(encoding="utf-8")
        )
    except (OSError, ValueError, TypeError):
        return False
    if stored != spec:
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_model(out_dir: Path, spec: ModelSpec) -> Path:
    """Return ``out_dir``, first building the model there unless it matches ``spec``."""
    out_dir = Path(out_dir)
    if is_complete(out_dir, spec):
        return out_dir
    return make_model(out_dir, spec)
