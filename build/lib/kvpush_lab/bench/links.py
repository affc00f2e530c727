"""Bytes over the rehearsal hosts' links, and CPU spent per GiB moved.

On ``--hosts netns`` every instance is a host with one link (see
:mod:`kvpush.launcher.netns`). The benchmark reads every link's byte
counters (:func:`kvpush.launcher.netns.link_bytes`) right before and right
after each measured point, and sets what crossed them next to the KV the
point's requests needed: each request's prompt tokens times the model's
KV bytes per token (:func:`kvpush.model.kv_size.kv_bytes_per_token`; the
tiny model: 2 layers x 2 KV heads x 64 x K and V x 4 B = exactly 2048 B a
token in float32, so a 1000-token prompt needs 1.95 MiB).

The counters count *everything* a host sent or received: the KV, but also
the HTTP between the router and the instance (the prompt's token ids, the
streamed response), vLLM's and kvpush's side-channel messages, and the
TCP/IP and Ethernet overhead of all of it (headers, ACKs). So link bytes
exceed the KV bytes even when the KV crosses exactly once; a colocated
instance's link carries the HTTP alone, the size of that part.

Which side is which: prefill's host *sends* the KV (a kvpush or vLLM-push
WRITE, or a vLLM-pull READ that decode posts but prefill's host serves), and
decode's host *receives* it; a colocated instance is both sides.

CPU per GiB divides a side's process-group CPU seconds over the point
(:mod:`kvpush_lab.bench.resources`: API server, EngineCore and Worker,
compute included) by the GiB its link carried; :func:`excess_cpu_s` is the
disaggregated pair's CPU beyond a colocated instance's for the same
requests. Pure apart from :func:`read_links`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from kvpush.launcher import netns
from kvpush.launcher.netns import LinkBytes
from kvpush_lab.bench.resources import InstanceUsage

MIB = 2**20
GIB = 2**30
SENDS_KV = ("prefill", "colocated")
RECEIVES_KV = ("decode", "colocated")


class HostBytes(msgspec.Struct, frozen=True, kw_only=True):
    """What one host's link carried over a window, in bytes."""

    name: str
    role: str
    sent: int
    received: int


class LinkUsage(msgspec.Struct, frozen=True, kw_only=True):
    """One point's link bytes next to the KV its requests needed."""

    num_requests: int
    kv_bytes: int  # sum over the point's requests
    kv_bytes_per_token: int
    hosts: list[HostBytes]

    @property
    def prefill_sent(self) -> int:
        """Bytes the KV-sending hosts (prefill, or colocated) sent."""
        return sum(h.sent for h in self.hosts if h.role in SENDS_KV)

    @property
    def decode_received(self) -> int:
        """Bytes the KV-receiving hosts (decode, or colocated) received."""
        return sum(h.received for h in self.hosts if h.role in RECEIVES_KV)

    def mib_per_request(self, num_bytes: int) -> float:
        return num_bytes / MIB / max(1, self.num_requests)

    @property
    def kv_mib_per_request(self) -> float:
        return self.mib_per_request(self.kv_bytes)

    @property
    def sent_over_kv(self) -> float | None:
        """Prefill's link bytes per KV byte (None without KV)."""
        return self.prefill_sent / self.kv_bytes if self.kv_bytes else None


def read_links(network: netns.NetPlan) -> dict[str, LinkBytes]:
    """Every rehearsal host's link counters now, by instance name."""
    return {host.name: netns.link_bytes(host) for host in network.hosts}


def link_usage(
    before: Mapping[str, LinkBytes],
    after: Mapping[str, LinkBytes],
    roles: Mapping[str, str],
    prompt_tokens: Sequence[int],
    kv_bytes_per_token: int,
) -> LinkUsage:
    """What each host's link carried between two readings, for a point
    whose requests had ``prompt_tokens`` (one length per request)."""
    hosts = [
        HostBytes(
            name=name,
            role=roles.get(name, "?"),
            sent=after[name].sent - before[name].sent,
            received=after[name].received - before[name].received,
        )
        for name in sorted(after)
        if name in before
    ]
    if any(h.sent < 0 or h.received < 0 for h in hosts):
        raise ValueError("link counters went backwards (a link was remade?)")
    return LinkUsage(
        num_requests=len(prompt_tokens),
        kv_bytes=sum(prompt_tokens) * kv_bytes_per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        hosts=hosts,
    )


class CpuPerGiB(msgspec.Struct, frozen=True, kw_only=True):
    """CPU seconds of each side's process groups per GiB its link carried
    (None where that side carried nothing, or for colocated)."""

    prefill: float | None
    decode: float | None


def cpu_per_gib(usage: Sequence[InstanceUsage], links: LinkUsage) -> CpuPerGiB:
    """Prefill's CPU per GiB it sent, decode's per GiB it received; both
    None for a colocated instance, which moves no KV."""
    if any(u.role == "colocated" for u in usage):
        return CpuPerGiB(prefill=None, decode=None)
    return CpuPerGiB(
        prefill=per_gib(_cpu_s(usage, "prefill"), links.prefill_sent),
        decode=per_gib(_cpu_s(usage, "decode"), links.decode_received),
    )


def excess_cpu_s(
    usage: Sequence[InstanceUsage], colocated: Sequence[InstanceUsage]
) -> float:
    """CPU seconds the prefill and decode groups took beyond the colocated
    instance on the same requests (routers left out): what disaggregation
    cost in CPU, the transfer and the engines' waiting included."""
    pair = _cpu_s(usage, "prefill") + _cpu_s(usage, "decode")
    return pair - _cpu_s(colocated, "colocated")


def per_gib(cpu_s: float, num_bytes: int) -> float | None:
    """``cpu_s`` per GiB of ``num_bytes`` (None for nothing moved)."""
    return cpu_s / (num_bytes / GIB) if num_bytes > 0 else None


def _cpu_s(usage: Sequence[InstanceUsage], role: str) -> float:
    return sum(u.cpu_s for u in usage if u.role == role)
