"""Rank and classify the tests of a timed suite run: which are slow, and whether they compute or wait.

    HETERORL_TEST_TIMES=times.jsonl make test        # each test's wall and CPU seconds, one JSON line each
    python scripts/test_times.py times.jsonl [--top 25] [--before old.jsonl]

A test is CPU-bound when the CPU it spent (its own process's and that of the children it waited for) is at least
half its wall time on one core, else it mostly waits (on sockets, sleeps, subprocesses it does not wait for, or
other processes' CPU: live fleets). With ``--before``, each row gives the same test's wall time in the earlier run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CPU_BOUND = 0.5  # CPU seconds per wall second at or above which a test counts as computing, not waiting


def read_times(path: Path) -> dict[str, dict]:
    """The lines of a ``HETERORL_TEST_TIMES`` file by test id (a test run twice: its last line)."""
    times = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            times[row["test"]] = row
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{number}: not a line of HETERORL_TEST_TIMES ({exc}); "
                             "rerun the suite with it") from None
    return times


def kind(row: dict) -> str:
    cpu = row["cpu_s"] + row["children_cpu_s"]
    return "cpu" if row["wall_s"] > 0 and cpu / row["wall_s"] >= CPU_BOUND else "waits"


def report(times: dict[str, dict], top: int, before: dict[str, dict] | None = None) -> str:
    rows = sorted(times.values(), key=lambda r: r["wall_s"], reverse=True)
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r["cpu_s"] + r["children_cpu_s"] for r in rows)
    waiting = sum(r["wall_s"] for r in rows if kind(r) == "waits")
    lines = [f"{len(rows)} tests: {wall:.0f} s of test wall time (summed over workers), {cpu:.0f} CPU s; "
             f"{waiting:.0f} s in tests that mostly wait ({waiting / max(wall, 1e-9):.0%})",
             f"{'wall s':>8} {'cpu s':>7} {'kind':>5}" + (f" {'before':>7}" if before else "") + "  test"]
    for r in rows[:top]:
        was = before.get(r["test"], {}).get("wall_s") if before else None
        lines.append(f"{r['wall_s']:8.1f} {r['cpu_s'] + r['children_cpu_s']:7.1f} {kind(r):>5}"
                     + (f" {was:7.1f}" if was is not None else ("       -" if before else "")) + f"  {r['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times", type=Path, help="a HETERORL_TEST_TIMES file")
    parser.add_argument("--top", type=int, default=25, help="rows to print (default: 25)")
    parser.add_argument("--before", type=Path, help="an earlier run's file, to compare wall times with")
    args = parser.parse_args(argv)
    for path in (args.times, args.before):
        if path is not None and not path.is_file():
            parser.error(f"{path} does not exist: run the suite with HETERORL_TEST_TIMES={path} first")
    print(report(read_times(args.times), args.top, read_times(args.before) if args.before else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
