"""A synthetic Mooncake-schema trace of a chosen shape and seed, to check that what holds on the two real
traces holds on a trace the autoscaler was not tuned on.

`python -m pdcluster.bench.sim.synth --out FILE [--seed N] [--minutes M] [--rate R] [--shape S]` writes
JSON lines (`timestamp` ms, `input_length`, `output_length`, `hash_ids`). Shape `conversation` (default): a mean rate `R` req/s that
swings ±60 % over half an hour, a level shift to 1.6× for the last third, and short bursts (15-40 s at
3-5×) at random times; heavy-tailed prompts (log-normal, median ~5.4k tokens, ~4 % over 50k, capped at
128k) of which half continue an earlier conversation (its blocks are the prefix of the new prompt, as
Mooncake's `hash_ids` record); log-normal outputs (median ~200 tokens). Shape `shift`: a steady `R`
req/s whose mix turns at half time from prompt-heavy (4-8k prompt, 5-40 output tokens) to output-heavy
(200-600 prompt, 600-1200 output tokens): the load moves from prefill to decode at the same rate. Shape
`bursty`: the Azure 2023 code trace's shape, fitted to its 10 s counts and lengths: bursts of 10-80 s
(10 s steps whose rates are log-normal, median ~1.7× `R`, at most 8× that median) between silences of
10-200 s (exponential, mean 60 s), nothing in between; prompts gamma-distributed with its mean (2,048
tokens) and SCV (0.93), capped at its largest (7,437); log-normal outputs of its median (13) and mean (28).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

BLOCK = 512
MAX_PROMPT = 128_000


def rate_at(t: float, base: float, duration: float, bursts: list[tuple[float, float, float]]) -> float:
    r = base * (1.0 + 0.6 * math.sin(2 * math.pi * t / 1800.0))
    if t > 2 * duration / 3:
        r *= 1.6
    for start, length, factor in bursts:
        if start <= t < start + length:
            r *= factor
    return r


def generate(seed: int = 7, minutes: float = 60.0, base_rate: float = 0.8) -> list[dict]:
    rng = random.Random(seed)
    duration = minutes * 60.0
    bursts = [(rng.uniform(60, duration - 60), rng.uniform(15, 40), rng.uniform(3, 5))
              for _ in range(max(1, int(minutes / 10)))]
    peak = base_rate * 1.6 * 1.6 * 5
    sessions: list[tuple[int, list[int]]] = []  # (input tokens, hash ids) of recent conversations
    next_block, t, out = 0, 0.0, []
    while True:
        t += rng.expovariate(peak)  # thinning: a Poisson process of the time-varying rate
        if t >= duration:
            break
        if rng.random() > rate_at(t, base_rate, duration, bursts) / peak:
            continue
        if sessions and rng.random() < 0.5:
            prev_len, prev_ids = sessions.pop(rng.randrange(len(sessions)))
            length = min(MAX_PROMPT, prev_len + int(rng.lognormvariate(6.5, 1.0)))
            ids = list(prev_ids)
        else:
            length, ids = min(MAX_PROMPT, max(64, int(rng.lognormvariate(8.6, 1.3)))), []
        while len(ids) < math.ceil(length / BLOCK):
            ids.append(next_block)
            next_block += 1
        sessions.append((length, ids))
        del sessions[:-200]
        out.append({"timestamp": int(t * 1000), "input_length": length,
                    "output_length": max(1, min(2000, int(rng.lognormvariate(5.3, 0.8)))), "hash_ids": ids})
    return out


def generate_shift(seed: int = 2, minutes: float = 40.0, rate: float = 4.0) -> list[dict]:
    rng = random.Random(seed)
    duration, t, out = minutes * 60.0, 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        if t < duration / 2:
            i, o = rng.randint(4000, 8000), rng.randint(5, 40)
        else:
            i, o = rng.randint(200, 600), rng.randint(600, 1200)
        out.append({"timestamp": int(t * 1000), "input_length": i, "output_length": o})
    return out


AZURE_PROMPT_MEAN, AZURE_PROMPT_SCV, AZURE_PROMPT_MAX = 2048.0, 0.93, 7437
AZURE_OUTPUT_MEDIAN, AZURE_OUTPUT_SIGMA = 13.0, 1.24  # log-normal: mean 13·exp(σ²/2) = 28
BURST_STEP_S, BURST_SIGMA = 10.0, 0.9  # the burst's rate is redrawn every step; its spread between steps
BURST_CAP = 8.0  # a step's rate at most this multiple of the median (Azure: its busiest 10 s at ~7× the median)
SILENCE_MEAN_S, SILENCE_MIN_S = 60.0, 10.0
BURST_STEPS = (1, 8)  # a burst lasts 10-80 s


def generate_bursty(seed: int = 1, minutes: float = 60.0, rate: float = 2.5) -> list[dict]:
    """Azure-code-shaped traffic (module docstring) at a mean of about `rate` req/s."""
    rng = random.Random(seed)
    duration, t, out = minutes * 60.0, 0.0, []
    mean_steps = sum(range(BURST_STEPS[0], BURST_STEPS[1] + 1)) / (BURST_STEPS[1] - BURST_STEPS[0] + 1)
    on = mean_steps * BURST_STEP_S
    # the median step rate that gives `rate` over bursts and silences
    median = rate * (on + SILENCE_MEAN_S + SILENCE_MIN_S) / on / math.exp(BURST_SIGMA ** 2 / 2)
    shape = 1.0 / AZURE_PROMPT_SCV
    while t < duration:
        t += SILENCE_MIN_S + rng.expovariate(1.0 / SILENCE_MEAN_S)
        for _ in range(rng.randint(*BURST_STEPS)):
            end, step_rate = t + BURST_STEP_S, median * min(BURST_CAP, rng.lognormvariate(0.0, BURST_SIGMA))
            while t < duration:
                t += rng.expovariate(step_rate)
                if t >= end or t >= duration:
                    break
                i = min(AZURE_PROMPT_MAX, max(1, int(rng.gammavariate(shape, AZURE_PROMPT_MEAN / shape))))
                o = max(1, min(2000, int(AZURE_OUTPUT_MEDIAN * rng.lognormvariate(0.0, AZURE_OUTPUT_SIGMA))))
                out.append({"timestamp": int(t * 1000), "input_length": i, "output_length": o})
            t = end
    return out


_GENERATORS = {"conversation": generate, "shift": generate_shift, "bursty": generate_bursty}
SHAPES = tuple(_GENERATORS)
DEFAULT_RATE = {"conversation": 0.8, "shift": 4.0, "bursty": 2.5}


def shaped(shape: str, seed: int, minutes: float, rate: float) -> list[dict]:
    """The rows of a trace of `shape` (SHAPES)."""
    return _GENERATORS[shape](seed, minutes, rate)


def write(rows: list[dict], path: Path) -> None:
    """The rows as a Mooncake-schema JSONL trace (`bench/trace.py` reads it)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.sim.synth", description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=None,
                   help="mean requests/s (default 0.8 for conversation, 4 for shift, 2.5 for bursty)")
    p.add_argument("--shape", choices=SHAPES, default="conversation")
    a = p.parse_args(argv)
    rate = a.rate if a.rate is not None else DEFAULT_RATE[a.shape]
    if not (a.minutes > 0 and rate > 0):
        p.error("--minutes and --rate must be > 0")
    rows = shaped(a.shape, a.seed, a.minutes, rate)
    write(rows, a.out)
    print(f"wrote {len(rows)} requests to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
