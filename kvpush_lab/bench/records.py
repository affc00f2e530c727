"""The raw per-request record: what the client saw, one JSONL line each.

Every request the benchmark sends gets exactly one record, failed or not:
``error`` names what went wrong (``None`` when it succeeded), and
``error_message`` holds the message of an OpenAI-shaped error (an error
body, or an error event in the stream) when the server sent one. Times are in
seconds; ``token_times_s`` holds, for each streamed chunk that carried a
generated token, its arrival as an offset from the send.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec

REQUESTS_FILE = "requests.jsonl"

# error kinds
TIMEOUT = "timeout"
CONNECT = "connect"
STREAM_ERROR = "stream_error"
INCOMPLETE = "incomplete"
NO_TOKENS = "no_tokens"
ABORTED = "aborted"  # the client closed the connection on purpose (a churn)


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it."""

    config: str
    point: int
    link_gbit: float | None = None  # the rehearsal links' rate, if shaped
    round: int | None = None  # of a repeated run (--repeat)
    index: int
    bench_id: str
    prompt_len: int
    output_len: int  # requested
    scheduled_s: float  # planned send, offset from the point's start
    sent_s: float = 0.0  # actual send, offset from the point's start
    sent_wall: float = 0.0  # actual send, seconds since the epoch
    status: int = 0  # HTTP status (0: no response)
    error: str | None = None
    error_detail: str | None = None
    error_message: str | None = None  # from an OpenAI-shaped error, if any
    finish_reason: str | None = None  # of the last choice that carried one
    token_times_s: list[float] = msgspec.field(default_factory=list)
    end_s: float | None = None  # offset from send when the response ended
    prompt_tokens: int | None = None  # as the server counted them (usage)
    output_tokens: int | None = None
    turn: int | None = None  # a conversation's turn (multi-turn workload)
    binding: str | None = None  # kvpush router's x-kvpush-binding header
    decode: str | None = None  # ... and x-kvpush-decode
    output_token_ids: list[int] = msgspec.field(default_factory=list)  # if asked

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens: the server's count, else the chunks seen."""
        if self.output_tokens is not None:
            return self.output_tokens
        return len(self.token_times_s)

    @property
    def is_short(self) -> bool:
        """A success that produced fewer (or more) tokens than asked for."""
        return self.is_ok and self.num_output_tokens != self.output_len


def wall_window(records: Iterable[RequestRecord]) -> tuple[float, float]:
    """Wall-clock span (epoch seconds) from the first send to the last end."""
    spans = [(r.sent_wall, r.sent_wall + (r.end_s or 0.0)) for r in records]
    if not spans:
        return (0.0, 0.0)
    return min(s for s, _ in spans), max(e for _, e in spans)


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    """Append records to a JSONL file."""
    encoder = msgspec.json.Encoder()
    with open(path, "ab") as f:
        for record in records:
            f.write(encoder.encode(record) + b"\n")


def read_records(path: Path) -> list[RequestRecord]:
    """Every record of a JSONL file."""
    decoder = msgspec.json.Decoder(RequestRecord)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read request records {path}: {e}") from e
    try:
        return [decoder.decode(line) for line in lines if line.strip()]
    except msgspec.DecodeError as e:
        raise ValueError(f"request records {path} are malformed: {e}") from e
