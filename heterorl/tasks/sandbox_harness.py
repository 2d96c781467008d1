"""The sandbox's first code (heterorl.tasks.sandbox runs this file's source with ``python -I -S -c``), in two
processes:

- **the supervisor** (trusted): reads the job from stdin, says it started on the results pipe (the fd number
  ``results_fd`` the parent passed; the parent's wall clock for the program runs from this line, its start-up
  deadline until it), forks the program, reads the program's reports from a pipe of their own,
  checks each one and forwards it, and says last how the program ended (``{"end", "cpu_s", "cpu_limit_s"}``:
  its wait status and the CPU time the kernel accounted to it). It makes itself undumpable, so a program of the
  same user can neither trace it nor reach its fds through /proc. It keeps no signal handler (Python's SIGINT
  one is reset): in a jail it is the PID namespace's init, and the kernel delivers to an init, from inside its
  namespace, only the signals it has a handler for (SIGKILL and SIGSTOP never), so no signal of the program
  reaches it. In a jail it waits, once it said how the program ended, for the parent to read the cgroup's
  memory counters and kill the jail.
- **the program** (untrusted, a forked child): closes the results pipe first, sets its limits, (weak sandbox
  only) drops privileges, compiles the candidate and says whether it compiled (its first report, written before
  any of the candidate's code runs: the one the supervisor takes as the verdict), installs the tripwire hook,
  then runs the candidate on each test input and reports what it returned or printed. What it prints itself
  goes to stdout/stderr, which the parent captures apart and never parses.

Outcome labels come from the supervisor's and the parent's measurements, never from the program's reports: the
supervisor forwards only answers and the tripwire's first refusal (the program's own report, by nature: it names
what the program tried, and a program that forges one only names itself ``forbidden``).

Standard library only; it never sees expected answers."""

import io
import json
import os
import resource
import select
import signal
import sys

# imported once by the supervisor, before forking (a weak sandbox's program, as nobody, may not read Python's
# own folder under /root): what a generated program may import; socket and subprocess too, so that using them
# is refused by name, not missing
PRELOADED = ("math", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "fractions",
             "decimal", "statistics", "random", "operator", "typing", "dataclasses", "copy", "time", "socket",
             "subprocess", "encodings.idna")
REPORT_LINE_BYTES = 1 << 20  # one report line's most (an answer the size of a big list)


class Reporter:
    """The program's side of its report pipe: one JSON line per record, written with os.write (a program that
    replaces sys.stdout cannot stop it)."""

    def __init__(self, fd):
        self.fd = fd

    def __call__(self, record):
        data = (json.dumps(record, default=repr) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]


def cpu_limit_s(job):
    """The program's CPU seconds per process (RLIMIT_CPU's soft limit: SIGXCPU; SIGKILL a second later)."""
    return max(1, int(job["limits"]["cpu_s"] + 0.999))


def limit(job):
    """The program's own limits: CPU per process, file size, no core files; address space per process only in
    the weak sandbox (in a jail, memory is its cgroup's, whose counters say when the limit was hit: a MemoryError
    raised in the program's process cannot be told from ``raise MemoryError``)."""
    limits = job["limits"]
    cpu = cpu_limit_s(job)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if not job["jailed"]:
        memory = int(limits["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_bytes"]), int(limits["file_bytes"])))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def confine_weakly(job):
    """The weak sandbox only (no jail around it): as root, a network namespace and the nobody user;
    unprivileged, a user + network namespace where the kernel allows it; a per-user process limit."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        newnet, newuser = 0x40000000, 0x10000000
        if libc.unshare(newnet) != 0:
            libc.unshare(newuser | newnet)
    except Exception:  # no namespaces here: the network stays the host's (Sandbox.isolation says so)
        pass
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (int(job["limits"]["processes"]),) * 2)
    os.umask(0o077)


def install_tripwire(home, report):
    """Refuse sockets, new processes, native libraries and files outside ``home`` and Python's own, and report
    the first refusal (``{"forbidden": what, "detail"}``: it names the outcome). A tripwire that names what a
    program tried, not a boundary: the jail is."""
    allowed = tuple(os.path.realpath(p) + os.sep for p in {home, sys.base_prefix, sys.prefix, sys.exec_prefix})
    devices = ("/dev/null", "/dev/urandom", "/dev/zero")
    kinds = {"socket.": "socket", "os.fork": "process", "os.forkpty": "process", "os.exec": "process",
             "os.posix_spawn": "process", "os.spawn": "process", "os.system": "process",
             "subprocess.Popen": "process", "os.kill": "process", "os.killpg": "process",
             "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.cdata": "ctypes",
             "os.chdir": "open", "os.chroot": "process", "os.setuid": "process"}
    seen = []

    class Forbidden(PermissionError):
        pass

    def refuse(what, detail):
        if not seen:
            report({"forbidden": what, "detail": detail[:300]})
        seen.append(what)
        raise Forbidden(f"the sandbox refuses {what}: {detail[:200]}")

    def hook(event, args):
        if event == "open":
            path = args[0]
            if isinstance(path, int) or path is None:
                return
            path = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
            real = os.path.realpath(os.path.join(home, path))
            if not (real + os.sep).startswith(allowed) and not real.startswith(allowed) and real not in devices:
                refuse("open", real)
            return
        for prefix, what in kinds.items():
            if event.startswith(prefix):
                refuse(what, f"{event} {str(args)[:200]}")

    sys.addaudithook(hook)


class Bounded(io.StringIO):
    """A program's stdout in stdio mode, which may not grow past ``limit`` characters: past it, what it holds
    and the rest go to the process's real stdout, where the parent counts them against ``output_bytes``."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def write(self, text):
        if self.tell() + len(text) > self.limit:
            spill(self.getvalue() + text)
            raise OverflowError("output limit")
        return super().write(text)


def spill(text):
    """``text`` on fd 1, whatever the program made of sys.stdout (or nowhere, if it closed fd 1)."""
    view = memoryview(text.encode("utf-8", "replace"))
    try:
        while view:
            view = view[os.write(1, view):]
    except OSError:
        pass


def say(text):
    """A line on fd 2 for whoever reads the program's output (never parsed)."""
    try:
        os.write(2, (text[:500] + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def run_tests(job, code, report):
    """The candidate on each test input: one ``{"i", "out"}`` report per answer; an exception fails its test.
    The exit code: 0, or 1 when the program's top level raised (call mode) or a MemoryError ended the tests
    (``crashed``, said on fd 2: an exception of the program's process names no outcome)."""
    entry, inputs = job["entry"], job["inputs"]
    namespace = {"__name__": "__program__", "__builtins__": __builtins__}
    if entry is not None:
        try:
            exec(code, namespace)
        except BaseException as exc:  # the program's own top-level error: every test fails
            say(f"the program's top level raised {type(exc).__name__}: {exc}")
            return 1
        function = namespace.get(entry)
        if not callable(function):
            say(f"the program defines no function {entry}")
            return 0
    limit_chars = int(job.get("output_bytes", 65536))
    for i, (args, stdin) in enumerate(inputs):
        try:
            if entry is not None:
                out = function(*args)
            else:
                sys.stdin, sys.stdout = io.StringIO(stdin), Bounded(limit_chars)
                try:
                    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
                except SystemExit:  # a program may end with exit(): what it printed counts
                    pass
                finally:
                    out, sys.stdout, sys.stdin = sys.stdout.getvalue().strip(), sys.__stdout__, sys.__stdin__
        except MemoryError:
            say(f"test {i} raised MemoryError")
            return 1
        except BaseException:  # this test fails; the others still run
            continue
        try:
            report({"i": i, "out": json.loads(json.dumps(out, default=repr))})
        except (TypeError, ValueError, RecursionError):
            continue
    return 0


def program(job, report_fd):
    """The forked child: nothing of the supervisor's reachable, then limits, the verdict on compiling (the
    first report, before any of the candidate's code runs), the tripwire and the tests."""
    os.close(job["results_fd"])
    os.close(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (Python's own, which the supervisor dropped)
    if not job["jailed"]:
        confine_weakly(job)
    limit(job)
    report = Reporter(report_fd)
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        report({"compiled": False, "detail": str(exc)})
        os._exit(0)
    report({"compiled": True})
    install_tripwire(job["home"], report)
    status = run_tests(job, code, report)
    sys.stdout.flush()
    os._exit(status)  # (no atexit or finalizer the program registered runs)


def checked(line, total):
    """A report line from the program, if it is one the parent can use: an answer ``{"i": index, "out": ...}``
    for a test of this job, or the tripwire's ``{"forbidden": what, "detail"}``; None for anything else."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("forbidden"), str):
        detail = record.get("detail", "")
        return {"forbidden": record["forbidden"][:80], "detail": detail[:500] if isinstance(detail, str) else ""}
    index = record.get("i")
    if type(index) is int and 0 <= index < total and "out" in record:
        return {"i": index, "out": record["out"]}
    return None


def verdict(line):
    """The program's first report, written before any of its code ran: None when it compiled, else the
    ``syntax_error`` status to forward."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        record = None
    if isinstance(record, dict) and record.get("compiled") is False:
        return {"status": "syntax_error", "detail": str(record.get("detail", ""))[:500]}
    return None


def supervise(job, child, report_fd, results):
    """Forward the verdict on compiling (the program's first line) and then its checked reports (each test's
    first answer, the first refusal; at most ``report_bytes`` in all), then say how it ended: its wait status
    and the CPU time the kernel accounted to it (wait4), with its CPU limit."""
    total, budget, pending, kept = len(job["inputs"]), int(job["report_bytes"]), b"", set()
    ended, heard_verdict = None, False
    while ended is None:
        ready, _, _ = select.select([report_fd], [], [], 0.05)
        chunk = os.read(report_fd, 65536) if ready else b""
        if ready and not chunk:  # every writer closed: the program is ending
            ended = os.wait4(child, 0)
            break
        budget -= len(chunk)
        if budget < 0:
            results({"status": "output_limit", "detail": "the program's reports passed their limit"})
            os.kill(child, signal.SIGKILL)
            ended = os.wait4(child, 0)
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > REPORT_LINE_BYTES:
            pending = b""
        for line in lines:
            if not heard_verdict:  # (the only line written before any of the program's code ran)
                heard_verdict, status = True, verdict(line)
                if status is not None:
                    results(status)
                continue
            record = checked(line, total)
            key = None if record is None else record.get("i", "forbidden")
            if key is not None and key not in kept:
                kept.add(key)
                results(record)
        if not ready:
            done, status, usage = os.wait4(child, os.WNOHANG)
            if done:
                ended = done, status, usage  # (a descendant may still hold the pipe: what it sends is not read)
    _, status, usage = ended
    how = f"signal:{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit:{os.waitstatus_to_exitcode(status)}"
    results({"end": how, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "cpu_limit_s": cpu_limit_s(job)})


def main():
    _no_signal_handlers()
    job = json.loads(sys.stdin.read())
    results = Reporter(job["results_fd"])
    results({"started": True})
    _undumpable()
    for name in PRELOADED:
        __import__(name)
    report_read, report_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(report_read)
        program(job, report_write)
    os.close(report_write)
    supervise(job, child, report_read, results)
    while job["jailed"]:  # the parent reads the cgroup's memory counters, then kills the jail (Sandbox._collect)
        signal.pause()
    os._exit(0)


def _no_signal_handlers():
    """Every signal with a Python handler (SIGINT's) back to its default action: a PID namespace's init gets,
    from inside its namespace, only the signals it has a handler for (the kernel's rule), so then none."""
    for number in signal.valid_signals():
        if callable(signal.getsignal(number)):
            signal.signal(number, signal.SIG_DFL)


def _undumpable():
    """prctl(PR_SET_DUMPABLE, 0): no process of the same user may ptrace this one or open its /proc files."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


if __name__ == "__main__":
    main()
