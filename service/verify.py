"""`onceflow verify`: check an app's output for exactly-once, the way a data engineer would.

Reads the input and output topics with read_committed and reports:
- duplicates: the same (key, window_start) twice in window results (append mode), or the same
  source position (`onceflow.source` header) twice in pass-through output;
- missing: input positions found in no output (pass-through), or expected windows absent;
- accounting: results + late records + dead letters = input records.
It exits 0 only when there are no duplicates and every input record is accounted for.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from onceflow.connectors.topics import read_committed
from onceflow.routing import HEADER_SOURCE


@dataclass
class Report:
    input_records: int = 0
    output_records: int = 0
    counted: int = 0  # input records the results account for
    late: int = 0
    dead_letters: int = 0
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def unaccounted(self) -> int:
        return self.input_records - self.counted - self.late - self.dead_letters

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.missing and self.unaccounted == 0

    def summary(self) -> str:
        lines = [
            f"input records:   {self.input_records}",
            f"output records:  {self.output_records} (accounting for {self.counted} inputs)",
            f"late records:    {self.late}",
            f"dead letters:    {self.dead_letters}",
            f"unaccounted:     {self.unaccounted}",
            f"duplicates:      {len(self.duplicates)} {self.duplicates[:5]}",
            f"missing:         {len(self.missing)} {self.missing[:5]}",
            "OK: exactly once" if self.ok else "FAILED: not exactly once",
        ]
        return "\n".join(lines)


def verify(
    bootstrap: str,
    inputs: list[str],
    output: str,
    dead_letters: str | None = None,
    late: str | None = None,
    count_field: str | None = None,
) -> Report:
    """Check `output` against `inputs`. With `count_field`, output holds window results and
    the sum of that field over them is the number of input records they account for."""
    report = Report()
    input_positions = [
        f"{m.topic()}/{m.partition()}/{m.offset()}"
        for t in inputs
        for m in read_committed(bootstrap, t)
    ]
    report.input_records = len(input_positions)
    out = read_committed(bootstrap, output)
    report.output_records = len(out)
    side = Counter()
    for topic, attribute in ((dead_letters, "dead_letters"), (late, "late")):
        if topic:
            records = read_committed(bootstrap, topic)
            setattr(report, attribute, len(records))
            side.update(_source(m) for m in records)
    if count_field:
        windows = Counter()
        for m in out:
            value = json.loads(m.value())
            windows[(json.dumps(value.get("key")), value.get("window_start"))] += 1
            report.counted += int(value.get(count_field) or 0)
        report.duplicates = [
            f"key={k} window_start={w} x{n}" for (k, w), n in windows.items() if n > 1
        ]
    else:
        positions = Counter(_source(m) for m in out)
        report.counted = sum(1 for p in positions if p is not None)
        report.duplicates = [f"{p} x{n}" for p, n in (positions + side).items() if n > 1 and p]
        seen = set(positions) | set(side)
        report.missing = [p for p in input_positions if p not in seen]
    return report


def _source(message) -> str | None:
    for key, value in message.headers() or []:
        if key == HEADER_SOURCE:
            return value.decode()
    return None
