"""One tier's outages, logged once each instead of once per failed batch.

A tier that goes down (Redis killed, an S3 endpoint unreachable) fails every batch that
reaches it: contains, load, store, delete, the background usage count. Each of those used to
log a WARNING, hundreds of lines in a few seconds. :class:`Outage` is the one place that
decides what to log instead: every site that sees a tier fail calls :meth:`Outage.failed`,
every site that sees it work calls :meth:`Outage.ok`. It is :class:`tierkv.logs.FailureLog`
(one WARNING per outage, a summary at most every ``interval``, one INFO line when the tier
works again, a flapping tier held to the same bound) under the tier's name.
"""

from __future__ import annotations

from tierkv.logs import REPORT_INTERVAL, FailureLog


class Outage(FailureLog):
    """The failure state of one tier, and the log lines about it."""


__all__ = ["REPORT_INTERVAL", "Outage"]
