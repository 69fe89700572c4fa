"""The engine's long chores: the startup rebuild of the index and the flush to disk each
log what they do, how much and how long, with progress lines while they run, and keep
their totals for the daemon's metrics."""

from __future__ import annotations

import logging
import threading

import pytest

from drills.worlds import hybrid_layout, prompt_keys, random_buffers
from tiercache.chores import ChoreStats, watched
from tiercache.engine import Engine, EngineConfig
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

LAYOUT = hybrid_layout(page_rows=64, slot_rows=4)


def open_engine(tmp_path) -> Engine:
    # no write-ahead: the flush is what takes the entries to disk
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 26, pin=False),
                                    disk=DiskConfig(str(tmp_path), map_size=1 << 27),
                                    policy=PolicyConfig(writes=WriteConfig(clean_ahead=0.0))))


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiercache.engine"]


def test_a_long_chore_logs_progress_while_it_runs_and_its_totals_at_the_end(caplog):
    caplog.set_level(logging.INFO, "tiercache.engine")
    stats, done, release = ChoreStats(), [0], threading.Event()
    # 1. a chore of 10 entries that stops halfway until progress lines were written
    with watched(stats, "counting sheep", 10, lambda: done[0], every=0.01):
        done[0] = 5
        while sum("5 of 10 entries" in m for m in messages(caplog)) < 2:
            release.wait(0.01)
        done[0] = 10
    lines = messages(caplog)
    # 2. a line when it starts, progress lines, and one with the outcome
    assert lines[0] == "counting sheep: 10 entries"
    assert lines[1].startswith("counting sheep: 5 of 10 entries after ")
    assert lines[-1].startswith("counting sheep: done, 10 entries in ")
    assert (stats.runs, stats.entries) == (1, 10) and stats.seconds > 0


def test_a_chore_that_fails_says_so(caplog):
    caplog.set_level(logging.INFO, "tiercache.engine")
    stats = ChoreStats()
    with pytest.raises(OSError):
        with watched(stats, "flushing", 3, lambda: 1):
            raise OSError("disk gone")
    assert messages(caplog)[-1].startswith("flushing: failed, 1 entries in ")
    assert caplog.records[-1].levelno == logging.WARNING and stats.entries == 1


def test_the_flush_at_close_and_the_rebuild_at_open_are_logged_and_counted(tmp_path, caplog):
    caplog.set_level(logging.INFO, "tiercache.engine")
    engine = open_engine(tmp_path)
    # 1. a fresh disk: the rebuild found nothing
    assert (engine.rebuilt.runs, engine.rebuilt.entries) == (1, 0)
    # 2. 4 pages and their checkpoint in the host, flushed to disk at close
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=4)
    engine.store(worker, keys, range(4), {4: 0})
    engine.flush()
    assert (engine.flushed.runs, engine.flushed.entries) == (1, 5)
    engine.close()
    assert "flushing the host tier to disk: done, 5 entries in" in " ".join(messages(caplog))
    # 3. opened again: the rebuild indexes the 5 entries, and says so
    caplog.clear()
    engine = open_engine(tmp_path)
    assert (engine.rebuilt.entries, engine.stats().tiers[-1].entries) == (5, 5)
    assert engine.rebuilt.seconds > 0
    lines = messages(caplog)
    assert lines[0] == f"rebuilding the index from the disk tier at {tmp_path}: 5 entries"
    assert lines[-1].startswith(f"rebuilding the index from the disk tier at {tmp_path}: done, "
                                "5 entries in ")
    engine.close()
