"""`tiercache stats`: the daemon's state as a table (from its Stats call), once, or
redrawn every few seconds with rates since the last draw; `--json` for scripts.

It imports gRPC and the wire messages only (tiercache.channel), never torch or numpy:
the command answers in a fraction of a second."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import sys
import time

import grpc

from tiercache_service.lookups import hit_rate
from tiercache.channel import connect
from tiercache.metrics import HOPS
from tiercache.results import CacheStats, Tier, TierStats
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
_RATES = (("matches", "matches"), ("requested_pages", "pages asked (match)"),
          ("lookup_pages_load", "pages asked (load)"), ("matched_pages", "pages matched"),
          ("loaded_pages", "pages loaded"), ("stored_pages", "pages stored"))
_BUDGET_NOTE = ("the disk budget is the share of the LMDB map (--disk-map-size) kept for "
                "entries, 80%: 12.8 GiB of a 16 GiB map; the rest is room for LMDB's own pages "
                "(B-tree, free lists, copy-on-write)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "stats", help="show the daemon's tiers, workers, hit rate and counters",
        description="The daemon's tiers, workers, hit rate and counters. The hit rate counts "
        "the pages asked by Match calls and by Loads that no Match came before (a Load after "
        "its Match is not asked twice). Note: " + _BUDGET_NOTE + ".")
    parser.add_argument("--address", default=None, help="the daemon's address, unix:PATH or "
                        "host:port (default: $TIERCACHE_ADDRESS, else the default socket)")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="redraw every SECONDS, with rates, until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with "
                        "--watch, one a line) instead of the table, for scripts")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")


def read(stub: pb_grpc.TiercacheStub, timeout: float, metadata: tuple) -> CacheStats:
    reply = stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=metadata)
    tiers = tuple(TierStats(Tier(t.tier), t.entries, t.used_bytes, t.budget_bytes)
                  for t in reply.tiers)
    return CacheStats(tiers, dict(reply.counters), reply.workers)


def run(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        print("tiercache stats: --watch takes a positive number of seconds", file=sys.stderr)
        return 2
    connection = connect(args.address)
    stub = pb_grpc.TiercacheStub(connection.channel)
    previous: tuple[float, CacheStats] | None = None
    # Ctrl-C ends --watch between two reads: raised inside a gRPC call, KeyboardInterrupt
    # could leave the channel's close waiting (seen under load in CI)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set():
            stats, now = read(stub, args.timeout, connection.metadata), time.monotonic()
            if args.json:
                print(json.dumps(as_json(connection.address, stats)), flush=True)
            elif args.watch is None:
                print(render(connection.address, stats))
            else:
                print(_CLEAR + render(connection.address, stats,
                                      previous and (now - previous[0], previous[1])), flush=True)
            if args.watch is None:
                return 0
            previous = (now, stats)
            stop.wait(args.watch)
        return 0
    except grpc.RpcError as error:
        print(f"tiercache stats: cannot read the daemon at {connection.address}: "
              f"{error.details()} ({error.code().name})", file=sys.stderr)  # type: ignore[attr-defined]
        return 2
    finally:
        connection.channel.close()


def as_json(address: str, stats: CacheStats) -> dict:
    """The figures of the table, for scripts: sizes in bytes, the hit rate as a ratio."""
    hit, asked = hit_rate(stats.counters)
    return {"address": address, "time": time.time(), "workers": stats.workers,
            "tiers": [{"tier": t.tier.name.lower(), "entries": t.entries, "used_bytes": t.used_bytes,
                       "budget_bytes": t.budget_bytes} for t in stats.tiers],
            "hit_rate": {"hit_pages": hit, "asked_pages": asked,
                         "ratio": hit / asked if asked else None},
            "counters": stats.counters}


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def render(address: str, stats: CacheStats, since: tuple[float, CacheStats] | None = None) -> str:
    """The whole table; `since` = (seconds, the stats then) adds rates."""
    c = stats.counters
    lines = [f"tiercache at {address}    {time.strftime('%Y-%m-%d %H:%M:%S')}    "
             f"workers {stats.workers}", "", _tiers(stats)]
    hit, asked = hit_rate(c)
    rate = f"{100 * hit / asked:.1f}%" if asked else "-"
    by_tier = "  ".join(f"{t.name.lower()} {c.get(f'matched_pages_{t.name.lower()}', 0):,}"
                        for t in Tier)
    lines += ["", f"hit rate    {rate}  ({hit:,} of {asked:,} pages asked by "
                  f"{c.get('lookups_match', 0):,} matches and {c.get('lookups_load', 0):,} loads "
                  "without a match)",
              f"matched     pages by tier: {by_tier}",
              f"loads       {c.get('loads', 0):,} ({c.get('loaded_pages', 0):,} pages; "
              f"{c.get('lookups_load_after_match', 0):,} after a match)",
              f"stored      pages {c.get('stored_pages', 0):,}  checkpoints "
              f"{c.get('stored_checkpoints', 0):,}  declined {c.get('declined_checkpoints', 0):,}"
              f"  no room {c.get('skipped_pages', 0) + c.get('skipped_checkpoints', 0):,}",
              "evicted     " + "  ".join(_evicted(c, t.tier.name.lower()) for t in stats.tiers),
              f"tiering     disk writes {c.get('disk_writes', 0):,}  demoted {c.get('demoted', 0):,}  "
              f"promoted {c.get('promoted', 0):,}  checksum failures {c.get('checksum_failures', 0):,}",
              "moved       " + "  ".join(f"{a}->{b} {size(c.get(f'bytes_{a}_to_{b}', 0))}"
                                         for a, b in HOPS if c.get(f"bytes_{a}_to_{b}", 0))]
    if "remote_lookups" in c:  # a remote tier is configured
        errors = sum(v for k, v in c.items() if k.startswith("remote_errors_"))
        lines.append(f"remote      matched pages {c.get('matched_pages_remote', 0):,}  fetched "
                     f"{c['remote_fetched']:,}  written {c['remote_written']:,}  skipped "
                     f"{c['remote_writes_skipped']:,}  errors {errors:,}  damaged "
                     f"{sum(v for k, v in c.items() if k.startswith('remote_damaged_')):,}")
    if since is not None:
        lines += ["", _rates(stats, *since)]
    return "\n".join(lines)


def _tiers(stats: CacheStats) -> str:
    rows = [f"{'tier':<8}{'entries':>12}{'used':>14}{'budget':>14}{'used %':>9}"]
    for tier in stats.tiers:
        share = f"{100 * tier.used_bytes / tier.budget_bytes:.1f}" if tier.budget_bytes else "-"
        rows.append(f"{tier.tier.name.lower():<8}{tier.entries:>12,}{size(tier.used_bytes):>14}"
                    f"{size(tier.budget_bytes):>14}{share:>9}")
    disk = next((t for t in stats.tiers if t.tier == Tier.DISK), None)
    mapped = stats.counters.get("disk_map_bytes", 0)
    if disk is not None and mapped:  # why a 16 GiB map shows a 12.8 GiB budget
        rows.append(f"(disk budget: {100 * disk.budget_bytes / mapped:.0f}% of the "
                    f"{size(mapped)} LMDB map; the rest is room for LMDB's own pages)")
    return "\n".join(rows)


def _evicted(c: dict[str, int], tier: str) -> str:
    return (f"{tier} {c.get(f'evicted_{tier}', 0):,} (requested {c.get(f'evicted_{tier}_by_request', 0):,},"
            f" damaged {c.get(f'evicted_{tier}_damaged', 0):,})")


def _rates(now: CacheStats, seconds: float, then: CacheStats) -> str:
    def per_second(key: str) -> float:
        return (now.counters.get(key, 0) - then.counters.get(key, 0)) / max(seconds, 1e-9)
    moved = sum(per_second(f"bytes_{a}_to_{b}") for a, b in HOPS)
    return (f"per second  " + "  ".join(f"{label} {per_second(key):,.1f}" for key, label in _RATES)
            + f"  moved {size(moved)}")
