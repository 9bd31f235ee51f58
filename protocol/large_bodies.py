"""Large request bodies parsed off the event loop, in a pool of worker processes.

A JSON parser builds Python objects and holds the GIL while it does: a 3.8 MB body of
120k tiny messages takes ~40 ms to parse and ~7 ms to free, and a thread would stall the
loop all the same. So a body of ``LARGE_BODY_BYTES`` or more (the gateway's endpoint
decides) is parsed by a ``WorkPool`` of processes (``protocol.offload``: fair across
tenants, bounded, 429/503): the worker applies every bound that needs no model, so a
refused body's objects never cross back, and a body that passes comes back as one pickled
object. Both directions go through a file in memory, not the executor's pipe
(``parse_body``). docs/gateway.md#large-bodies-the-parse-pool has the figures
(``python -m protocol.bench.large_bodies``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

from .contract import check_message_count, check_render_size
from .json_body import loads_strict_checked, require_object
from .offload import OffloadSettings, Wording, WorkPool

PARSE = Wording("parse", "large request bodies of yours are being parsed", "too_many_large_bodies",
                "parsing too many large request bodies", "large_bodies_busy")
PARSE_WORKERS = 2


def parse_pool(settings: OffloadSettings | None = None) -> WorkPool:
    """A pool of processes for ``parse_body``: two workers, four bodies per tenant."""
    return WorkPool(settings or OffloadSettings(workers=PARSE_WORKERS, per_tenant=4,
                                                max_waiting=64),
                    processes=True, wording=PARSE)


def parse_body_job(raw: bytes) -> tuple[dict[str, Any], int]:
    """A request body parsed in a worker (``json_body`` rules), with the bounds that need no
    model checked there too (``MAX_MESSAGES``, ``MAX_PROMPT_VALUES``), so that a body of
    120k tiny messages is refused without its objects crossing back; returns the object and
    its size in bytes (for the memory trim)."""
    body: dict[str, Any] = loads_strict_checked(raw, _bounds)
    return body, len(raw)


def _bounds(value: Any) -> None:
    body = require_object(value)
    check_message_count(body)
    check_render_size(body.get("messages"), body.get("tools"))


def parse_file_job(path: str) -> tuple[None, int]:
    """``parse_body_job`` on the bytes of the file ``path``, whose content it replaces with
    the pickled object (see ``parse_body``)."""
    with open(path, "rb") as f:
        raw = f.read()
    body, size = parse_body_job(raw)
    del raw
    with open(path, "wb") as f:
        pickle.dump(body, f, protocol=pickle.HIGHEST_PROTOCOL)
    return None, size


def parse_job(raw: bytes) -> Callable[[], tuple[dict[str, Any], int]]:
    """A picklable job for ``WorkPool.run`` that parses ``raw``, sent through the pool's
    pipe (fine for small bodies: tests; the server uses ``parse_body``)."""
    return functools.partial(parse_body_job, raw)


# Files in memory (tmpfs) where there is one.
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


async def parse_body(pool: WorkPool, tenant: str, raw: bytes) -> dict[str, Any]:
    """``raw`` parsed in ``pool`` for ``tenant``. The bytes go to the worker and the object
    comes back through a file in memory, not through the executor's pipe, which moves 64 KiB
    per read, each read waiting for the GIL: a 3.8 MB string body took ~10 ms to cross each
    way (idle), where the whole job through a file takes ~20 ms (docs/gateway.md#large-
    bodies-the-parse-pool). The file is removed once the job is done, or once the caller
    has gone (a worker that then opens it fails a job nobody waits for)."""
    path = _write_body(raw)
    try:
        await pool.run(tenant, functools.partial(parse_file_job, path))
        return _read_object(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _write_body(raw: bytes) -> str:
    """A new file holding ``raw``: a copy in memory (tmpfs), ~1 ms for 4 MB, on the loop."""
    fd, path = tempfile.mkstemp(prefix="sluice-body-", dir=_SHM)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def _read_object(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        body: dict[str, Any] = pickle.loads(f.read())
    return body


def warm(pool: WorkPool) -> None:
    """Start ``pool``'s workers now, with this module (and what parsing needs: orjson, the
    contract) already imported in them: ~0.15 s the first large body would pay otherwise."""
    pool.warm(_imported)


def _imported() -> None:
    """Run in a new worker: importing this module there is the point."""
