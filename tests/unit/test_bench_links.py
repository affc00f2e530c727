"""Bytes over the rehearsal links per request, next to the KV the requests
needed, and CPU seconds per GiB moved: the arithmetic, on hand-made
counter readings."""

from __future__ import annotations

import pytest

from kvpush.launcher.netns import LinkBytes
from kvpush_lab.bench.links import (
    GIB,
    MIB,
    cpu_per_gib,
    excess_cpu_s,
    link_usage,
    per_gib,
)
from kvpush_lab.bench.resources import InstanceUsage

TINY_KV_PER_TOKEN = 2048  # 2 layers x 2 KV heads x 64 x (K, V) x 4 B
ROLES = {"prefill0": "prefill", "decode0": "decode"}


def usage(name: str, role: str, cpu_s: float) -> InstanceUsage:
    return InstanceUsage(
        name=name, role=role, cpu_s=cpu_s, cpu_cores=0.5, peak_rss_mb=1
    )


def test_link_bytes_per_request_sit_next_to_the_kv_the_requests_needed() -> None:
    before = {"prefill0": LinkBytes(1000, 500), "decode0": LinkBytes(200, 7000)}
    after = {
        "prefill0": LinkBytes(1000 + 5 * MIB, 500 + MIB // 2),
        "decode0": LinkBytes(200 + MIB // 4, 7000 + 4 * MIB),
    }
    links = link_usage(before, after, ROLES, [1000, 1000], TINY_KV_PER_TOKEN)
    assert links.num_requests == 2
    assert links.kv_bytes == 2000 * 2048
    assert links.kv_mib_per_request == pytest.approx(1000 * 2048 / MIB)  # 1.95
    assert links.prefill_sent == 5 * MIB  # the prefill host's sent bytes only
    assert links.decode_received == 4 * MIB  # the decode host's received only
    assert links.mib_per_request(links.prefill_sent) == pytest.approx(2.5)
    assert links.sent_over_kv == pytest.approx(5 * MIB / (2000 * 2048))


def test_a_colocated_host_counts_on_both_sides() -> None:
    before = {"colocated0": LinkBytes(0, 0)}
    after = {"colocated0": LinkBytes(300, 900)}
    links = link_usage(before, after, {"colocated0": "colocated"}, [10], 2048)
    assert (links.prefill_sent, links.decode_received) == (300, 900)


def test_counters_that_went_backwards_are_refused() -> None:
    with pytest.raises(ValueError, match="backwards"):
        link_usage(
            {"prefill0": LinkBytes(10, 10)},
            {"prefill0": LinkBytes(5, 10)},
            ROLES,
            [1],
            2048,
        )


def test_cpu_per_gib_divides_each_side_by_what_its_link_carried() -> None:
    before = {"prefill0": LinkBytes(0, 0), "decode0": LinkBytes(0, 0)}
    after = {"prefill0": LinkBytes(2 * GIB, 0), "decode0": LinkBytes(0, GIB // 2)}
    links = link_usage(before, after, ROLES, [1], 2048)
    groups = [
        usage("prefill0", "prefill", 3.0),
        usage("decode0", "decode", 1.0),
        usage("router", "router", 9.0),  # not a side
    ]
    cpu = cpu_per_gib(groups, links)
    assert cpu.prefill == pytest.approx(1.5)
    assert cpu.decode == pytest.approx(2.0)
    colocated = [usage("colocated0", "colocated", 2.5), usage("router", "router", 1)]
    assert excess_cpu_s(groups, colocated) == pytest.approx(1.5)
    assert cpu_per_gib(colocated, links).prefill is None  # moves no KV
    assert per_gib(1.0, 0) is None
