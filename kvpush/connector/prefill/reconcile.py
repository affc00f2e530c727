"""Prefill's answer to a decode that reconnected: which transfers will
never be written.

A ROUTER socket drops what it sends to a peer whose connection is down, so
a Failure prefill sent to a decode during a partition is lost, and the
decode's old sockets (the routes prefill answers on) are gone with it.
After the connection comes back decode sends a
:class:`~kvpush.transfer.messages.Reconcile` naming every receive it still
waits on from this prefill. For each id, :func:`answer` says what to do:

* prefill still *holds* it (a half waiting in the matcher, or a
  :class:`~kvpush.connector.prefill.transfer.Transfer` in any phase):
  it carries on, and its final word will reach this decode rank: the
  WRITE's Done as its NIXL notification, a Failure on the Reconcile's
  socket (and on every other decode rank's that reconciled it: with decode
  TP larger than prefill's each decode rank this prefill rank writes sends
  its own Reconcile, :meth:`~kvpush.connector.prefill.tell.Teller.reconciled`);
* otherwise no WRITE of it is in flight or can be posted: the id is closed
  in the matcher (a Registration that comes later under it is refused, for
  the matcher's tombstone time), and prefill says its final word again
  (:meth:`~kvpush.connector.prefill.tell.Teller.again`): the Failure it
  sent, the Done of a WRITE NIXL reported complete, or ``Failure(peer_lost)``
  when it remembers none;
* a transfer another decode registered for: never written for this one;
  refused (a Failure on the Reconcile's socket), nothing else changes.

Pure: the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
asks :func:`answer` per id and does what it says.
"""

from __future__ import annotations

import enum


class Answer(enum.Enum):
    """What prefill does about one id a decode reconciled."""

    OTHER_DECODE = "other_decode"  # refuse it: another decode's transfer
    LIVE = "live"  # held: its final word goes to the Reconcile's socket too
    ENDED = "ended"  # not held: close the id, say the final word again


def answer(engine: str, owner: str | None, holds: bool) -> Answer:
    """The answer to decode ``engine`` about an id that ``owner`` (None:
    no decode) registered for, which prefill ``holds`` or not."""
    if owner is not None and owner != engine and holds:
        return Answer.OTHER_DECODE
    return Answer.LIVE if holds else Answer.ENDED
