"""Store outages, reported once: the first failure of a store warns, what meets it again while it is
down says nothing more (debug), and the first call it answers after that says so in one line.

Outages are keyed by the store's URL (without credentials) for the whole process, so every path
that meets one (answers, memo, prefix records, deposits, `explain`) and every engine over the
same store report it once between them.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlsplit, urlunsplit

from kvrag.errors import KVRagError, StoreUnavailableError, cause_of

__all__ = ["went_down", "answered", "part_of_an_outage", "log_failure", "public_url"]

log = logging.getLogger("kvrag.stores")

_down: dict[str, str] = {}
_lock = threading.Lock()


def public_url(url: str) -> str:
    """`url` without the user name and password it may carry (safe for logs and errors)."""
    pieces = []
    for piece in url.split(","):
        try:
            parts = urlsplit(piece)
        except ValueError:
            pieces.append(piece)
            continue
        if "@" in parts.netloc:
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        pieces.append(urlunsplit(parts))
    return ",".join(pieces)


def went_down(url: str, why: str) -> bool:
    """Report that the store at `url` failed; True if this began an outage (and was warned)."""
    name = public_url(url)
    with _lock:
        began = name not in _down
        _down[name] = why
    if began:
        log.warning("%s is unavailable (%s): what it holds is read as text until it answers again (reported once)",
                    name, " ".join(why.split())[:300])
    else:
        log.debug("%s still unavailable: %s", name, why)
    return began


def answered(url: str) -> None:
    """The store at `url` answered a call: if it was down, say in one line that it is back."""
    if not _down:  # the common case, without the lock
        return
    name = public_url(url)
    with _lock:
        was_down = _down.pop(name, None) is not None
    if was_down:
        log.warning("%s answers again: its states are grafted again", name)


def part_of_an_outage(error: BaseException) -> bool:
    """Whether `error` comes of a store being unavailable (already reported by `went_down`)."""
    return cause_of(error, StoreUnavailableError) is not None


def log_failure(logger: logging.Logger, message: str, *args: object, error: KVRagError) -> None:
    """Log what a store failure cost a path: a warning, unless it is part of an outage that was
    already reported (then debug: one warning per outage, whichever path meets it)."""
    logger.log(logging.DEBUG if part_of_an_outage(error) else logging.WARNING, message, *args)
