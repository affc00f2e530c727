"""Data parallelism: each DP rank of an instance is an engine of its own
(vLLM gives it the engine id ``<id>_dp<rank>``), so each takes side-channel
ports of its own, after those of the ranks before it, one per TP rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector.config import ConnectorConfig


def vllm_config(dp_rank: int, tp_size: int) -> SimpleNamespace:
    kv = SimpleNamespace(
        kv_role="kv_producer",
        engine_id=f"prefill0_dp{dp_rank}",
        kv_connector_extra_config={"side_channel_port": 5600},
    )
    return SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp_size, data_parallel_index=dp_rank
        ),
        instance_id="boot",
    )


@pytest.mark.parametrize(
    ("dp_rank", "tp_size", "ports"),
    [(0, 1, [5600]), (1, 1, [5601]), (0, 2, [5600, 5601]), (1, 2, [5602, 5603])],
)
def test_each_dp_rank_listens_after_the_ranks_before_it(
    dp_rank: int, tp_size: int, ports: list[int]
) -> None:
    listen = [
        ConnectorConfig.from_vllm(vllm_config(dp_rank, tp_size), tp_rank=r).listen_port
        for r in range(tp_size)
    ]
    assert listen == ports


def test_the_engine_id_is_vllms_per_rank_one() -> None:
    config = ConnectorConfig.from_vllm(vllm_config(1, 2), tp_rank=1)
    assert config.engine_id == "prefill0_dp1"
    assert (
        config.agent_name
        != ConnectorConfig.from_vllm(vllm_config(0, 2), tp_rank=1).agent_name
    )
