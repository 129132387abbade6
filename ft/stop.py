"""`ft stop [PORT|all]`: stop running `ft serve` processes gracefully: answers in flight finish
within the server's shutdown grace, the checkpoint store is flushed and closed, then it exits.
A router (`ft serve --replicas`) stops its group: the router, then its workers."""

from __future__ import annotations

import argparse
import sys

from ft import servers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", nargs="?", default=None, metavar="PORT|all",
                        help="the server's port, or all (default: the only one running)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="how long to wait for each to exit (default 120)")


def chosen(which: str | None) -> list[servers.ServerRecord]:
    """The records to stop; a router's workers go with it (stopping the router stops them), so they
    are not named again beside it."""
    running = servers.running()
    grouped = {port for r in running if r.is_router for port in r.workers}
    tops = [r for r in running if r.port not in grouped]
    if which in ("all", None):
        running = tops
    if which == "all":
        return running
    if which is None:
        if len(running) > 1:
            ports = ", ".join(str(r.port) for r in running)
            raise LookupError(f"{len(running)} servers are running (ports {ports}): name one, or all")
        return running
    if not which.isdigit():
        raise LookupError(f"expected a port or all, got {which!r}")
    found = [r for r in running if r.port == int(which)]
    if not found:
        raise LookupError(f"no ft server on port {which} (`ft ps` lists them)")
    return found


def run(args: argparse.Namespace) -> int:
    try:
        records = chosen(args.which)
    except LookupError as exc:
        print(f"ft stop: {exc}", file=sys.stderr)
        return 1
    if not records:
        print("no ft server running")
        return 0
    failed = 0
    for record in records:
        if servers.stop(record, args.timeout):
            what = f"router and its workers (ports {', '.join(map(str, record.workers))})" if record.is_router else "server"
            print(f"stopped the {what} on port {record.port} (pid {record.pid}, {record.model})")
        else:
            print(f"ft stop: the server on port {record.port} (pid {record.pid}) did not exit within "
                  f"{args.timeout:g} s", file=sys.stderr)
            failed += 1
    return 1 if failed else 0
