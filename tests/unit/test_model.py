"""Unit tests for the tiny local Qwen3 model builder (no vLLM, no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpush.model import ModelSpec, default_model_dir, ensure_model, make_model
from kvpush.model.corpus import make_corpus
from kvpush.model.make import is_complete, padded_vocab_size
from kvpush.model.spec import SPEC_FILENAME

SMALL = ModelSpec(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=512,
    corpus_bytes=200_000,
)


def _hashes(directory: Path) -> dict[str, str]:
    """Return the SHA-256 of every file in ``directory`` keyed by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _mtimes(directory: Path) -> dict[str, int]:
    """Return the nanosecond mtime of every file in ``directory``."""
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the small model once for the whole module."""
    return make_model(tmp_path_factory.mktemp("small") / "model", SMALL)


def test_same_spec_gives_byte_identical_files(
    small_model: Path, tmp_path: Path
) -> None:
    """Two builds of one spec produce exactly the same files."""
    again = make_model(tmp_path / "again", SMALL)
    first, second = _hashes(small_model), _hashes(again)
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", SPEC_FILENAME} <= set(
        first
    )


def test_no_staging_leftovers(small_model: Path) -> None:
    """The staging directory next to the output is removed after a build."""
    assert sorted(p.name for p in small_model.parent.iterdir()) == ["model"]


def test_different_seeds_give_different_weights(
    small_model: Path, tmp_path: Path
) -> None:
    """Changing the seed changes the weights."""
    other = make_model(tmp_path / "seed1", dataclasses.replace(SMALL, seed=1))
    a = load_file(small_model / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(
        a["model.embed_tokens.weight"], b["model.embed_tokens.weight"]
    )


def test_weights_follow_init_std(small_model: Path) -> None:
    """Matrices are drawn with std ``init_std``; norm weights are exactly one."""
    weights = load_file(small_model / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    assert abs(embed.std().item() - SMALL.init_std) < 0.01
    norms = [name for name in weights if "norm" in name]
    assert norms
    assert all(torch.all(weights[name] == 1.0) for name in norms)


def test_config_matches_spec_and_tokenizer(small_model: Path) -> None:
    """config.json carries the spec's shape and the tokenizer's special ids."""
    config = json.loads((small_model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    assert config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == SMALL.num_layers
    assert config["num_key_value_heads"] == SMALL.num_kv_heads
    assert config["head_dim"] == SMALL.head_dim
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == padded_vocab_size(len(tokenizer))
    assert config["vocab_size"] % 64 == 0
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["dtype"] == "float32"


def _greedy(model: Any, tokenizer: Any, prompt: str, steps: int) -> list[int]:
    """Return ``steps`` greedily generated token ids for ``prompt``."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def test_greedy_output_depends_on_prompt(small_model: Path) -> None:
    """Greedy continuations differ by prompt and are not one repeated token."""
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    first = _greedy(model, tokenizer, "Hello world, the", 8)
    second = _greedy(model, tokenizer, "A completely different prompt about code", 8)
    assert first != second
    assert len(set(first)) > 1
    assert len(set(second)) > 1


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "def f(x):\n    return x * 2  # ok",
        "  spaces\tand ünïcödé 日本 🙂",
        "",
    ],
)
def test_tokenizer_round_trips(small_model: Path, text: str) -> None:
    """Byte-level BPE decodes back to the exact input text."""
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    ids = tokenizer(text, add_special_tokens=True).input_ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(small_model: Path) -> None:
    """EOS, pad and BOS are set as specified and specials stay single tokens."""
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert len(tokenizer("<|im_start|>").input_ids) == 1
    assert SMALL.vocab_size - 64 <= len(tokenizer) <= SMALL.vocab_size


def test_chat_template_renders_chatml(small_model: Path) -> None:
    """The chat template produces Qwen-style ChatML."""
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )
    assert not no_prompt.endswith("assistant\n")


@pytest.mark.parametrize(
    "changes",
    [
        {"num_layers": 0},
        {"hidden_size": -1},
        {"num_heads": 3, "num_kv_heads": 2},
        {"head_dim": 2.0},
        {"vocab_size": 100},
        {"intermediate_size": True},
        {"init_std": 0.0},
        {"init_std": float("nan")},
        {"seed": -1},
        {"dtype": "float16"},
        {"corpus_bytes": 0},
    ],
)
def test_spec_validation(changes: dict[str, Any]) -> None:
    """Bad field values raise ValueError naming the field or relation."""
    with pytest.raises(ValueError, match="ModelSpec"):
        ModelSpec(**changes)


def test_spec_json_round_trip() -> None:
    """A spec survives to_json/from_json, and unknown keys are rejected."""
    spec = dataclasses.replace(SMALL, seed=7, dtype="bfloat16")
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert spec.to_json() == ModelSpec.from_json(spec.to_json()).to_json()
    with pytest.raises(ValueError, match="unknown"):
        ModelSpec.from_dict({**spec.to_dict(), "extra": 1})
    with pytest.raises(ValueError):
        ModelSpec.from_json("not json")


def test_default_model_dir() -> None:
    """The default directory lives under the given home."""
    assert default_model_dir(Path("/h")) == Path("/h/models/tiny-qwen3")


def test_ensure_model_reuses_matching_dir(tmp_path: Path) -> None:
    """A complete, matching directory is returned untouched."""
    out = make_model(tmp_path / "m", SMALL)
    for path in out.iterdir():
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = _mtimes(out)
    assert ensure_model(out, SMALL) == out
    assert _mtimes(out) == before


def test_ensure_model_remakes_on_mismatch(tmp_path: Path) -> None:
    """A spec mismatch or a missing marker triggers a rebuild."""
    out = make_model(tmp_path / "m", SMALL)
    other = dataclasses.replace(SMALL, seed=3)
    ensure_model(out, other)
    assert ModelSpec.from_json((out / SPEC_FILENAME).read_text()) == other
    assert is_complete(out, other) and not is_complete(out, SMALL)
    (out / SPEC_FILENAME).unlink()
    assert not is_complete(out, other)
    ensure_model(out, other)
    assert is_complete(out, other)


def test_ensure_model_builds_missing_dir(tmp_path: Path) -> None:
    """ensure_model creates the directory (and parents) when absent."""
    out = ensure_model(tmp_path / "a" / "b", SMALL)
    assert is_complete(out, SMALL)


def test_bfloat16_weights(tmp_path: Path) -> None:
    """dtype='bfloat16' is stored in the weights and in config.json."""
    out = make_model(tmp_path / "bf16", dataclasses.replace(SMALL, dtype="bfloat16"))
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        dtypes = {handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_corpus_is_deterministic() -> None:
    """The same seed yields the same corpus; another seed differs."""
    assert make_corpus(5, 20_000) == make_corpus(5, 20_000)
    assert make_corpus(5, 20_000) != make_corpus(6, 20_000)
    with pytest.raises(ValueError):
        make_corpus(0, 0)
