#!/usr/bin/env python3
"""Run a set of tests again and again on a busy machine, to find the ones that fail at random.

While pytest runs the given tests ``--repeats`` times, this script keeps the machine busy the way a shared CI host
is: ``--load`` processes spin on the cores, and a churner holds ``--hold-ports`` loopback ports at a time (bound on
port 0, so the kernel picks them from the same ephemeral range the tests' own ports come from), closing and
re-binding a share of them every few milliseconds and opening short TCP connections beside them. A test that
assumes a port is free without holding it (a port derived by arithmetic, a port found free and released before
use, a fixed number) fails here far more often than on a quiet machine.

    .venv/bin/python scripts/soak_tests.py --repeats 20 -- tests/transport tests/runtime/test_launch_ports.py

It prints one line per repetition and, at the end, the failures counted by test; it exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import re
import resource
import socket
import subprocess
import sys
import time
from collections import Counter


def _spin() -> None:
    while True:
        pass


def _churn(hold: int, seed: int) -> None:
    """Hold ``hold`` loopback ports (bound on port 0, not listening: enough to make another bind of them fail),
    replacing a random few every few milliseconds, and make short connections to a listener beside them."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (hold + 1024, hold + 1024))
    rng = random.Random(seed)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    held = []
    while True:
        while len(held) < hold:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", 0))
            except OSError:  # the range is exhausted for now: let some go
                s.close()
                break
            held.append(s)
        for _ in range(max(1, hold // 50)):
            if held:
                held.pop(rng.randrange(len(held))).close()
        with socket.create_connection(listener.getsockname()) as client:
            listener.accept()[0].close()
            client.close()
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="how many times to run the tests (default 20)")
    parser.add_argument("--load", type=int, default=2, help="processes spinning on the cores (default 2)")
    parser.add_argument("--hold-ports", type=int, default=8000,
                        help="loopback ports the churner holds at a time (default 8000, of ~28,000 ephemeral)")
    parser.add_argument("pytest_args", nargs="+", help="what pytest runs (after --)")
    args = parser.parse_args(argv)
    noise = [mp.Process(target=_spin, daemon=True) for _ in range(args.load)]
    noise.append(mp.Process(target=_churn, args=(args.hold_ports, 0), daemon=True))
    for process in noise:
        process.start()
    failures: Counter = Counter()
    failed_runs = 0
    try:
        for run in range(1, args.repeats + 1):
            start = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                                     *args.pytest_args], capture_output=True, text=True)
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)(.*)$", result.stdout, re.M)
            failures.update(name for name, _ in failed)
            failed_runs += result.returncode != 0
            closing = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"run {run}/{args.repeats}: {closing} ({time.monotonic() - start:.0f} s)"
                  + "".join(f"\n    {name}{why[:200]}" for name, why in failed), flush=True)
            if result.returncode not in (0, 1):
                print(result.stdout[-3000:], result.stderr[-3000:], sep="\n", flush=True)
    finally:
        for process in noise:
            process.kill()
    print(f"{failed_runs} of {args.repeats} runs failed; failures by test:")
    for name, count in failures.most_common():
        print(f"  {count:3d}  {name}")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
