"""A topology backend that is one data-parallel rank of an instance
(``dp_rank``): the router pins every leg it sends there to that rank with
vLLM's ``X-data-parallel-rank`` header; other backends get no such header.
``GET /admin/instances`` shows each backend's ranks."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest

from kvpush.router.app import start_router
from kvpush.router.config import RouterConfig
from kvpush.topology import Topology
from tests.fakes import FakeCluster

COMPLETION = {"model": "m", "prompt": "one two three four", "max_tokens": 3}


@pytest.mark.parametrize("mode", ["kvpush", "vllm-pull", "vllm-push"])
async def test_each_leg_is_pinned_to_its_backends_dp_rank(mode: str) -> None:
    cluster = FakeCluster(mode)  # type: ignore[arg-type]
    await cluster.add("prefill", 1)
    await cluster.add("decode", 1)
    plain = cluster.topology()
    ranks = {"prefill": None, "decode": 1}
    topology = Topology(
        mode=plain.mode,
        backends=tuple(
            msgspec.structs.replace(b, dp_rank=ranks[b.role]) for b in plain.backends
        ),
    )
    router = await start_router(
        RouterConfig(topology=topology, port=0, shutdown_timeout_s=0.2)
    )
    try:
        url = router.url + "/v1/completions"
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, json=COMPLETION) as r,
        ):
            assert r.status == 200, await r.text()
            async with http.get(router.url + "/admin/instances") as listed:
                instances = (await listed.json())["instances"]
        [prefill_leg] = cluster.prefills[0].received
        [decode_leg] = cluster.decodes[0].received
        assert "X-data-parallel-rank" not in prefill_leg.headers
        assert decode_leg.headers["X-data-parallel-rank"] == "1"
        shown = {i["engine_id"]: (i["tp_size"], i["dp_rank"]) for i in instances}
        assert shown == {"prefill0": (1, None), "decode0": (1, 1)}
    finally:
        await router.close()
        await cluster.close()


def test_a_negative_dp_rank_is_refused() -> None:
    text = b'{"mode": "kvpush", "backends": [{"role": "decode", "url": "http://a:1",'
    text += b' "engine_id": "d", "dp_rank": -1}]}'
    with pytest.raises(msgspec.ValidationError, match="dp_rank"):
        msgspec.json.decode(text, type=Topology)
