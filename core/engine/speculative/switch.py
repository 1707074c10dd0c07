"""Turning speculation off where it does not pay, measured rather than guessed.

Whether proposals pay depends on the batch (a batch-1 decode leaves the device idle enough to verify a few
rows for free; at batch 64 every extra row costs), on the platform, and on how often the proposals are
accepted, which changes with the workload. So the engine measures: for each batch-size class (powers of
two), the decoded tokens per second of pure-decode steps with proposals and without, as exponential moving
averages, and proposes only while the rate with proposals is the higher one. The losing mode is re-measured
for a few steps now and then, since the workload moves. Greedy outputs are the same either way; only the
speed changes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: steps with proposals measured in a class before the first measurement without
WARM_UP_STEPS = 8
#: consecutive steps a mode runs when it is (re-)measured
PROBE_STEPS = 4
#: steps between re-measurements of the losing mode (a probe of the slower mode costs 4 / 128 of the time)
PROBE_PERIOD = 128
#: weight of a new step in the moving averages
ALPHA = 0.25


@dataclass(slots=True)
class _ModeRate:
    """The moving average of one mode's decode rate in one batch class."""

    tokens_per_second: float = 0.0
    steps: int = 0

    def add(self, rate: float) -> None:
        self.tokens_per_second = rate if self.steps == 0 else (1 - ALPHA) * self.tokens_per_second + ALPHA * rate
        self.steps += 1


@dataclass(slots=True)
class _BatchClass:
    on: _ModeRate
    off: _ModeRate
    #: steps decided in this class since the losing mode was last measured
    since_probe: int = 0
    #: steps left of the running probe
    probing: int = 0
    #: the mode the running probe measures (True: with proposals)
    probe_mode: bool = False


class SpeculationSwitch:
    """Decides, step by step, whether to propose, from the measured decode rates of both modes."""

    def __init__(self) -> None:
        self.classes: dict[int, _BatchClass] = {}
        #: how many steps ran without proposals because the switch chose so (for the stats)
        self.steps_off = 0

    @staticmethod
    def batch_class(batch: int) -> int:
        """The power of two at or below ``batch`` (classes 1, 2, 4, 8, ...)."""
        return 1 << (max(batch, 1).bit_length() - 1)

    def _class(self, batch: int) -> _BatchClass:
        key = self.batch_class(batch)
        found = self.classes.get(key)
        if found is None:
            found = self.classes[key] = _BatchClass(_ModeRate(), _ModeRate())
        return found

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """Record a pure-decode step of ``batch`` sequences that emitted ``tokens`` in ``seconds`` (its
        proposing included)."""
        if seconds <= 0 or tokens <= 0:
            return
        cls = self._class(batch)
        (cls.on if speculated else cls.off).add(tokens / seconds)

    def allows(self, batch: int) -> bool:
        """Whether the next step of ``batch`` decoding sequences should carry proposals."""
        cls = self._class(batch)
        if cls.on.steps < WARM_UP_STEPS:
            return True
        winner = cls.on.tokens_per_second >= cls.off.tokens_per_second
        if cls.probing == 0 and (cls.off.steps == 0 or cls.since_probe >= PROBE_PERIOD):
            # the first measurement without proposals, or a re-measurement of the losing mode
            cls.probing, cls.probe_mode = PROBE_STEPS, False if cls.off.steps == 0 else not winner
        if cls.probing > 0:
            cls.probing -= 1
            cls.since_probe = 0
            allowed = cls.probe_mode
        else:
            cls.since_probe += 1
            allowed = winner
        if not allowed:
            self.steps_off += 1
        return allowed
