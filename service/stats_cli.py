"""`tiercache stats`: the daemon's state as a table (from its Stats call), once, or
redrawn every few seconds with rates since the last draw."""

from __future__ import annotations

import argparse
import sys
import time

from tiercache.client import CacheStats, Client
from tiercache.errors import TiercacheError
from tiercache.results import Tier
from tiercache.metrics import HOPS

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
_RATES = (("matches", "matches"), ("requested_pages", "pages asked"),
          ("matched_pages", "pages matched"), ("loaded_pages", "pages loaded"),
          ("stored_pages", "pages stored"))


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("stats", help="show the daemon's tiers, workers, hit rate and counters")
    parser.add_argument("--address", default=None, help="the daemon's address, unix:PATH or "
                        "host:port (default: $TIERCACHE_ADDRESS, else the default socket)")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="redraw every SECONDS, with rates, until Ctrl-C")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")


def run(args: argparse.Namespace) -> int:
    client = Client(args.address, timeout=args.timeout)
    if args.watch is not None and args.watch <= 0:
        print("tiercache stats: --watch takes a positive number of seconds", file=sys.stderr)
        return 2
    previous: tuple[float, CacheStats] | None = None
    try:
        while True:
            stats, now = client.stats(), time.monotonic()
            if args.watch is None:
                print(render(client.address, stats))
                return 0
            print(_CLEAR + render(client.address, stats, previous and (now - previous[0], previous[1])),
                  flush=True)
            previous = (now, stats)
            time.sleep(args.watch)
    except TiercacheError as error:
        print(f"tiercache stats: cannot read the daemon at {client.address}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


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
    asked, matched = c.get("requested_pages", 0), c.get("matched_pages", 0)
    rate = f"{100 * matched / asked:.1f}%" if asked else "-"
    by_tier = "  ".join(f"{t.name.lower()} {c.get(f'matched_pages_{t.name.lower()}', 0):,}"
                        for t in Tier)
    lines += ["", f"hit rate    {rate}  ({matched:,} of {asked:,} pages asked, "
                  f"{c.get('matches', 0):,} matches)",
              f"matched     pages by tier: {by_tier}",
              f"loads       {c.get('loads', 0):,} ({c.get('loaded_pages', 0):,} pages)",
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
