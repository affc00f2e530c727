"""How each soak request ended: completed, aborted, failed or lost.

- **completed**: the full output (``max_tokens`` tokens) and a
  ``finish_reason``;
- **aborted**: the client closed the connection on purpose, before the
  first token or mid-stream;
- **failed**: the server said what went wrong, in OpenAI's shape: an HTTP
  error with an ``{"error": {"message": ...}}`` body, or such an event in
  the stream;
- **lost**: everything else: no answer before the deadline, a connection
  broken or refused, an error with no error body, a stream that ended
  without a ``finish_reason`` or with fewer tokens than asked for.

A healthy system loses nothing: a client may always tell an error it was
told about from one it was left to guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpush_lab.bench.records import STREAM_ERROR, RequestRecord

OutcomeKind = Literal["completed", "aborted", "failed", "lost"]
OUTCOME_KINDS: tuple[OutcomeKind, ...] = ("completed", "aborted", "failed", "lost")
BEFORE_FIRST_TOKEN = "before first token"
MID_STREAM = "mid-stream"


class SoakRecord(RequestRecord, kw_only=True):
    """A request record plus the client's planned abort: ``abort_after_s``
    after the send (None: never), and whether it happened (``is_aborted``:
    the request was still running then)."""

    abort_after_s: float | None = None
    is_aborted: bool = False


@dataclass(frozen=True)
class Outcome:
    """How one request ended, and why (a short reason to count by)."""

    kind: OutcomeKind
    reason: str


def classify(record: SoakRecord) -> Outcome:
    """The outcome of one finished request."""
    if record.is_aborted:
        phase = MID_STREAM if record.token_times_s else BEFORE_FIRST_TOKEN
        return Outcome("aborted", phase)
    if record.error is None:
        return _ended(record)
    if record.error.startswith("http_") or record.error == STREAM_ERROR:
        if record.error_message is not None:
            return Outcome("failed", record.error)
        return Outcome("lost", f"{record.error} without an error body")
    return Outcome("lost", record.error)


def _ended(record: SoakRecord) -> Outcome:
    """A stream that ended with ``[DONE]``."""
    if record.finish_reason is None:
        return Outcome("lost", "no finish_reason")
    if record.num_output_tokens != record.output_len:
        return Outcome("lost", "short output")
    return Outcome("completed", record.finish_reason)
