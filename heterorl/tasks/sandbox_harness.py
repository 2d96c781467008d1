"""The sandbox's first code (heterorl.tasks.sandbox runs this file's source with ``python -I -S -c``), in two
processes:

- **the supervisor** (trusted): reads the job from stdin, says it started on the results pipe (the fd number
  ``results_fd`` the parent passed; the parent's wall clock for the program runs from this line, its start-up
  deadline until it), forks the program, reads the program's reports from a pipe of their own,
  checks each one and forwards it, and says last how the program ended. It makes itself undumpable, so a
  program of the same user can neither trace it nor reach its fds through /proc. In a jail it is the PID
  namespace's init, which no process inside may signal.
- **the program** (untrusted, a forked child): closes the results pipe first, sets its limits, (weak sandbox
  only) drops privileges, installs the tripwire hook, then runs the candidate on each test input and reports
  what it returned or printed. What it prints itself goes to stdout/stderr, which the parent captures apart and
  never parses.

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


def limit(job):
    """The program's own limits: CPU and address space per process, file size, no core files."""
    limits = job["limits"]
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
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
    the first refusal (it names the outcome). A tripwire that names what a program tried, not a boundary: the
    jail is."""
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
            report({"status": "forbidden:" + what, "detail": detail[:300]})
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
    """A program's stdout in stdio mode, which may not grow past ``limit`` characters."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def write(self, text):
        if self.tell() + len(text) > self.limit:
            raise OverflowError("output limit")
        return super().write(text)


def run_tests(job, report):
    """The candidate on each test input: one ``{"i", "out"}`` report per answer, then ``{"status": "ok"}``
    (or the status that ended it early)."""
    program, entry, inputs = job["program"], job["entry"], job["inputs"]
    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        report({"status": "syntax_error", "detail": str(exc)})
        return
    namespace = {"__name__": "__program__", "__builtins__": __builtins__}
    if entry is not None:
        try:
            exec(code, namespace)
        except MemoryError:
            report({"status": "memory"})
            return
        except BaseException as exc:  # the program's own top-level error: every test fails
            report({"status": "crashed", "detail": f"{type(exc).__name__}: {exc}"})
            return
        function = namespace.get(entry)
        if not callable(function):
            report({"status": "wrong_answer", "detail": f"the program defines no function {entry}"})
            return
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
            report({"status": "memory"})
            return
        except OverflowError as exc:
            if "output limit" in str(exc):
                report({"status": "output_limit"})
                return
            continue
        except BaseException:  # this test fails; the others still run
            continue
        try:
            report({"i": i, "out": json.loads(json.dumps(out, default=repr))})
        except (TypeError, ValueError, RecursionError):
            continue
    report({"status": "ok"})


def program(job, report_fd):
    """The forked child: nothing of the supervisor's reachable, then limits, the tripwire and the tests."""
    os.close(job["results_fd"])
    os.close(0)
    if not job["jailed"]:
        confine_weakly(job)
    limit(job)
    report = Reporter(report_fd)
    install_tripwire(job["home"], report)
    run_tests(job, report)
    sys.stdout.flush()
    os._exit(0)  # (no atexit or finalizer the program registered runs)


def checked(line, total):
    """A report line from the program, if it is one the parent can use: an answer ``{"i": index, "out": ...}``
    for a test of this job, or a ``{"status", "detail"}``; None for anything else."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("status"), str):
        detail = record.get("detail", "")
        return {"status": record["status"][:80], "detail": detail[:500] if isinstance(detail, str) else ""}
    index = record.get("i")
    if type(index) is int and 0 <= index < total and "out" in record:
        return {"i": index, "out": record["out"]}
    return None


def supervise(job, child, report_fd, results):
    """Forward the program's checked reports (at most ``report_bytes`` in all), then say how it ended."""
    total, budget, pending, answered = len(job["inputs"]), int(job["report_bytes"]), b"", set()
    ended = None
    while ended is None:
        ready, _, _ = select.select([report_fd], [], [], 0.05)
        chunk = os.read(report_fd, 65536) if ready else b""
        if ready and not chunk:  # every writer closed: the program is ending
            ended = os.waitpid(child, 0)[1]
            break
        budget -= len(chunk)
        if budget < 0:
            results({"status": "output_limit", "detail": "the program's reports passed their limit"})
            os.kill(child, signal.SIGKILL)
            ended = os.waitpid(child, 0)[1]
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > REPORT_LINE_BYTES:
            pending = b""
        for line in lines:
            record = checked(line, total)
            if record is not None and not ("i" in record and record["i"] in answered):
                answered.add(record.get("i"))
                results(record)
        if not ready:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                ended = status  # (a descendant may still hold the pipe open: what it sends now is not read)
    how = f"signal:{os.WTERMSIG(ended)}" if os.WIFSIGNALED(ended) else f"exit:{os.waitstatus_to_exitcode(ended)}"
    results({"end": how})


def main():
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
    os._exit(0)


def _undumpable():
    """prctl(PR_SET_DUMPABLE, 0): no process of the same user may ptrace this one or open its /proc files."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


if __name__ == "__main__":
    main()
