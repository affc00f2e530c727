"""The wire protocol: every message round-trips; every bad input becomes a
ProtocolError with a reason, and nothing else escapes decode()."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.groups import of, one
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.messages import (
    MAX_IDS_PER_MESSAGE,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Cause,
    DecodeLeg,
    Done,
    Failure,
    FirstToken,
    Heartbeat,
    Hello,
    HelloReply,
    HelloRequest,
    Message,
    PrefillLeg,
    ProtocolError,
    Reconcile,
    Registration,
    SampleLogprobs,
    TransferParams,
    decode,
    encode,
)

LAYOUT = KvLayout.contiguous_layers(
    0x7F00_0000_0000, num_layers=2, num_blocks=64, block_bytes=65536, block_size=128
)
REG = Registration(
    transfer_id="kvp-1a2b",
    decode_engine_id="decode0",
    decode_boot_id="1764477284000000000",
    dst_block_ids=one((7, 8, 9)),
    num_tokens=300,
    ttl_s=30.0,
    first_block=1,
)
MESSAGES: list[Message] = [
    Hello("decode0", "boot1", "decode0-agent", b"\x00nixl\xff" * 10, LAYOUT),
    HelloReply("prefill0", accepted=True, boot_id="pb1"),
    HelloReply("prefill0", accepted=False, boot_id="pb1", reason="block_size differs"),
    HelloRequest("prefill0", decode_boot_id="db1", transfer_id="kvp-1a2b"),
    REG,
    Cancel("kvp-1a2b", "decode0", reason="client went away"),
    Failure("kvp-1a2b", "prefill0", cause=Cause.EXPIRED, detail="no KV in 30 s"),
    Heartbeat("decode0", "boot1"),
    Reconcile("decode0", "boot1", ("kvp-1a2b", "kvp-3c4d")),
    Done("kvp-1a2b", "prefill0", num_blocks=3),
    FirstToken("kvp-1a2b", "prefill0", token_id=77),
    FirstToken("kvp-1a2b", "prefill0", 77, SampleLogprobs((77, 5), (-0.5, -1.25), 1)),
]
FIRST_WITH_LOGPROBS = MESSAGES[-1]


def _first(**logprobs: Any) -> dict[str, Any]:
    """FirstToken's body with its logprobs changed."""
    fields = {"token_ids": [77], "logprobs": [-0.5], "rank": 1, **logprobs}
    return _body(FIRST_WITH_LOGPROBS, logprobs=fields)


def _raw(version: Any, body: Any) -> bytes:
    """Bytes a peer might send, bypassing encode()'s checks."""
    return msgspec.msgpack.encode([version, body])


def _body(msg: Message, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(msg, builtin_types=(bytes,))
    body.update(changes)
    return body


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Message) -> None:
    data = encode(msg)
    assert decode(data) == msg
    assert type(decode(data)) is type(msg)


def test_version_is_checked_before_the_body() -> None:
    # A body this version cannot even parse: the error must still be about
    # the version, proving the payload was not decoded first.
    data = _raw(PROTOCOL_VERSION + 1, {"type": "from_the_future", "x": [1, 2]})
    with pytest.raises(
        ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1} is not supported"
    ):
        decode(data)


def test_oversized_input_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_every_truncation_of_a_valid_message_is_refused() -> None:
    data = encode(REG)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


def test_unknown_message_type_is_named() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'bogus'"):
        decode(_raw(PROTOCOL_VERSION, {"type": "bogus", "transfer_id": "t"}))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed envelope"),
        (b"\xc1", "malformed envelope"),
        (msgspec.msgpack.encode({"version": 1}), "malformed envelope"),
        (_raw("1", {"type": "done"}), "malformed envelope"),
        (_raw(PROTOCOL_VERSION, [1, 2]), "malformed message header"),
        (_raw(PROTOCOL_VERSION, {"transfer_id": "t"}), "malformed message header"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[[1, -2]])), ">= 0"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[[1, 1]])), "repeat"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[[1], [1]])), "repeat"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[[1, 2], [3]])), "one length"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[])), "length >= 1"),
        (_raw(PROTOCOL_VERSION, _body(REG, dst_block_ids=[[]])), "length >= 1"),
        (_raw(PROTOCOL_VERSION, _body(REG, ttl_s=0)), "ttl_s"),
        (_raw(PROTOCOL_VERSION, _body(REG, transfer_id="a b")), "transfer_id"),
        (_raw(PROTOCOL_VERSION, _body(REG, transfer_id="")), "transfer_id"),
        (_raw(PROTOCOL_VERSION, _body(REG, num_tokens=0)), "num_tokens"),
        (_raw(PROTOCOL_VERSION, _body(REG, first_block=-1)), "first_block"),
        (_raw(PROTOCOL_VERSION, _body(MESSAGES[6], cause="bored")), "cause"),
        (_raw(PROTOCOL_VERSION, {"type": "done", "transfer_id": "t"}), "missing"),
        (_raw(PROTOCOL_VERSION, _first(token_ids=[77, 5], logprobs=[-0.5])), "2 token"),
        (_raw(PROTOCOL_VERSION, _first(rank=0)), "rank"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(data)


def test_a_bad_layout_inside_hello_is_refused() -> None:
    body = _body(MESSAGES[0])
    body["layout"]["base_addrs"] = [0, 1, 2]
    body["layout"]["regions_per_layer"] = 2
    with pytest.raises(ProtocolError, match="regions_per_layer"):
        decode(_raw(PROTOCOL_VERSION, body))


def test_metadata_over_its_own_limit_is_refused() -> None:
    hello = Hello("d", "b", "a", b"x" * (MAX_METADATA_BYTES + 1), LAYOUT)
    with pytest.raises(ProtocolError, match="nixl_metadata"):
        encode(hello)


@given(st.binary(max_size=512))
def test_decode_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError as exc:
        assert exc.reason


MSGPACK_INT = st.integers(-(2**63), 2**64 - 1)


@given(st.recursive(MSGPACK_INT | st.text(max_size=8), st.lists, max_leaves=30))
def test_decode_survives_any_well_formed_msgpack(value: Any) -> None:
    for body in (value, {"type": "registration", "dst_block_ids": value}):
        with pytest.raises(ProtocolError):
            decode(_raw(PROTOCOL_VERSION, body))


def test_encode_validates_like_the_receiver() -> None:
    # msgspec checks field constraints only when decoding; encode() must
    # catch a bad locally built message before it reaches a peer.
    bad = Registration("t", "d", "b", one((-1,)), num_tokens=1, ttl_s=1.0)
    with pytest.raises(ProtocolError, match=">= 0"):
        encode(bad)
    with pytest.raises(ProtocolError, match="not a kvpush message"):
        encode(LAYOUT)  # type: ignore[arg-type]


def test_a_registration_carries_one_list_per_group() -> None:
    reg = Registration("t", "d", "b", of([[1, 2], [3, 4]]), num_tokens=20, ttl_s=1.0)
    assert decode(encode(reg)) == reg
    assert reg.num_blocks == 2
    with pytest.raises(ValueError, match="one length"):
        Registration("t", "d", "b", of([[1, 2], [3]]), num_tokens=20, ttl_s=1.0)
    with pytest.raises(ValueError, match="repeat"):
        Registration("t", "d", "b", of([[1, 2], [2, 3]]), num_tokens=20, ttl_s=1.0)


def test_registration_refuses_repeated_destination_blocks_at_construction() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Registration("t", "d", "b", one((1, 1)), num_tokens=20, ttl_s=1.0)


def test_a_reconcile_is_bounded_and_names_each_transfer_once() -> None:
    most = tuple(f"kvp-{'x' * 100}-{i}" for i in range(MAX_IDS_PER_MESSAGE))
    assert len(encode(Reconcile("d", "b", most))) < MAX_MESSAGE_BYTES
    too_many = _body(Reconcile("d", "b", ("t",)), transfer_ids=[*most, "t"])
    with pytest.raises(ProtocolError, match="length"):
        decode(_raw(PROTOCOL_VERSION, too_many))
    for ids in ([], ["t", "t"], ["bad id"]):
        body = _body(Reconcile("d", "b", ("t",)), transfer_ids=ids)
        with pytest.raises(ProtocolError):
            decode(_raw(PROTOCOL_VERSION, body))


# -- TransferParams ---------------------------------------------------------

DECODE_DICT = {
    "role": "decode",
    "transfer_id": "kvp-1",
    "prefill_engine_id": "prefill0",
    "prefill_host": "127.0.0.1",
    "prefill_port": 5600,
}
PREFILL_DICT = {"role": "prefill", "transfer_id": "kvp-1", "decode_engine_id": "d0"}


@pytest.mark.parametrize(
    ("d", "cls"), [(DECODE_DICT, DecodeLeg), (PREFILL_DICT, PrefillLeg)]
)
def test_transfer_params_round_trip(d: dict[str, Any], cls: type) -> None:
    params = TransferParams.from_dict(d)
    assert type(params) is cls
    assert params.to_dict() == d
    assert TransferParams.from_dict(params.to_dict()) == params


def test_transfer_params_ignore_keys_they_do_not_know() -> None:
    params = TransferParams.from_dict({**PREFILL_DICT, "vllm_extra": 1})
    assert params == PrefillLeg(transfer_id="kvp-1", decode_engine_id="d0")


@pytest.mark.parametrize(
    ("d", "hint"),
    [
        ({k: v for k, v in DECODE_DICT.items() if k != "prefill_port"}, "prefill_port"),
        ({**DECODE_DICT, "prefill_port": 0}, "prefill_port"),
        ({**DECODE_DICT, "prefill_port": "5600"}, "prefill_port"),
        ({**DECODE_DICT, "prefill_host": ""}, "prefill_host"),
        ({**PREFILL_DICT, "role": "router"}, "role"),
        ({k: v for k, v in PREFILL_DICT.items() if k != "role"}, "role"),
        ({**PREFILL_DICT, "transfer_id": "has space"}, "transfer_id"),
        ({**PREFILL_DICT, "decode_engine_id": None}, "decode_engine_id"),
    ],
)
def test_transfer_params_say_what_is_wrong(d: dict[str, Any], hint: str) -> None:
    with pytest.raises(ValueError, match=hint) as info:
        TransferParams.from_dict(d)
    assert "Expected role 'prefill'" in str(info.value)


def test_transfer_params_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="JSON object, not list"):
        TransferParams.from_dict([("role", "prefill")])  # type: ignore[arg-type]
