"""What the scheduler's half of the connector tells the workers' halves, and back.

Every step the scheduler sends each worker the same jobs (vLLM pickles the metadata to
every rank); each rank runs them against its own registrations. Prompts travel as their
page keys and checks (a `hashing.Chain`, 24 bytes a page), never as tokens, and block
ids are vLLM's, per KV cache group. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.hashing import Chain


def head(chain: Chain, pages: int) -> Chain:
    """The first `pages` pages of a chain."""
    return Chain(chain.keys[:pages], chain.checks[:pages])


def tail(chain: Chain, start: int) -> Chain:
    """The pages of a chain from page `start` on (keys name whole prefixes, so a tail
    is matched and loaded as it stands)."""
    return Chain(chain.keys[start:], chain.checks[start:])


@dataclass(frozen=True)
class LoadJob:
    """Copy a hit of `len(chain.keys)` pages into a request's blocks. vLLM computed the
    first `start` pages itself; attention groups take pages start..end-1, each Mamba
    group the state after the last page, into one block."""

    req_id: str
    chain: Chain
    start: int
    kv_blocks: dict[int, tuple[int, ...]]  # attention group -> blocks of pages start..end-1
    state_blocks: dict[int, int]  # Mamba group -> the block that takes the state at the end
    problem: str = ""  # why vLLM's allocation cannot take this hit: the load fails at once

    @property
    def end(self) -> int:
        return len(self.chain.keys)


@dataclass(frozen=True)
class SaveJob:
    """Store a request's full pages (attention groups, from the append-only block table:
    the blocks of pages 1..n) and the states vLLM offered this step (Mamba groups: the
    exact block that holds the state after `pages` pages). The scheduler holds a
    reference on every block named here until all ranks report the job."""

    job_id: int
    req_id: str
    chain: Chain  # pages 1..the deepest page saved
    kv_blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    states: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # (pages, block)

    def blocks(self) -> list[int]:
        return [b for blocks in self.kv_blocks.values() for b in blocks] + [
            b for states in self.states.values() for _, b in states]


@dataclass(frozen=True)
class Jobs:
    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()


@dataclass(frozen=True)
class SaveReport:
    """Save jobs finished by how many ranks, and whether every one of them stored all."""

    done: dict[int, tuple[int, bool]] = field(default_factory=dict)  # job -> (ranks, all ok)

    def merged(self, other: "SaveReport") -> "SaveReport":
        done = dict(self.done)
        for job, (ranks, ok) in other.done.items():
            before = done.get(job, (0, True))
            done[job] = (before[0] + ranks, before[1] and ok)
        return SaveReport(done)
