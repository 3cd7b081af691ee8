"""Answer lengths for a simulation: a distribution by name, or the lengths a finished run generated.

    LengthDistribution.parse("lognormal:1500,0.9,64,16384")   # median, sigma, shortest, longest
    LengthDistribution.parse("fixed:1024")
    LengthDistribution.parse("metrics:outputs/default/metrics.jsonl")   # each step's response lengths, replayed
    draw = dist.sampler(seed=0); draw(8)                               # 8 lengths

A spec that does not parse is a ConfigError naming --lengths and the forms that are valid.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from colocate.errors import ConfigError

FORMS = "lognormal:MEDIAN,SIGMA[,MIN,MAX], fixed:N, or metrics:PATH (a run's metrics.jsonl)"


@dataclass(frozen=True)
class LengthDistribution:
    kind: str
    median: float = 0.0
    sigma: float = 0.0
    low: int = 1
    high: int = 1 << 30
    observed: tuple[int, ...] = ()
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        kind, _, rest = spec.partition(":")
        try:
            if kind == "lognormal":
                values = [float(v) for v in rest.split(",")]
                if len(values) not in (2, 4):
                    raise ValueError("two or four numbers")
                median, sigma, *bounds = values
                low, high = (int(bounds[0]), int(bounds[1])) if bounds else (1, 1 << 30)
                if median <= 0 or sigma < 0 or not 1 <= low <= high:
                    raise ValueError("median > 0, sigma >= 0, 1 <= MIN <= MAX")
                return cls("lognormal", median, sigma, low, high, spec=spec)
            if kind == "fixed":
                n = int(rest)
                if n < 1:
                    raise ValueError("N >= 1")
                return cls("fixed", low=n, high=n, spec=spec)
            if kind == "metrics":
                return cls("metrics", observed=_observed(Path(rest)), spec=spec)
        except ValueError as e:
            raise ConfigError(f"--lengths {spec!r} does not parse ({e}); valid: {FORMS}") from None
        raise ConfigError(f"--lengths {spec!r} does not parse; valid: {FORMS}")

    def sampler(self, seed: int = 0):
        rng = random.Random(seed)
        if self.kind == "fixed":
            return lambda n: [self.low] * n
        if self.kind == "metrics":
            return lambda n: [rng.choice(self.observed) for _ in range(n)]
        mu = math.log(self.median)
        return lambda n: [min(self.high, max(self.low, int(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]

    @property
    def longest(self) -> int:
        """The longest answer it draws (an unbounded log-normal's: 4 sigma above its median)."""
        if self.observed:
            return max(self.observed)
        if self.kind == "lognormal" and self.high == 1 << 30:
            return int(self.median * math.exp(4 * self.sigma))
        return self.high


def _observed(path: Path) -> tuple[int, ...]:
    """Every step's response lengths in a run's metrics.jsonl (the step records' `response_lengths`)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    lengths = [n for line in lines if line.strip() for n in json.loads(line).get("response_lengths", [])]
    if not lengths:
        raise ValueError(f"{path} has no step record with response_lengths")
    return tuple(int(n) for n in lengths)
