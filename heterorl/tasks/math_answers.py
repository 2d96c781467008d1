"""Answers checked by Hugging Face's math-verify (``pip install math-verify``): ``\\frac{1}{2}`` is ``0.5``,
``1,000`` is ``1000``, ``50\\%`` is ``0.5``, ``\\{2,1\\}`` is ``\\{1,2\\}``, ``x=3`` is ``3``.

The reference, a bare answer as a dataset gives it (``0.5``, ``\\frac{1}{2}``), is parsed as ``\\boxed{<it>}``;
the completion as the content of its last ``\\boxed{}`` when it has one (an earlier box is a draft), else whole,
with the library's default extraction (LaTeX, then plain expressions such as ``#### 42``'s ``42``). A completion
scores 1.0 when ``math_verify.verify(reference, completion)`` holds, else 0.0 (`math_verify_score`).

Limits. Text longer than `MAX_VERIFY_CHARS` (the reference, or what would be parsed of the completion: its last
box's content or, without one, all of it) scores 0 unparsed, counted ``too_long``: parsing grows with length
(a typical 4,096-character completion ~5 ms, crafted ones up to ~1.5 s). The library's own timeouts are off
(``None``): they use ``signal.alarm``, which works in the main thread only, and no timeout in the process can
stop what it cannot interrupt: ``\\boxed{9^{9^{9^{9}}}}`` makes sympy compute a 370-million-digit power inside
one C call that holds the GIL, freezing every thread. So `MathVerifyScorer` runs the library in a child
interpreter (``python -I``, math-verify only, `MAX_CHILD_MEMORY_BYTES` of address space), killed and restarted
when a call has not returned within its ``timeout_s`` (``task.reward_timeout_s``): that call scores 0, counted
``timeout``. Library errors score 0, counted ``error:<type>`` (`GuardedScore`).
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import inspect
import json
import logging
import select
import subprocess
import sys
import threading
import weakref
from collections import Counter

from heterorl.errors import TaskError
from heterorl.tasks.answers import extract_boxed_answer
from heterorl.tasks.guarded import GuardedScore

log = logging.getLogger("heterorl.tasks.math_answers")
MAX_VERIFY_CHARS = 4096  # characters of a reference or of a completion's parsed text; longer ones score 0
MAX_CHILD_MEMORY_BYTES = 1 << 30  # the child's address space (it needs ~65 MB); more is a MemoryError there
STARTUP_TIMEOUT_S = 60.0  # for the child to import math-verify and sympy (~0.6 s)
REWARD_TIMEOUT_S = 30.0  # `math_verify_reward`'s limit per call, under task.reward_timeout_s's default 60 s


def require_math_verify() -> None:
    """TaskError naming the fix when the math-verify package is not installed."""
    if importlib.util.find_spec("math_verify") is None:
        raise TaskError("answers checked by math-verify need the math-verify package: pip install math-verify")


def verify_texts(reference_text: str, completion_text: str | None) -> bool:
    """math-verify's verdict on two texts, its signal-based timeouts off (the child process runs this source).
    ``completion_text`` None: whether the reference parses to a value at all (a text it cannot read, such as
    ``\\frac{1}{``, parses to itself only, as a string, and would match itself)."""
    import math_verify

    gold = math_verify.parse(reference_text, parsing_timeout=None, raise_on_error=True)
    if completion_text is None:
        return any(not isinstance(value, str) for value in gold)
    answer = math_verify.parse(completion_text, parsing_timeout=None, raise_on_error=True)
    return bool(math_verify.verify(gold, answer, timeout_seconds=None))


def _texts(completion: str, reference: str) -> tuple[str, str] | None:
    """(reference, completion) as the library parses them, or None when one is over `MAX_VERIFY_CHARS`."""
    boxed = extract_boxed_answer(completion)
    answer = completion if boxed is None else boxed
    if len(answer) > MAX_VERIFY_CHARS or len(reference) > MAX_VERIFY_CHARS:
        return None
    return f"\\boxed{{{reference}}}", answer if boxed is None else f"\\boxed{{{boxed}}}"


def math_verify_score(completion: str, reference: str) -> float:
    """1.0 when math-verify finds ``completion``'s answer equal to ``reference``, else 0.0 (see the module's
    docstring); in this thread, with no time limit (`MathVerifyScorer` adds one)."""
    texts = _texts(completion, reference)
    return 0.0 if texts is None else float(verify_texts(*texts))


class MathVerifyError(Exception):
    """An exception the child raised whose type is not a builtin one (its name leads the message)."""


class _Overran(BaseException):
    """A call the child did not answer in time. A BaseException so that it passes `GuardedScore` (whose
    ``timeout`` outcome is for an abandoned thread, which this is not: the child is killed)."""


_CHILD = """
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
try:  # Linux: die with the parent; a child busy in one long C call never reads the end of its input
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
logging.getLogger("math_verify").setLevel(logging.ERROR)  # the warning that its own timeouts are off
{source}
verify_texts("\\boxed{{1}}", "1")  # imports math-verify and sympy before the clock of a first call starts
print("ready", flush=True)
for line in sys.stdin:
    try:
        reply = {{"match": verify_texts(*json.loads(line))}}
    except Exception as err:
        reply = {{"error": type(err).__name__, "message": str(err)[:200]}}
    print(json.dumps(reply), flush=True)
"""


def _line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The child's next line ("" when it has exited), or None when none came within ``timeout_s``."""
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        return None
    return proc.stdout.readline()


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


class _VerifierProcess:
    """`verify_texts` in a child interpreter, one call at a time, each limited to ``timeout_s`` seconds: a call
    over it kills the child (the next starts another) and raises `_Overran`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        code = _CHILD.format(memory=MAX_CHILD_MEMORY_BYTES, source=inspect.getsource(verify_texts))
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, encoding="utf-8")
        if _line(proc, STARTUP_TIMEOUT_S) != "ready\n":
            _kill(proc)
            raise TaskError(f"the math-verify process did not start (exit code {proc.returncode}; it has "
                            f"{STARTUP_TIMEOUT_S:g} s, and its error, if any, is in the log above); check that "
                            f"`{sys.executable} -c 'import math_verify'` works")
        self._proc, self._stop = proc, weakref.finalize(self, _kill, proc)  # the child ends with this object

    def __call__(self, reference_text: str, completion_text: str) -> float:
        with self._lock:
            if self._proc.poll() is not None:  # killed after a call that overran, or with the thread that made it
                self._stop()
                self._start()
            try:
                self._proc.stdin.write(json.dumps([reference_text, completion_text]) + "\n")
                self._proc.stdin.flush()
                line = _line(self._proc, self.timeout_s)
            except BrokenPipeError:
                line = ""
            if not line:
                self._stop()
                if line is None:
                    raise _Overran()
                raise MathVerifyError(f"the math-verify process exited (code {self._proc.returncode})")
        reply = json.loads(line)
        if "error" in reply:
            kind = getattr(builtins, reply["error"], None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                raise kind(reply["message"])
            raise MathVerifyError(f"{reply['error']}: {reply['message']}")
        return float(reply["match"])


class MathVerifyScorer:
    """``scorer(completion, reference)``: `math_verify_score`, bounded and counted. With ``timeout_s`` the
    library runs in a child process limited to that many seconds a call; None runs it in the caller's thread,
    with no limit. ``stats`` counts every call by outcome: ``ok`` (scored), ``too_long``, ``timeout`` and
    ``error:<type>``, each but ``ok`` scoring 0; the first of each kind is logged with ``where``."""

    def __init__(self, timeout_s: float | None) -> None:
        require_math_verify()
        self.timeout_s = timeout_s
        verify = verify_texts if timeout_s is None else _VerifierProcess(timeout_s)
        self._guard = GuardedScore(lambda *texts: float(verify(*texts)), None, "math-verify")
        self._skipped: Counter = Counter()
        self._lock = threading.Lock()

    @property
    def stats(self) -> Counter:
        with self._lock:
            return self._guard.stats + self._skipped

    def __call__(self, completion: str, reference: str, where: str = "") -> float:
        texts = _texts(completion, reference)
        if texts is None:
            return self._skip("too_long", f"was not given text over {MAX_VERIFY_CHARS} characters", where)
        try:
            return self._guard(*texts, where=where)
        except _Overran:
            return self._skip("timeout", f"did not return within {self.timeout_s:g} s (task.reward_timeout_s); "
                                         "its process was killed", where)

    def reference_parses(self, reference: str, where: str = "") -> bool:
        """Whether math-verify reads a value from ``reference`` (as ``\\boxed{reference}``), bounded as a
        scoring call is; False for one over `MAX_VERIFY_CHARS`, or whose parse overran or failed."""
        if len(reference) > MAX_VERIFY_CHARS:
            return False
        try:
            return bool(self._guard(f"\\boxed{{{reference}}}", None, where=where))
        except _Overran:
            return False

    def _skip(self, outcome: str, what_happened: str, where: str) -> float:
        with self._lock:
            self._skipped[outcome] += 1
            first = self._skipped[outcome] == 1
        if first:
            log.warning("math-verify %s (%s); scored 0, and counted as %r in the run's reward_outcomes",
                        what_happened, where or "no details", outcome)
        return 0.0


@functools.cache
def _reward_scorer() -> MathVerifyScorer:
    return MathVerifyScorer(REWARD_TIMEOUT_S)


def math_verify_reward(prompt: str, completion: str, answer: str) -> float:
    """A reward function (``task.reward_fn=heterorl.tasks.math_answers:math_verify_reward``): `math_verify_score`
    of ``completion`` against ``answer``, the library in a child process limited to `REWARD_TIMEOUT_S` a call
    (started on the first call; a hang or an error scores 0 and is logged once)."""
    return _reward_scorer()(completion, answer, where=f"prompt {prompt[:60]!r}, completion {completion[:60]!r}")


def _reward_outcomes() -> Counter:
    """`math_verify_reward`'s calls in this process so far, by outcome (empty before its first)."""
    return _reward_scorer().stats if _reward_scorer.cache_info().currsize else Counter()


math_verify_reward.outcomes = _reward_outcomes  # what a run reports as reward_outcomes (`CustomRewardTask.stats`)
