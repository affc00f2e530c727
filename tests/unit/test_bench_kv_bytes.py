"""KV bytes moved per request against decode's need: the connectors'
byte histograms on /metrics, the block size, and the need per prompt
(whole blocks of full layers, a window's blocks of windowed ones, MLA once
per decode rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.model.kv_size import pushed_bytes
from kvpush.telemetry import names
from kvpush_lab.bench.kv_bytes import block_size, bytes_moved, kv_bytes

PER_LAYER_TOKEN = 2 * 2 * 64 * 4  # K and V, 2 heads of 64, float32


def metrics(family: str, total: float, block: int = 128) -> str:
    """A /metrics text with one histogram's sum and vLLM's cache config."""
    labels = 'engine="0",model_name="m"'
    info = names.CACHE_CONFIG_INFO.name
    return "\n".join([
        f"# HELP {family} x", f"# TYPE {family} histogram",
        f'{family}_bucket{{{labels},le="+Inf"}} 2.0',
        f"{family}_count{{{labels}}} 2.0",
        f"{family}_sum{{{labels}}} {total}",
        f"# HELP {info} x", f"# TYPE {info} gauge",
        f'{info}{{engine="0",block_size="{block}",num_gpu_blocks="99"}} 1.0',
    ]) + "\n"  # fmt: skip


def model(tmp_path: Path, **config: object) -> Path:
    base = {
        "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


def test_each_mode_reads_its_connectors_bytes():
    kvpush = metrics(names.KVPUSH_WRITE_BYTES.name, 3e6)
    nixl = metrics(names.NIXL_BYTES_TRANSFERRED.name, 5e6)
    assert bytes_moved(kvpush, "kvpush") == 3e6
    assert bytes_moved(nixl, "vllm-pull") == 5e6
    assert bytes_moved(kvpush, "vllm-pull") == 0.0, "another connector's bytes"
    assert bytes_moved(kvpush, "colocated") is None
    assert block_size(kvpush) == 128


def test_a_windowed_layer_needs_its_window_only(tmp_path: Path):
    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    d = model(tmp_path, layer_types=kinds, sliding_window=128)
    block_bytes = 128 * PER_LAYER_TOKEN
    # 1,000 tokens: 8 blocks; the window keeps blocks 6 and 7
    assert pushed_bytes(d, "float32", 1000, 128) == (2 * 8 + 4 * 2) * block_bytes
    # 1,023 (1,023 - 128 + 1 a block's first token): one block more per window
    assert pushed_bytes(d, "float32", 1023, 128) == (2 * 8 + 4 * 2) * block_bytes
    assert pushed_bytes(d, "float32", 1024, 128) == (2 * 8 + 4 * 1) * block_bytes


def test_moved_over_needed_per_answered_request(tmp_path: Path):
    d = model(tmp_path)  # dense: every layer every block
    need = 6 * 8 * 128 * PER_LAYER_TOKEN
    kv = kv_bytes(2 * need, [1000, 1000], d, "float32", 128, decode_tp=2)
    assert kv is not None and kv.written == need and kv.of_needed == 1.0
    assert kv_bytes(0.0, [], d, "float32", 128, 1) is None
    unknown = kv_bytes(need, [1000], d, "auto", 128, 1)
    assert unknown is not None and unknown.needed is None and unknown.of_needed is None


def test_an_mla_model_needs_one_copy_per_decode_rank(tmp_path: Path):
    d = model(tmp_path, kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
    one = pushed_bytes(d, "float32", 100, 16)
    kv = kv_bytes(2 * one, [100], d, "float32", 16, decode_tp=2)
    assert kv is not None and kv.needed == pytest.approx(2 * one)
    assert kv.of_needed == pytest.approx(1.0)


def test_a_mamba_hybrid_needs_its_attention_blocks_and_each_state_once(tmp_path: Path):
    # the hybrid preset's shape: M-*-M- (Nemotron-H, no num_hidden_layers)
    blocks = ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
    d = model(
        tmp_path, num_hidden_layers=None, layers_block_type=blocks,
        mamba_num_heads=16, mamba_head_dim=32, n_groups=1, ssm_state_size=16,
        conv_kernel=4, mamba_ssm_cache_dtype="float32",
    )  # fmt: skip
    # conv: (16 x 32 + 2 x 16) channels x 3 columns; SSM: 16 x 32 x 16 (float32)
    state = (544 * 3 + 16 * 32 * 16) * 4
    assert state == 39_296  # vLLM's MambaSpec for this shape (docs/model-families.md)
    assert (
        pushed_bytes(d, "float32", 1000, 128) == 8 * 128 * PER_LAYER_TOKEN + 2 * state
    )


def test_a_gated_delta_net_hybrid_needs_each_state_in_the_dtypes_vllm_chose(
    tmp_path: Path,
):
    # the gdn preset's shape (Qwen3-Next): three gated-delta-net layers, one
    # attention layer, bfloat16; vLLM's CPU build keeps the recurrent state
    # in float32 where it accelerates gated delta net (cache_config_info)
    d = model(
        tmp_path, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
    )  # fmt: skip
    conv = (2 * 2 * 64 + 4 * 64) * 3 * 2  # q, k and v channels, 3 columns, bf16
    attention = 4 * 256 * (2 * 2 * 64 * 2)  # 1,000 tokens in 4 blocks of 256
    want = attention + 3 * (conv + 4 * 64 * 64 * 4)
    assert pushed_bytes(d, "bfloat16", 1000, 256, ssm_dtype="float32") == want
    in_bf16 = attention + 3 * (conv + 4 * 64 * 64 * 2)
    assert pushed_bytes(d, "bfloat16", 1000, 256, ssm_dtype="auto") == in_bf16
