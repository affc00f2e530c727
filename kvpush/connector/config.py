"""The connector's one frozen config, read from vLLM's kv-transfer config.

The launcher sets these through ``kv_connector_extra_config``::

    {"side_channel_host": "127.0.0.1", "side_channel_port": 5600,
     "side_channel_advertise_host": "",
     "trace_dir": "RUN_DIR/traces",
     # optional, defaults below:
     "registration_ttl_s": 60, "ready_ttl_s": 30, "peer_timeout_s": 10,
     "fault_file": "", "nixl_backend": "UCX", "insecure_side_channel": false,
     "push_granularity": "auto", "layer_push_min_bytes": 2097152,
     "verify_kv": "off", "verify_kv_sample": 0.01, "control_dir": ""}

``side_channel_advertise_host`` (prefill): the side-channel address prefill
gives decodes in its answer to a vLLM P/D prefill leg (``remote_host``),
when it binds a wildcard or an address others reach by another name; empty
(the default): ``side_channel_host``.

``side_channel_port`` is the instance's first port. A data-parallel
instance runs one engine per DP rank, each with its own KV cache, engine id
(vLLM appends ``_dp<rank>``) and ports: DP rank ``d`` with TP ``t`` takes
``side_channel_port + d * t`` onward, one per TP rank.

``control_dir`` (decode): an absolute directory where ``kvpush forget``
leaves an operator's proof that a prefill is gone
(:mod:`kvpush.connector.control`); the launcher sets
``RUN_DIR/control/<engine id>``; empty (the default): no such proof is read.

``push_granularity`` (prefill): ``request`` pushes a prompt's KV once its
last chunk is computed; ``chunk`` streams it, each prefill chunk's
completed blocks as that chunk's forward ends; ``layer`` streams each
chunk layer by layer, each layer's blocks as soon as its attention wrote
them (``save_kv_layer``); ``auto`` streams and picks, per chunk, ``layer``
where the chunk is large enough for the overlap to pay, ``chunk``
otherwise (:meth:`ConnectorConfig.pushes_per_layer`).

The rule, from measured quantities: pushing a chunk per layer costs one
WRITE per layer instead of one per chunk, and each WRITE has a fixed cost
``c`` whatever its size (kvpush's descriptors and NIXL's calls, post to
DONE: about 0.13 ms here, against 0.06 ms for the bytes of a 1 MiB layer
on the fastest path measured, in-process UCX at about 18 GB/s). It hides
the chunk's transfer behind the chunk's own forward, one layer at a time,
so it pays once a layer's bytes take at least as long on the wire as a
WRITE's fixed cost: ``B_layer >= c x bandwidth``. ``layer_push_min_bytes``
is that product (default 2 MiB: 0.13 ms x 18 GB/s, rounded up to a power
of two), so ``auto`` goes per layer only where it pays even on that fast
a path; on slower links it pays from fewer bytes (1 Gbit/s: ~15 kB), and
the value may be lowered. ``B_layer`` is the chunk's blocks times one
block of one layer (K and V).

A model with several KV-cache groups (sliding-window layers beside full
ones under vLLM's hybrid KV-cache manager) pushes by chunk where ``auto``
or ``chunk`` is set: the groups share one tensor per layer slot, and slot
``k`` is written by each group's layer ``k`` at a different point of the
forward, so no one layer's attention completes a slot
(:attr:`ConnectorConfig.may_push_per_layer`); ``layer`` is refused
(:mod:`kvpush.connector.support`).

Per layer, vLLM must call ``save_kv_layer`` outside any captured CUDA
graph: :meth:`KvPushConnector.requires_piecewise_for_cudagraph` says so
for ``layer`` and ``auto`` (vLLM then runs FULL CUDA graphs as PIECEWISE).

``verify_kv`` (both roles, the same on both: the launcher passes one
value to every instance): KV digests (:mod:`kvpush.transfer.digest`).
``off`` (the default), ``sample`` (the fraction ``verify_kv_sample`` of
transfers, chosen from the transfer id, so both sides choose alike) or
``all``. Prefill sends, with each selected transfer's Done, the digest of
what it wrote; decode checks it against its memory before the receive
counts as done, and fails the receive on a mismatch (vLLM recomputes, or
errors, by ``kv_load_failure_policy``). Cost: both sides hash every byte
of a selected transfer (SHA-256, about 1.5 s of CPU per GiB on the dev
machine; decode on a thread of its own, prefill on its writer thread),
which is why the default is off.

The shared secret that authenticates side-channel messages comes from the
environment (``KVPUSH_SIDE_CHANNEL_SECRET``), never from the command line,
where other users of the machine could read it. A prefill whose side channel
binds anything but loopback refuses to start without it unless
``insecure_side_channel`` is true (:mod:`kvpush.side_channel_auth`).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvpush.connector.state_spec import state_page_of
from kvpush.side_channel_auth import SECRET_ENV, check_side_channel_auth
from kvpush.transfer import ranks
from kvpush.transfer.digest import (
    DEFAULT_VERIFY_KV,
    DEFAULT_VERIFY_SAMPLE,
    VerifyPolicy,
    check_verify_kv,
)
from kvpush.transfer.state_pages import StatePage

ConnectorRole = Literal["prefill", "decode", "both"]
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# NIXL transport plugins kvpush may be configured with: UCX (the default,
# tested here) and LIBFABRIC (what AWS EFA users run).
NIXL_BACKENDS: tuple[str, ...] = ("UCX", "LIBFABRIC")
_DURATIONS = ("registration_ttl_s", "ready_ttl_s", "peer_timeout_s")
PUSH_GRANULARITIES: tuple[str, ...] = ("auto", "request", "chunk", "layer")
DEFAULT_PUSH_GRANULARITY = "auto"
PER_LAYER_GRANULARITIES: tuple[str, ...] = ("auto", "layer")  # may push per layer


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV-cache groups as kvpush maps it: ``kind`` (see
    :func:`kv_group_kind`), its layers' names in vLLM's order, for a
    windowed group the tokens it keeps for the next one (``window``:
    vLLM's ``sliding_window`` + ``extra_retained_tokens``; 0: all), and
    for a state group what its page holds (``page``,
    :func:`~kvpush.connector.state_spec.state_page_of`; None: copied whole
    between equal TP sizes only)."""

    kind: str
    layers: tuple[str, ...] = ()
    window: int = 0
    page: StatePage | None = None

    @property
    def is_state(self) -> bool:
        """A group of per-request state (Mamba), one block a request."""
        return self.kind.startswith("state:")


def rewind_reads_a_skipped_block(
    groups: tuple[KvGroup, ...], num_tokens: int, block_size: int
) -> bool:
    """Whether vLLM, having loaded the whole ``num_tokens`` prompt, would
    compute its last token again reading a block its allocation left out.

    vLLM allocates a windowed group's blocks for ``n`` computed tokens from
    token ``n - window + 1`` on (the null block before), then rewinds a
    whole loaded prompt by one token and computes token ``n - 1``, whose
    window starts at token ``n - window``: one block earlier when
    ``n - window + 1`` is a multiple of the block size. That block is the
    null block on decode (measured on the ``swa`` preset, 255- and
    383-token prompts: logprobs off by up to 0.13). Decode then loads all
    but the last token, which vLLM computes with its window whole."""
    for g in groups:
        skipped = num_tokens - g.window + 1
        if g.window and skipped > 0 and skipped % block_size == 0:
            return True
    return False


ONE_FULL_GROUP = (KvGroup("full"),)


def kv_group_kind(spec: Any) -> str:
    """What a group's KV-cache spec means for a copy: ``full`` (every
    token kept), ``mla`` (one latent per token), ``sliding_window:<tokens>``
    (only the window kept), ``state:<mamba type>:<digest>`` (a Mamba
    layer's per-request state, one page a request; the digest names its
    shapes, dtypes, mode and padding); any other spec by its class name
    (refused by :mod:`kvpush.connector.support`). Both sides must group
    alike."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if type(spec) is FullAttentionSpec:
        return "full"
    if type(spec) is MLAAttentionSpec:
        return "mla"
    if type(spec) is SlidingWindowSpec:
        return f"sliding_window:{spec.sliding_window}"
    if type(spec) is MambaSpec:
        # what the page's bytes mean: the state shapes (their order is the
        # conv layout), dtypes, cache mode and padding; both sides alike
        meaning = repr(
            (spec.shapes, spec.dtypes, spec.mamba_cache_mode, spec.page_size_padded)
        )
        digest = hashlib.sha256(meaning.encode()).hexdigest()[:8]
        return f"state:{spec.mamba_type.name.lower()}:{digest}"
    return type(spec).__name__


def kv_groups_of(
    kv_cache_config: Any, model_config: Any = None, tp_size: int = 1
) -> tuple[KvGroup, ...]:
    """The groups of vLLM's ``kv_cache_config`` (one full group when it
    names none: tests and tools that pass no config), state pages described
    from ``model_config`` at TP ``tp_size``."""
    found = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    groups = tuple(
        KvGroup(
            kv_group_kind(g.kv_cache_spec),
            tuple(g.layer_names),
            _window(g.kv_cache_spec),
            _state_page(g.kv_cache_spec, model_config, tp_size),
        )
        for g in found
    )
    return groups or ONE_FULL_GROUP


def _state_page(spec: Any, model_config: Any, tp_size: int) -> StatePage | None:
    if not kv_group_kind(spec).startswith("state:"):
        return None
    return state_page_of(spec, model_config, tp_size)


def _window(spec: Any) -> int:
    """Tokens a windowed group keeps for the next token (0: every one)."""
    if not kv_group_kind(spec).startswith("sliding_window:"):
        return 0
    return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))


DEFAULT_LAYER_PUSH_MIN_BYTES = 2 * 1024 * 1024  # see the module docstring


@dataclass(frozen=True)
class ConnectorConfig:
    """What one instance's connector needs to know about itself."""

    role: ConnectorRole
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    block_size: int
    side_channel_advertise_host: str = ""  # given to decodes; empty: the bind host
    trace_dir: str = ""
    boot_id: str = "0"  # this start of the instance; shared by its processes
    registration_ttl_s: float = 60.0  # decode keeps destination blocks this long
    ready_ttl_s: float = 30.0  # prefill keeps finished KV this long unmatched
    # Prefill: a decode silent this long with registered transfers is dead.
    # Decode: a prefill not connected this long while awaited is dead.
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 1.0  # decode's heartbeat period to awaited prefills
    fault_file: str = ""  # tests only: see kvpush.connector.faults
    secret: bytes = b""  # side-channel authentication key; empty: off
    num_blocks: int = 0  # KV-cache blocks per layer (vLLM's); 0: read the tensors
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    nixl_backend: str = "UCX"  # NIXL transport plugin, one of NIXL_BACKENDS
    insecure_side_channel: bool = False  # allow no secret off loopback
    push_granularity: str = DEFAULT_PUSH_GRANULARITY  # one of PUSH_GRANULARITIES
    # auto: a chunk whose KV per layer is at least this many bytes goes per layer
    layer_push_min_bytes: int = DEFAULT_LAYER_PUSH_MIN_BYTES
    # --tensor-parallel-size, and this worker's rank (0 in EngineCore)
    tp_size: int = 1
    tp_rank: int = 0
    # the model's KV heads over every rank (0: unknown: equal TP sizes only;
    # 1 for MLA, whose one latent per token every rank holds whole)
    total_kv_heads: int = 0
    # KV digests: off | sample | all, and the fraction sample verifies
    verify_kv: str = DEFAULT_VERIFY_KV
    verify_kv_sample: float = DEFAULT_VERIFY_SAMPLE
    # decode: where ``kvpush forget`` writes (kvpush.connector.control); "": off
    control_dir: str = ""
    # one side of a kv_both instance (see ``sides``)
    of_both: bool = False
    # vLLM's KV-cache groups (kv_cache_config.kv_cache_groups), in its order
    kv_groups: tuple[KvGroup, ...] = ONE_FULL_GROUP
    # decode: vLLM runs kvpush's scheduler class (a request may continue
    # from prefill's first token, kvpush.connector.decode.first_token)
    continues_from_t1: bool = False

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("kv-transfer-config needs a non-empty engine_id")
        check_control_dir(self.control_dir)
        check_nixl_backend(self.nixl_backend)
        check_push_granularity(self.push_granularity)
        try:
            check_verify_kv(self.verify_kv, self.verify_kv_sample)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config.{e}") from None
        if self.role != "decode":  # its prefill worker binds the listener here
            check_side_channel_auth(
                self.side_channel_host, bool(self.secret), self.insecure_side_channel
            )
        if not 1 <= self.side_channel_port <= 65535 - self.tp_size + 1:
            raise ValueError(
                "kv_connector_extra_config.side_channel_port must be a port "
                f"number (1..65535) with room for one port per TP rank "
                f"({self.tp_size}), not {self.side_channel_port!r}"
            )
        if not 1 <= self.tp_size <= ranks.MAX_TP_SIZE:
            raise ValueError(
                f"--tensor-parallel-size must be in 1..{ranks.MAX_TP_SIZE} "
                f"for kvpush, not {self.tp_size}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"TP rank {self.tp_rank} outside TP size {self.tp_size}")
        if self.total_kv_heads < 0:
            raise ValueError(f"total_kv_heads must be >= 0, not {self.total_kv_heads}")
        if self.layer_push_min_bytes < 1:
            raise ValueError(
                "kv_connector_extra_config.layer_push_min_bytes must be >= 1, "
                f"not {self.layer_push_min_bytes!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {self.block_size}")
        for name in _DURATIONS:
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be in (0, 3600] "
                    f"seconds, not {value!r}"
                )
        if self.registration_ttl_s <= 1.0:
            raise ValueError(
                "kv_connector_extra_config.registration_ttl_s must exceed 1 s "
                "(prefill keeps a 1 s margin for the WRITE itself)"
            )

    @property
    def sides(self) -> tuple[ConnectorConfig, ...]:
        """The config of each role this instance plays: itself for
        ``prefill`` or ``decode``; for ``both`` (vLLM's ``kv_both``), a
        prefill's and a decode's, each run by role objects of its own
        (:mod:`kvpush.connector.connector`)."""
        if self.role != "both":
            return (self,)
        return tuple(
            replace(self, role=role, of_both=True)  # type: ignore[arg-type]
            for role in ("prefill", "decode")
        )

    @property
    def advertised_side_channel_host(self) -> str:
        """The side-channel address decodes are told to connect to."""
        return self.side_channel_advertise_host or self.side_channel_host

    @property
    def verify(self) -> VerifyPolicy:
        """Which transfers carry and check KV digests."""
        return VerifyPolicy(self.verify_kv, self.verify_kv_sample)

    @property
    def streams(self) -> bool:
        """Prefill pushes chunk by chunk (``chunk``, ``layer`` or ``auto``)."""
        return self.push_granularity != "request"

    @property
    def has_state(self) -> bool:
        """The model has state groups (Mamba): a request's state is one
        block, copied once with the prompt's last one."""
        return any(g.is_state for g in self.kv_groups)

    @property
    def may_push_per_layer(self) -> bool:
        """Some chunks may go layer by layer (``layer``, ``auto``; one
        KV-cache group only: see the module docstring)."""
        return (
            self.push_granularity in PER_LAYER_GRANULARITIES
            and len(self.kv_groups) == 1
        )

    def pushes_per_layer(self, layer_bytes: int) -> bool:
        """Whether a computed chunk holding ``layer_bytes`` of KV in each
        layer is pushed per layer (the rule: see the module docstring)."""
        if not self.may_push_per_layer:
            return False
        if self.push_granularity == "layer":
            return True
        return self.push_granularity == "auto" and (
            layer_bytes >= self.layer_push_min_bytes
        )

    @property
    def agent_name(self) -> str:
        """This worker's NIXL agent name, derived from the engine id and the
        TP rank (:func:`kvpush.transfer.ranks.agent_name`). The decode side
        of a ``kv_both`` instance runs a second agent in the same process:
        its name ends in ``-decode`` (a plain agent's ends in its rank
        number, so no engine id can take it); decodes tell prefills their
        agent's name in their Hello, so nothing else derives it."""
        name = ranks.agent_name(self.engine_id, self.tp_rank)
        return f"{name}-decode" if self.of_both and self.role == "decode" else name

    @property
    def listen_port(self) -> int:
        """The side-channel port this prefill worker rank listens on:
        ``side_channel_port`` + its TP rank (the instance's range is
        ``side_channel_port .. side_channel_port + tp_size - 1``)."""
        return ranks.side_channel_port(self.side_channel_port, self.tp_rank)

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any = None, tp_rank: int = 0
    ) -> ConnectorConfig:
        """Read the config of the instance vLLM is building (``tp_rank``:
        the calling worker's tensor-parallel rank; 0 in EngineCore)."""
        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in _ROLES:
            raise ValueError(
                f"KvPushConnector needs kv_role kv_producer (prefill), "
                f"kv_consumer (decode) or kv_both (either, per request), "
                f"not {kv.kv_role!r}"
            )
        extra = kv.kv_connector_extra_config or {}
        durations = {k: float(extra[k]) for k in _DURATIONS if k in extra}
        # vLLM makes instance_id once per start, in the config that both the
        # scheduler and the worker processes receive: our boot id.
        boot_id = str(getattr(vllm_config, "instance_id", "") or uuid.uuid4().hex)
        try:
            return cls(
                role=_ROLES[kv.kv_role],  # type: ignore[arg-type]
                engine_id=str(kv.engine_id or ""),
                side_channel_host=str(extra.get("side_channel_host", "127.0.0.1")),
                side_channel_port=_engine_port(extra, vllm_config.parallel_config),
                side_channel_advertise_host=str(
                    extra.get("side_channel_advertise_host", "") or ""
                ),
                block_size=int(vllm_config.cache_config.block_size),
                trace_dir=str(extra.get("trace_dir", "")),
                boot_id=boot_id[:64],
                fault_file=str(extra.get("fault_file", "")),
                secret=os.environ.get(SECRET_ENV, "").encode(),
                num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
                cache_dtype=str(vllm_config.cache_config.cache_dtype or "auto"),
                nixl_backend=str(extra.get("nixl_backend", "UCX")),
                insecure_side_channel=extra.get("insecure_side_channel") is True,
                push_granularity=granularity_of(extra),
                layer_push_min_bytes=int(
                    extra.get("layer_push_min_bytes", DEFAULT_LAYER_PUSH_MIN_BYTES)
                ),
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                tp_rank=tp_rank,
                total_kv_heads=_total_kv_heads(vllm_config),
                verify_kv=str(extra.get("verify_kv", DEFAULT_VERIFY_KV)),
                verify_kv_sample=_fraction(extra),
                control_dir=_control_dir(extra),
                of_both=False,  # sides() makes those
                kv_groups=kv_groups_of(
                    kv_cache_config,
                    getattr(vllm_config, "model_config", None),
                    int(vllm_config.parallel_config.tensor_parallel_size),
                ),
                continues_from_t1=_continues_from_t1(vllm_config),
                **durations,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad KvPushConnector config: {e}") from e


def _continues_from_t1(vllm_config: Any) -> bool:
    """vLLM's scheduler class is kvpush's (``--scheduler-cls``)."""
    from kvpush.connector.decode.first_token import FirstTokenMixin

    scheduler = getattr(vllm_config, "scheduler_config", None)
    get_cls = getattr(scheduler, "get_scheduler_cls", None)
    if not callable(get_cls):
        return False
    try:
        cls = get_cls()
    except (ImportError, ValueError):  # vLLM reports a bad class itself
        return False
    return isinstance(cls, type) and issubclass(cls, FirstTokenMixin)


def _engine_port(extra: dict[str, Any], parallel: Any) -> int:
    """This engine's first side-channel port: the instance's, after the
    ports of the DP ranks before it."""
    base = int(extra.get("side_channel_port", 0))
    dp_rank = int(getattr(parallel, "data_parallel_index", 0) or 0)
    return ranks.dp_engine_port(base, dp_rank, int(parallel.tensor_parallel_size))


def _fraction(extra: dict[str, Any]) -> float:
    """``verify_kv_sample`` of the extra config, as a number."""
    value = extra.get("verify_kv_sample", DEFAULT_VERIFY_SAMPLE)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            "kv_connector_extra_config.verify_kv_sample must be a number in "
            f"(0, 1], not {value!r}"
        )
    return float(value)


def _control_dir(extra: dict[str, Any]) -> str:
    """``control_dir`` of the extra config ("" when not given)."""
    value = extra.get("control_dir", "")
    if not isinstance(value, str):
        raise ValueError(
            "kv_connector_extra_config.control_dir must be a directory path "
            f"(a string), not {value!r}"
        )
    return value


def check_control_dir(path: str) -> None:
    """Raise ValueError unless ``path`` is empty (off) or an absolute path
    (a relative one would depend on vLLM's working directory)."""
    if not path:
        return
    if "\0" in path or not os.path.isabs(path):
        raise ValueError(
            "kv_connector_extra_config.control_dir must be an absolute path "
            f"(or empty: off), not {path!r}"
        )


def _total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over every TP rank (vLLM's
    ``ModelConfig.get_total_num_kv_heads``; 0 when the config has none).

    MLA (``ModelConfig.use_mla``) caches one latent per token and layer, not
    per head, and every TP rank holds all of it: to the TP mapping that is one
    KV head, replicated on every rank, so each decode rank is written once, by
    one prefill rank (:mod:`kvpush.transfer.heads`)."""
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "use_mla", False) is True:
        return 1
    total = getattr(model, "get_total_num_kv_heads", None)
    return int(total()) if callable(total) else 0


def check_nixl_backend(name: str) -> None:
    """Raise ValueError unless ``name`` is a NIXL backend kvpush supports."""
    if name not in NIXL_BACKENDS:
        raise ValueError(
            f"nixl_backend must be one of {', '.join(NIXL_BACKENDS)}, not {name!r}"
        )


def check_push_granularity(name: str) -> None:
    """Raise ValueError unless kvpush can push at granularity ``name``."""
    if name not in PUSH_GRANULARITIES:
        raise ValueError(
            f"push_granularity must be one of {', '.join(PUSH_GRANULARITIES)}, "
            f"not {name!r}"
        )


def granularity_of(extra: dict[str, Any] | None) -> str:
    """``push_granularity`` of a ``kv_connector_extra_config`` (the default
    when it names none)."""
    return str((extra or {}).get("push_granularity", DEFAULT_PUSH_GRANULARITY))
