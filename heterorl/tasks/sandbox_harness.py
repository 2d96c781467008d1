"""The sandbox's first code (heterorl.tasks.sandbox runs this file's source with ``python -I -S -c``): read the
job from stdin, drop privileges and set the limits, install the audit hook, then run the candidate program on
each test input and print what it returned or printed. Standard library only; it never sees expected answers."""

import io
import json
import os
import resource
import sys

RESULT = "\x00heterorl-result "
# imported before the program runs as nobody, who may not read Python's own folder (under /root here): what a
# generated program may import; socket and subprocess too, so that using them is refused by name, not missing
PRELOADED = ("math", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "fractions",
             "decimal", "statistics", "random", "operator", "typing", "dataclasses", "copy", "time", "socket",
             "subprocess", "encodings.idna")


def emit(record):
    """One result line, written to fd 1 directly: a program that replaces sys.stdout cannot stop it."""
    os.write(1, (RESULT + json.dumps(record, default=repr) + "\n").encode())


def confine(job):
    """Limits, then (as root) a network namespace and the nobody user; unprivileged, a user + network
    namespace where the kernel allows it."""
    limits = job["limits"]
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(limits["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_bytes"]), int(limits["file_bytes"])))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
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
    resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["processes"]),) * 2)
    os.umask(0o077)


def install_hook(home):
    """Refuse sockets, new processes, native libraries and files outside ``home`` and Python's own; each
    refusal is reported at once (the first one names the outcome)."""
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
            emit({"status": "forbidden:" + what, "detail": detail[:300]})
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


def run(job):
    program, entry, inputs = job["program"], job["entry"], job["inputs"]
    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        emit({"status": "syntax_error", "detail": str(exc)})
        return
    namespace = {"__name__": "__program__", "__builtins__": __builtins__}
    if entry is not None:
        try:
            exec(code, namespace)
        except MemoryError:
            emit({"status": "memory"})
            return
        except BaseException as exc:  # the program's own top-level error: every test fails
            emit({"status": "crashed", "detail": f"{type(exc).__name__}: {exc}"})
            return
        function = namespace.get(entry)
        if not callable(function):
            emit({"status": "wrong_answer", "detail": f"the program defines no function {entry}"})
            return
    limit = int(job.get("output_bytes", 65536))
    for i, (args, stdin) in enumerate(inputs):
        try:
            if entry is not None:
                out = function(*args)
            else:
                sys.stdin, sys.stdout = io.StringIO(stdin), Bounded(limit)
                try:
                    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
                except SystemExit:  # a program may end with exit(): what it printed counts
                    pass
                finally:
                    out, sys.stdout, sys.stdin = sys.stdout.getvalue().strip(), sys.__stdout__, sys.__stdin__
        except MemoryError:
            emit({"status": "memory"})
            return
        except OverflowError as exc:
            if "output limit" in str(exc):
                emit({"status": "output_limit"})
                return
            continue
        except SystemExit:
            continue
        except BaseException:  # this test fails; the others still run
            continue
        try:
            emit({"i": i, "out": json.loads(json.dumps(out, default=repr))})
        except (TypeError, ValueError, RecursionError):
            continue
    emit({"status": "ok"})


def main():
    job = json.loads(sys.stdin.read())
    for name in PRELOADED:
        __import__(name)
    confine(job)
    install_hook(job["home"])
    run(job)
    sys.stdout.flush()
    os._exit(0)  # (no atexit or finalizer the program registered runs)


if __name__ == "__main__":
    main()
