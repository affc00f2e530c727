"""A multi-host rehearsal on one machine: one network namespace per host.

``kvpush up --hosts netns`` gives each instance its own "host": a network
namespace with one veth link (``eth0`` inside) to a bridge in the root
namespace, and its own address on a /24 in ``10.250.0.0/16`` that only these
links carry. The root namespace holds the bridge's address, so the router
(on 127.0.0.1, as always) reaches every instance. Each instance also runs in
its own IPC namespace, so that UCX's own transport selection sees separate
nodes and moves the KV over TCP, as between real hosts (separate network
namespaces alone leave it on shared memory: see the multi-host notes in
``docs/``). With a link rate, each host's egress (``eth0`` in its namespace)
is shaped by ``tbf``.

Names are derived from the run directory (``kvpush-<tag>-<instance>``,
links ``kvp<tag>...``), so ``down``, and the next ``up`` after a crash,
remove exactly what this run directory's cluster created, and two clusters
in two run directories do not collide.

:func:`plan_network` is pure; everything else runs ``ip``/``tc`` with a
deadline and raises :class:`NetnsError` naming the command that failed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
from pathlib import Path

import msgspec

SUPERNET = ipaddress.ip_network("10.250.0.0/16")
HOST_DEVICE = "eth0"  # each host's one NIC, inside its namespace
_FIRST_HOST = 10  # .1 is the bridge (the root namespace), hosts from .10
_MAX_HOSTS = 200
_CMD_TIMEOUT_S = 10.0
MAX_LINK_GBIT = 100.0


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed."""


class HostNet(msgspec.Struct, frozen=True, kw_only=True):
    """One rehearsal host: ``namespace``, its ``address``, and the root
    namespace's end of its link (``root_device``, on the bridge)."""

    name: str  # the instance on it
    namespace: str
    address: str
    root_device: str


class NetPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Every namespace, link and address of one rehearsal cluster."""

    tag: str
    bridge: str
    bridge_address: str  # with its prefix length, e.g. 10.250.3.1/24
    hosts: tuple[HostNet, ...]
    link_gbit: float | None = None

    def host(self, name: str) -> HostNet:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no rehearsal host runs {name!r}")


def run_dir_tag(run_dir: Path) -> str:
    """Four hex digits naming this run directory's namespaces and links."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:4]


def plan_network(
    run_dir: Path, names: list[str], subnet_index: int, link_gbit: float | None
) -> NetPlan:
    """The namespaces and addresses for instances ``names`` on subnet
    ``10.250.<subnet_index>.0/24``."""
    if not 0 <= subnet_index <= 255:
        raise ValueError(f"subnet index {subnet_index} is not in 0..255")
    if len(names) > _MAX_HOSTS:
        raise ValueError(f"at most {_MAX_HOSTS} rehearsal hosts, not {len(names)}")
    if link_gbit is not None and not 0 < link_gbit <= MAX_LINK_GBIT:
        raise ValueError(f"link_gbit must be in (0, {MAX_LINK_GBIT:g}]")
    tag = run_dir_tag(run_dir)
    net = f"10.250.{subnet_index}"
    hosts = tuple(
        HostNet(
            name=name,
            namespace=f"kvpush-{tag}-{name}",
            address=f"{net}.{_FIRST_HOST + i}",
            root_device=f"kvp{tag}h{i}",
        )
        for i, name in enumerate(names)
    )
    return NetPlan(
        tag=tag,
        bridge=f"kvp{tag}br",
        bridge_address=f"{net}.1/24",
        hosts=hosts,
        link_gbit=link_gbit,
    )


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"'{' '.join(args)}' failed: {e}") from e
    if check and done.returncode != 0:
        raise NetnsError(f"'{' '.join(args)}' failed: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why this machine cannot run a netns rehearsal (None: it can), in one
    line: it needs root, ``ip`` and ``tc``, and network namespaces."""
    if os.geteuid() != 0:
        return "--hosts netns needs root (network namespaces and links)"
    probe = f"kvpush-probe-{os.getpid()}"
    try:
        _run("tc", "-V")
        _run("ip", "netns", "add", probe)
    except NetnsError as e:
        return f"--hosts netns cannot create network namespaces here: {e}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def free_subnet_index() -> int:
    """A ``10.250.N.0/24`` that no interface here has an address in."""
    out = _run("ip", "-o", "-4", "addr", "show").stdout
    used = set()
    for line in out.splitlines():
        fields = line.split()
        addr = ipaddress.ip_interface(fields[fields.index("inet") + 1])
        if addr.ip in SUPERNET:
            used.add(int(addr.ip.packed[2]))
    for index in range(256):
        if index not in used:
            return index
    raise NetnsError("every 10.250.N.0/24 subnet is in use")


def create(plan: NetPlan) -> None:
    """Make the bridge, then each host's namespace, link, address and
    shaping. On any failure everything made so far is removed."""
    try:
        _run("ip", "link", "add", plan.bridge, "type", "bridge")
        _run("ip", "addr", "add", plan.bridge_address, "dev", plan.bridge)
        _run("ip", "link", "set", plan.bridge, "up")
        prefix = plan.bridge_address.split("/")[1]
        for host in plan.hosts:
            _add_host(plan, host, prefix)
    except BaseException:
        destroy(plan)
        raise


def _add_host(plan: NetPlan, host: HostNet, prefix: str) -> None:
    ns, inner = host.namespace, f"{host.root_device}n"
    _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", host.root_device, "type", "veth", "peer", "name", inner)
    _run("ip", "link", "set", inner, "netns", ns)
    _run("ip", "-n", ns, "link", "set", inner, "name", HOST_DEVICE)
    _run("ip", "-n", ns, "addr", "add", f"{host.address}/{prefix}", "dev", HOST_DEVICE)
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "-n", ns, "link", "set", HOST_DEVICE, "up")
    _run("ip", "link", "set", host.root_device, "master", plan.bridge)
    _run("ip", "link", "set", host.root_device, "up")
    if plan.link_gbit is not None:
        shape(host, plan.link_gbit * 1000.0)


def destroy(plan: NetPlan) -> None:
    """Remove every namespace and link of ``plan`` (qdiscs go with their
    devices); idempotent, and quiet about what is already gone."""
    cleanup_tag(plan.tag)


def cleanup_tag(tag: str) -> list[str]:
    """Remove every namespace and link named for run-directory ``tag`` (what
    a crashed cluster left); the names removed."""
    removed = []
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"kvp{tag}"):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    spaces = _run("ip", "netns", "list", check=False).stdout
    for line in spaces.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"kvpush-{tag}-"):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def exec_prefix(host: HostNet) -> list[str]:
    """What to put before a command to run it on ``host``: in its network
    namespace and a fresh IPC namespace (both ``exec``, so the PID stays)."""
    return ["ip", "netns", "exec", host.namespace, "unshare", "--ipc", "--"]


def shape(host: HostNet, mbit: float) -> None:
    """Shape ``host``'s egress to ``mbit`` Mbit/s with tbf (replacing any
    earlier shaping). The bucket holds 4 ms at that rate (at least 32 KiB),
    and up to 100 ms of packets may queue."""
    burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
    _run(
        "ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace",
        "dev", HOST_DEVICE, "root", "tbf", "rate", f"{mbit:g}mbit",
        "burst", str(burst), "latency", "100ms",
    )  # fmt: skip


def unshape(host: HostNet) -> None:
    """Take ``host``'s egress shaping off (the device's default qdisc)."""
    ns = host.namespace
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", HOST_DEVICE, "root")


def set_link(host: HostNet, up: bool) -> None:
    """Take ``host``'s link down (a partition: nothing in or out) or up."""
    _run("ip", "link", "set", host.root_device, "up" if up else "down")


class LinkBytes(msgspec.Struct, frozen=True):
    """Bytes a host has sent and received over its link since it was made."""

    sent: int
    received: int


def link_bytes(host: HostNet) -> LinkBytes:
    """``host``'s link byte counters, read at the root namespace's end (what
    it receives, the host sent)."""
    stats = Path("/sys/class/net") / host.root_device / "statistics"
    try:
        sent = int((stats / "rx_bytes").read_text())
        received = int((stats / "tx_bytes").read_text())
    except OSError as e:
        raise NetnsError(f"no byte counters for {host.name}'s link: {e}") from e
    return LinkBytes(sent=sent, received=received)
