"""What a sandboxed program scored: its answers (from the harness's results pipe) compared with the hidden tests'
expected ones, by value and by type, and the reason it scored what it did. Any bytes at all give an `Outcome`:
nothing a program sends can raise here.

A reason comes from a measurement of the parent's or the supervisor's, never from what the program says: the
results pipe holds only the supervisor's lines (its statuses, how the program ended) and, forwarded by it, the
program's answers and its tripwire's first refusal. The refusal is the one reason that comes from inside the
program's process (the audit hook lives there): a program can forge it only to name itself ``forbidden``, and it
ranks below every measured reason."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from typing import Any

# why a program scored what it did (counted per reason by `Sandbox.stats`)
OK, WRONG, TIMEOUT, MEMORY, OUTPUT, CRASHED, SYNTAX = "ok", "wrong_answer", "timeout", "memory", "output_limit", \
    "crashed", "syntax_error"
NOT_STARTED = "not_started"  # its process did not start within the start-up deadline (a busy machine, not the program)
FORBIDDEN = "forbidden"  # + ":" what it tried: socket, open, process, ctypes
FORBIDDEN_KINDS = ("socket", "open", "process", "ctypes")
OUTPUT_KEPT = 2000  # characters of a program's own output kept in its Outcome (for reading, never scored)


@dataclass(frozen=True)
class TestCase:
    """One hidden test: call the program's function with ``args`` (``call`` mode), or feed ``stdin`` and read
    what it prints (``stdio`` mode); ``expected``: the reference solution's answer, never shown to the program."""

    __test__ = False  # not a pytest class, despite its name

    args: list = field(default_factory=list)
    stdin: str = ""
    expected: Any = None


@dataclass
class Outcome:
    """What one program scored: tests ``passed`` of ``total``, and why (``reason``: one of the constants above,
    ``forbidden:WHAT`` for a refused action)."""

    passed: int
    total: int
    reason: str
    seconds: float = 0.0
    detail: str = ""
    answers: dict = field(default_factory=dict, repr=False)  # test index -> what the program gave
    output: str = field(default="", repr=False)  # the start of what it printed itself (never parsed)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class Results:
    """The results pipe, read: the answers by test index (the first for each), the supervisor's first status
    and its detail, the tripwire's first refusal and its detail, how the program ended (``exit:N``/``signal:N``,
    the CPU seconds the kernel accounted to it and its limit), and lines that were not results."""

    answers: dict = field(default_factory=dict)
    status: str | None = None
    detail: str = ""
    forbidden: str | None = None
    forbidden_detail: str = ""
    end: str | None = None
    cpu_s: float = 0.0
    cpu_limit_s: float = float("inf")
    garbled: int = 0


def read_results(data: bytes, total: int) -> Results:
    """Parse the results pipe's lines; a line that is not a result is counted in ``garbled``, never raised."""
    got = Results()
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            got.garbled += 1
            continue
        if not isinstance(record, dict):
            got.garbled += 1
        elif isinstance(record.get("status"), str):
            if got.status is None:
                got.status, got.detail = record["status"], str(record.get("detail", ""))[:500]
        elif isinstance(record.get("forbidden"), str):
            if got.forbidden is None:
                got.forbidden, got.forbidden_detail = record["forbidden"], str(record.get("detail", ""))[:500]
        elif type(record.get("i")) is int and 0 <= record["i"] < total and "out" in record:
            got.answers.setdefault(record["i"], record["out"])
        elif isinstance(record.get("end"), str):
            got.end = record["end"]
            cpu_s, cpu_limit_s = record.get("cpu_s"), record.get("cpu_limit_s")
            if _number(cpu_s) and _number(cpu_limit_s):
                got.cpu_s, got.cpu_limit_s = float(cpu_s), float(cpu_limit_s)
        elif "started" not in record:
            got.garbled += 1
    return got


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def same(answer: Any, expected: Any) -> bool:
    """``answer`` equals ``expected`` in value and in type, all the way down: 1.0 is not 1, True is not 1."""
    if type(answer) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(answer) == len(expected) and all(same(a, e) for a, e in zip(answer, expected))
    if isinstance(expected, dict):
        return answer.keys() == expected.keys() and all(same(answer[k], expected[k]) for k in expected)
    return answer == expected


def canonical(value: Any) -> Any:
    """A value as it comes back through JSON (tuples become lists), for comparing answers."""
    return json.loads(json.dumps(value, default=repr))


# RLIMIT_CPU is checked against the kernel's own CPU time, wait4 reports a tick-sampled split of it: apart by a few
# ticks on a quiet machine (0.997 s at a 1 s limit), by up to 60 ms on a loaded one (3.94 s at 4 s, in `make test`)
CPU_SLACK_S = 0.25  # at least; 5 % of the limit when that is more


def judge(results: bytes, output: bytes, killed: str, returncode: int | None, tests: list[TestCase],
          seconds: float, *, memory_limit_hit: bool = False) -> Outcome:
    """The outcome of one program from what came back, each reason from a measurement, first found first:
    the parent's kill (`TIMEOUT` at the wall clock, `NOT_STARTED`, `OUTPUT` past ``output_bytes`` of its own
    output, `CRASHED` past the results' limit); the supervisor's own status (`OUTPUT` when the program's reports
    passed their limit and it killed it, `SYNTAX` when the program's first report, written before any of its
    code ran, said it did not compile); how the program ended, as the supervisor saw it: a SIGKILL is `MEMORY`
    only when its cgroup's counters say it hit its memory limit (``memory_limit_hit``, read by the parent), a
    SIGXCPU or SIGKILL is `TIMEOUT` only when the kernel accounted at least its CPU limit to it; then the
    tripwire's refusal (``forbidden:WHAT``); then any other signal, an exit code other than 0, or no end at all
    (`CRASHED`); else its answers, compared here (`OK`, `WRONG`)."""
    total = len(tests)
    got = read_results(results, total)
    printed = output[:OUTPUT_KEPT].decode("utf-8", "replace")

    def outcome(reason: str, detail: str = "", passed: int = 0) -> Outcome:
        return Outcome(passed, total, reason, seconds, detail, got.answers, printed)

    if killed:
        why = {CRASHED: ": its results passed their limit",
               NOT_STARTED: ": its process did not start within the start-up deadline (SandboxLimits.start_s)"}
        return outcome(killed, "killed by the parent" + why.get(killed, ""))
    if got.status in (OUTPUT, SYNTAX):
        return outcome(got.status, got.detail)
    signalled = got.end[len("signal:"):] if got.end is not None and got.end.startswith("signal:") else None
    if signalled == str(int(signal.SIGKILL)) and memory_limit_hit:
        return outcome(MEMORY, "killed, and its cgroup's counters say it hit its memory limit")
    out_of_cpu = got.cpu_s >= got.cpu_limit_s - max(CPU_SLACK_S, 0.05 * got.cpu_limit_s)
    if signalled in (str(int(signal.SIGXCPU)), str(int(signal.SIGKILL))) and out_of_cpu:
        return outcome(TIMEOUT, f"its CPU time ran out ({got.cpu_s:.2f} s of {got.cpu_limit_s:g})")
    if got.forbidden is not None:
        # (only the known kinds are counted: the reasons stay a short, known list whatever a program reports)
        what = got.forbidden if got.forbidden in FORBIDDEN_KINDS else "other"
        return outcome(f"{FORBIDDEN}:{what}", got.forbidden_detail)
    if got.status is not None:  # (none the supervisor sends: bytes that are not its results)
        return outcome(CRASHED, f"unknown status {got.status[:60]!r}")
    if got.end is None:
        return outcome(CRASHED, f"no end (exit code {returncode}, {got.garbled} lines that are not results)")
    if signalled is not None:
        return outcome(CRASHED, f"ended by signal {signalled} after {got.cpu_s:.2f} s of CPU")
    if got.end != "exit:0":
        return outcome(CRASHED, f"ended with {got.end}")
    passed = sum(1 for i, test in enumerate(tests)
                 if i in got.answers and same(got.answers[i], canonical(test.expected)))
    return outcome(OK if passed == total else WRONG, "", passed)


__all__ = ["CRASHED", "FORBIDDEN", "FORBIDDEN_KINDS", "MEMORY", "NOT_STARTED", "OK", "OUTPUT", "Outcome", "Results",
           "SYNTAX", "TIMEOUT", "TestCase", "WRONG", "canonical", "judge", "read_results", "same"]
