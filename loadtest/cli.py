"""Subcommands of the load-testing tools (`sluice loadtest`, `sluice fake-upstream`).

The server code is imported inside the command function, so building the `sluice` parser
stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _fake_upstream(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from loadtest.fake_upstream import start_fake_upstream

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = await start_fake_upstream(args.host, args.port, args.chunks, args.delay_ms,
                                           args.model)
        try:
            print(f"fake upstream ready at {server.base_url}", flush=True)
            await stop.wait()
        finally:
            await server.close()

    if args.chunks < 1 or args.delay_ms < 0:
        print("sluice fake-upstream: --chunks must be >= 1 and --delay-ms >= 0",
              file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # no uvloop on this platform: the default loop works, slower
        asyncio.run(serve())
    else:
        uvloop.run(serve())
    return 0


def _loadtest(args: argparse.Namespace) -> int:
    from loadtest.command import loadtest_main

    return loadtest_main(args)


def register(sub: Any) -> None:
    """Add the load-testing subcommands to the `sluice` parser."""
    from loadtest.command import add_arguments

    lt = sub.add_parser("loadtest", help="load test (open or closed loop): goodput, SLOs, "
                                         "capacity; `loadtest compare A B`: A/B of two runs")
    add_arguments(lt)
    lt.set_defaults(func=_loadtest)
    p = sub.add_parser("fake-upstream",
                       help="instant OpenAI-compatible upstream for measuring gateway overhead")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port (0: any free port)")
    p.add_argument("--chunks", type=int, default=20,
                   help="content chunks per streamed completion (default 20)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="pause between streamed chunks in ms (default 0)")
    p.add_argument("--model", default="fake", help="model name in /v1/models (default fake)")
    p.set_defaults(func=_fake_upstream)
