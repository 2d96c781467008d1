"""What a sandboxed program scored: its answers (from the harness's results pipe) compared with the hidden tests'
expected ones, by value and by type, and the reason it scored what it did. Any bytes at all give an `Outcome`:
nothing a program sends can raise here."""

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
    """The results pipe, read: the answers by test index (the first for each), the first status line and its
    detail, how the program ended (``exit:N``/``signal:N``), and lines that were not results."""

    answers: dict = field(default_factory=dict)
    status: str | None = None
    detail: str = ""
    end: str | None = None
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
            if got.status is None or (record["status"].startswith(FORBIDDEN) and not got.status.startswith(FORBIDDEN)):
                got.status, got.detail = record["status"], str(record.get("detail", ""))[:500]
        elif type(record.get("i")) is int and 0 <= record["i"] < total and "out" in record:
            got.answers.setdefault(record["i"], record["out"])
        elif isinstance(record.get("end"), str):
            got.end = record["end"]
        elif "started" not in record:
            got.garbled += 1
    return got


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


def judge(results: bytes, output: bytes, killed: str, returncode: int | None, tests: list[TestCase],
          seconds: float) -> Outcome:
    """The outcome of one program from what came back: a refusal names it first, then a kill by the parent, then
    a signal that ended the program, then the harness's status; else each answer is compared here."""
    total = len(tests)
    got = read_results(results, total)
    printed = output[:OUTPUT_KEPT].decode("utf-8", "replace")

    def outcome(reason: str, detail: str = "", passed: int = 0) -> Outcome:
        return Outcome(passed, total, reason, seconds, detail, got.answers, printed)

    status = got.status
    if status is not None and status.startswith(FORBIDDEN):
        # (only the known kinds are counted: the reasons stay a short, known list whatever a program reports)
        what = status[len(FORBIDDEN) + 1:]
        return outcome(f"{FORBIDDEN}:{what if what in FORBIDDEN_KINDS else 'other'}", got.detail)
    if killed:
        why = {CRASHED: ": its results passed their limit",
               NOT_STARTED: ": its process did not start within the start-up deadline (SandboxLimits.start_s)"}
        return outcome(killed, "killed by the parent" + why.get(killed, ""))
    if got.end is not None and got.end.startswith("signal:"):
        number = got.end[len("signal:"):]
        if number == str(int(signal.SIGXCPU)):
            return outcome(TIMEOUT, "its CPU time ran out")
        if number == str(int(signal.SIGKILL)):
            return outcome(MEMORY, "killed: the program's memory limit (its cgroup's), most likely")
        return outcome(CRASHED, f"ended by signal {number}")
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return outcome(TIMEOUT)
    if status is None:
        return outcome(CRASHED, f"no status (exit code {returncode}, {got.garbled} lines that are not results)")
    if status in (MEMORY, SYNTAX, OUTPUT, CRASHED):
        return outcome(status, got.detail)
    if status not in (OK, WRONG):  # what the harness says once the tests ran; anything else the program forged
        return outcome(CRASHED, f"unknown status {status[:60]!r}")
    passed = sum(1 for i, test in enumerate(tests)
                 if i in got.answers and same(got.answers[i], canonical(test.expected)))
    return outcome(OK if passed == total else WRONG, got.detail, passed)


__all__ = ["CRASHED", "FORBIDDEN", "FORBIDDEN_KINDS", "MEMORY", "NOT_STARTED", "OK", "OUTPUT", "Outcome", "Results",
           "SYNTAX", "TIMEOUT", "TestCase", "WRONG", "canonical", "judge", "read_results", "same"]
