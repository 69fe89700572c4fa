"""The tables of benchmarks.shared_prefix: TTFT by system with hits and misses apart, the
targets of issue 13 as ratios of figures from the same run, and a per-step breakdown."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import print_summary, print_table


@dataclass(frozen=True)
class Request:
    ttft: float
    prompt_tokens: int
    computed: int
    loaded: int
    token: int  # the first token
    first_of_group: bool  # no cache can hit it: a miss for every system
    loaded_from: dict = field(default_factory=dict)  # bytes by tier


def _ms(values: list[float], how) -> float:
    return float(how(np.array(values) * 1e3)) if values else float("nan")


def _mean(a):
    return a.mean()


def _p50(a):
    return np.percentile(a, 50)


def split(requests: list[Request]) -> dict[str, list[float]]:
    """TTFTs of all requests, of the systems' own hits and misses, of the groups' firsts."""
    return {"all": [r.ttft for r in requests],
            "hits": [r.ttft for r in requests if r.loaded],
            "misses": [r.ttft for r in requests if not r.loaded],
            "firsts": [r.ttft for r in requests if r.first_of_group]}


def ttft_table(title: str, results: dict[str, list[Request]]) -> dict[str, dict[str, float]]:
    """One row per system; returns the figures the summary takes its ratios from."""
    ideal, base = results["ideal"], results["no cache"]
    figures, rows = {}, []
    for name, requests in results.items():
        parts = split(requests)
        f = {"mean": _ms(parts["all"], _mean), "p50": _ms(parts["all"], _p50),
             "p99": _ms(parts["all"], lambda a: np.percentile(a, 99)),
             "hit_p50": _ms(parts["hits"], _p50), "hit_mean": _ms(parts["hits"], _mean),
             "miss_mean": _ms(parts["misses"], _mean), "first_mean": _ms(parts["firsts"], _mean)}
        figures[name] = f
        prompt = sum(r.prompt_tokens for r in requests)
        tiers: dict = {}
        for r in requests:
            for tier, nbytes in r.loaded_from.items():
                tiers[tier] = tiers.get(tier, 0) + nbytes
        loaded = sum(tiers.values())
        rows.append([name, len(requests), f["mean"], f["p50"], f["p99"],
                     f"{len(parts['hits'])}: {f['hit_mean']:.3g} / {f['hit_p50']:.3g}",
                     f"{len(parts['misses'])}: {f['miss_mean']:.3g}", f["first_mean"],
                     sum(r.loaded for r in requests) / prompt,
                     " ".join(f"{t.name.lower()} {n / loaded:.0%}" for t, n in sorted(tiers.items()))
                     or "-",
                     f"{sum(a.token == b.token for a, b in zip(requests, ideal))}/{len(requests)}",
                     f"{sum(a.token == b.token for a, b in zip(requests, base))}/{len(requests)}"])
    print_table(title, ["system", "requests", "TTFT mean ms", "p50 ms", "p99 ms",
                        "hits: mean / p50 ms", "misses: mean ms", "group firsts mean ms",
                        "token hit rate", "loaded from", "1st token = ideal",
                        "1st token = no cache"], rows)
    return figures


def targets(model: str, figures: dict[str, dict[str, float]], same_tokens: bool,
            reload_speedup: float) -> dict[str, float]:
    """Issue 13's targets as ratios of this run's figures (and whether each is met)."""
    ours, ideal, base = figures["tiercache"], figures["ideal"], figures["no cache"]
    checks = [
        ("hit p50 / ideal hit p50", ours["hit_p50"] / ideal["hit_p50"], "<=", 1.25),
        ("group firsts mean / no cache", ours["first_mean"] / base["first_mean"], "<=", 1.15),
        ("mean / ideal mean", ours["mean"] / ideal["mean"], "<=", 1.2),
        ("mean / no cache mean", ours["mean"] / base["mean"], "<=", 0.30),
        ("ideal mean / no cache mean", ideal["mean"] / base["mean"], "", float("nan")),
        ("reload 32k from host: speedup over a warmed recompute", reload_speedup, ">=", 20.0)]
    rows = [[what, value, f"{how} {goal:g}" if how else "(the best any cache does)",
             ("yes" if (value <= goal if how == "<=" else value >= goal) else "NO") if how else ""]
            for what, value, how, goal in checks]
    rows.append(["first tokens equal to the ideal's", "", "every request",
                 "yes" if same_tokens else "NO"])
    print_table(f"issue 13 targets, {model} (ratios of figures from this run; "
                "'mean / no cache <= 0.30' is set for the dense model)",
                ["target", "ratio", "goal", "met"], rows)
    return {what: value for what, value, _, _ in checks}


def profile_table(title: str, profiles: dict[str, list[tuple[str, float]]],
                  stores: dict[str, float]) -> None:
    """Per-step milliseconds of a hit and a miss (marks taken after a GPU synchronise)."""
    steps: list[str] = []
    for marks in profiles.values():
        for (step, _), in zip(marks[1:]):
            if step not in steps:
                steps.append(step)
    columns = list(profiles)
    rows = []
    for step in steps:
        row = [step]
        for name in columns:
            marks = profiles[name]
            times = [b - a for (_, a), (s, b) in zip(marks, marks[1:]) if s == step]
            row.append(1e3 * sum(times) if times else float("nan"))
        rows.append(row)
    rows.append(["total (TTFT but the first token's argmax)"] + [
        1e3 * (profiles[n][-1][1] - profiles[n][0][1]) for n in columns])
    rows.append(["the store, behind (not in TTFT)"] + [1e3 * stores.get(n, float("nan"))
                                                        for n in columns])
    print_table(title, ["step", *(f"{n} ms" for n in columns)], rows)


def summary(model: str, ratios: dict[str, float], figures: dict) -> None:
    print_summary(model=model.replace(" ", "_"),
                  hit_p50_over_ideal=ratios["hit p50 / ideal hit p50"],
                  firsts_over_no_cache=ratios["group firsts mean / no cache"],
                  mean_over_ideal=ratios["mean / ideal mean"],
                  mean_over_no_cache=ratios["mean / no cache mean"],
                  ideal_over_no_cache=ratios["ideal mean / no cache mean"],
                  reload_speedup_32k=ratios["reload 32k from host: speedup over a warmed recompute"],
                  ttft_mean_ms_tiercache=figures["tiercache"]["mean"],
                  ttft_mean_ms_no_cache=figures["no cache"]["mean"])


def progress(results: dict[str, list[Request]]) -> str:
    return ", ".join(f"{name} {1e3 * statistics.mean(r.ttft for r in rs):.1f} ms"
                     for name, rs in results.items() if rs)
