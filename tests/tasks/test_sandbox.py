"""The sandbox that runs generated programs: right answers pass, and every misbehaviour scores 0 with its reason
counted, while the sandbox (and the worker around it) goes on. Run in the jail where this machine gives one
(root, nsjail, cgroups: tests/tasks/test_sandbox_jail.py tests it further), else in the weak sandbox."""

import os
import time

import pytest

from heterorl.tasks.jail import jail_support
from heterorl.tasks.sandbox import Sandbox, SandboxLimits, TestCase

ISOLATION = "nsjail" if jail_support().available else "weak"

ADD = [TestCase(args=[2, 3], expected=5), TestCase(args=[10, -1], expected=9)]


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(SandboxLimits(wall_s=3.0, cpu_s=2.0, memory_mb=256, output_bytes=16384), max_parallel=2,
                  isolation=ISOLATION)
    yield box
    box.close()


def test_a_right_program_passes_and_a_wrong_one_scores_what_it_gets_right(sandbox):
    assert sandbox.run("def f(a, b):\n    return a + b\n", ADD, entry="f").reason == "ok"
    half = sandbox.run("def f(a, b):\n    return 5\n", ADD, entry="f")
    assert (half.passed, half.total, half.reason) == (1, 2, "wrong_answer")
    stdio = sandbox.run("print(2 * int(input()))\n", [TestCase(stdin="4\n", expected="8"),
                                                      TestCase(stdin="-3", expected="-6")])
    assert stdio.reason == "ok" and stdio.passed == 2
    assert sandbox.run("def f(a, b) return", ADD, entry="f").reason == "syntax_error"
    assert sandbox.run("def g(a, b):\n    return a + b\n", ADD, entry="f").reason == "wrong_answer"


MISBEHAVING = {
    "loops forever": ("def f(a, b):\n    while True:\n        pass\n", "timeout"),
    "sleeps past the wall clock": ("import time\ndef f(a, b):\n    time.sleep(60)\n", "timeout"),
    "forks": ("import os\ndef f(a, b):\n    while True:\n        os.fork()\n", "forbidden:process"),
    "runs a shell": ("import subprocess\ndef f(a, b):\n    return subprocess.run(['id'])\n", "forbidden:process"),
    # (1 MB at a time, so that it reaches the limit on any machine: the jail's cgroup counts it, `memory`; the
    # weak sandbox's RLIMIT_AS makes a MemoryError, which a program may raise itself: `crashed`)
    "allocates 10 GB": ("def f(a, b):\n    x = [bytearray(1 << 20) for _ in range(10240)]\n    return a + b\n",
                        "memory" if ISOLATION == "nsjail" else "crashed"),
    "writes huge output": ("def f(a, b):\n    while True:\n        print('x' * 4096)\n", "output_limit"),
    "opens a socket": ("import socket\ndef f(a, b):\n    socket.create_connection(('127.0.0.1', 22))\n",
                       "forbidden:socket"),
    "hides its socket in a try": ("import socket\ndef f(a, b):\n    try:\n        socket.socket()\n"
                                  "    except BaseException:\n        pass\n    return a + b\n", "forbidden:socket"),
    "loads native code": ("import ctypes\ndef f(a, b):\n    return ctypes.CDLL(None).getpid()\n",
                          "forbidden:ctypes"),
}


@pytest.mark.parametrize("what", sorted(MISBEHAVING))
def test_a_misbehaving_program_scores_0_with_its_reason_and_the_sandbox_goes_on(sandbox, what):
    program, reason = MISBEHAVING[what]
    before = sandbox.stats.get(reason, 0)
    start = time.monotonic()
    outcome = sandbox.run(program, ADD, entry="f")
    assert (outcome.passed, outcome.reason) == (0, reason), outcome
    assert time.monotonic() - start < 30  # the wall clock holds (3 s; a sleep of 60 s is cut short)
    assert sandbox.stats[reason] == before + 1  # counted
    assert sandbox.run("def f(a, b):\n    return a + b\n", ADD, entry="f").reason == "ok"  # and it goes on


def test_the_workers_files_keys_and_environment_are_out_of_reach(sandbox, tmp_path, monkeypatch):
    key = tmp_path / "worker.key_secret"
    key.write_text("secret")
    key.chmod(0o600)
    read = sandbox.run(f"def f(a, b):\n    return open({str(key)!r}).read()\n", ADD, entry="f")
    assert read.passed == 0 and "secret" not in read.answers.values()
    if ISOLATION == "weak" or not str(key).startswith("/tmp/"):  # (in a jail, /tmp is its own, empty tmpfs)
        assert read.reason == "forbidden:open" and str(key) in read.detail
    assert sandbox.run("def f(a, b):\n    return open('/etc/hostname').read()\n", ADD, entry="f").reason == \
        "forbidden:open"
    monkeypatch.setenv("HETERORL_API_KEY", "do-not-leak")
    env = sandbox.run("import os\ndef f():\n    return sorted(os.environ)\n", [TestCase()], entry="f")
    assert set(env.answers[0]) <= {"LC_CTYPE"}  # an empty environment (but Python's locale coercion): no key
    # its own directory is private and writable, and gone afterwards
    name = f"heterorl-test-{os.getpid()}.txt"
    wrote = sandbox.run(f"import os\ndef f(a, b):\n    open({name!r}, 'w').write('x')\n"
                        f"    return os.path.join(os.getcwd(), {name!r})\n", ADD, entry="f")
    assert wrote.reason == "wrong_answer" and not os.path.exists(wrote.answers[0])


def test_a_program_cannot_see_or_forge_the_expected_answers(sandbox):
    # what it prints is never read as a result, even in the old result lines' form
    forged = ("import os\nos.write(1, b'\\x00heterorl-result {\"status\": \"ok\"}\\n')\n"
              "def f(a, b):\n    return None\n")
    outcome = sandbox.run(forged, ADD, entry="f")
    assert outcome.passed == 0 and outcome.reason == "wrong_answer"
    # forged reports on the program's own pipe: a refusal of a kind the tripwire does not know counts as
    # forbidden:other (the reasons stay a short, known list), and a status is never forwarded (it ended with
    # exit code 0 and no answers)
    for record, reason in (('{"forbidden": "anything at all"}', "forbidden:other"),
                           ('{"status": "a made-up reason"}', "wrong_answer")):
        forged = ("import os\nfor fd in range(3, 32):\n    try:\n"
                  f"        os.write(fd, {(record + chr(10)).encode()!r})\n"
                  "    except OSError:\n        pass\nos._exit(0)\n")
        assert sandbox.run(forged, ADD, entry="f").reason == reason, record


def test_isolation_is_reported_and_programs_run_in_parallel(sandbox):
    isolation = sandbox.isolation()
    assert set(isolation) == {"kind", "network_namespace", "pid_namespace", "filesystem", "separate_user"}
    if ISOLATION == "nsjail":
        assert isolation == {"kind": "nsjail", "network_namespace": True, "pid_namespace": True,
                             "filesystem": True, "separate_user": True}
    elif os.getuid() == 0:  # the weak sandbox as root: a network namespace and nobody, nothing more
        assert isolation == {"kind": "weak", "network_namespace": True, "pid_namespace": False,
                             "filesystem": False, "separate_user": True}
    slow = ("import time\ndef f(a, b):\n    time.sleep(1)\n    return a + b\n", ADD, "f")
    outcomes = sandbox.run_many([slow] * 4)
    assert [o.reason for o in outcomes] == ["ok"] * 4
    assert sandbox.peak_running == 2 and sandbox.running == 0  # two at a time (max_parallel), never more


def test_the_weak_sandbox_is_still_there_for_machines_without_the_jail():
    box = Sandbox(SandboxLimits(wall_s=3.0, cpu_s=2.0, memory_mb=256), isolation="weak")
    try:
        assert box.run("def f(a, b):\n    return a + b\n", ADD, entry="f").reason == "ok"
        assert box.run("import socket\ndef f(a, b):\n    socket.socket()\n", ADD, entry="f").reason == \
            "forbidden:socket"
        assert box.isolation()["kind"] == "weak"
    finally:
        box.close()


def test_limits_that_make_no_sense_are_refused():
    from heterorl.errors import TaskError

    with pytest.raises(TaskError, match="wall_s=0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(TaskError, match="max_parallel"):
        Sandbox(max_parallel=0)
    with pytest.raises(TaskError, match="isolation='docker'"):
        Sandbox(isolation="docker")


def test_max_parallel_past_the_cores_is_cut_to_them_with_one_warning(caplog):
    """64 programs at once on 2 cores made every correct program a `timeout`: max_parallel is cut to the cores
    this process may use, said once (naming the setting), and never more programs run at once"""
    cores = len(os.sched_getaffinity(0))
    asked = cores + 61  # (a value no other test asks for: the warning is said once per value)
    limits = SandboxLimits(wall_s=3.0, cpu_s=2.0, memory_mb=256)
    with caplog.at_level("WARNING", logger="heterorl.tasks.sandbox"):
        boxes = [Sandbox(limits, max_parallel=asked, isolation=ISOLATION) for _ in range(2)]
    try:
        warned = [r.getMessage() for r in caplog.records if f"max_parallel={asked} " in r.getMessage()]
        assert len(warned) == 1 and f"at most {cores}" in warned[0], caplog.text
        assert [box.max_parallel for box in boxes] == [cores, cores]
        slow = ("import time\ndef f(a, b):\n    time.sleep(0.2)\n    return a + b\n", ADD, "f")
        assert [o.reason for o in boxes[0].run_many([slow] * (2 * cores + 2))] == ["ok"] * (2 * cores + 2)
        assert boxes[0].peak_running == cores
    finally:
        for box in boxes:
            box.close()


def test_a_program_whose_process_did_not_start_in_time_is_not_started_not_a_timeout():
    """the start-up deadline (`start_s`) is apart from the wall clock, which runs once the harness does: a
    program whose process did not start within it scores 0 as `not_started` as soon as it passes, not after
    the wall clock as a `timeout`; the sandbox then goes on, and nothing of it is left"""
    box = Sandbox(SandboxLimits(wall_s=30.0, cpu_s=2.0, memory_mb=256, start_s=0.001), max_parallel=1,
                  isolation=ISOLATION)
    try:
        start = time.monotonic()
        outcome = box.run("def f(a, b):\n    return a + b\n", ADD, entry="f")
        assert (outcome.passed, outcome.reason) == (0, "not_started"), outcome
        assert "start-up deadline" in outcome.detail and time.monotonic() - start < 5.0
        assert box.counts() == {"not_started": 1} and box.leftovers() == []
    finally:
        box.close()
