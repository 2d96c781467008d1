"""A worker process for transport tests: joins, reports weights it holds, streams trajectories until killed.

usage: transport_worker.py ADDRESS WORKER_ID
Prints "ready", then "weights VERSION" for each version received, on stdout.
"""

import sys
import time

import numpy as np

from heterorl.protocol import Trajectory
from heterorl.transport import TransportConfig, TransportTimeout, WorkerClient


def main() -> None:
    address, worker_id = sys.argv[1], sys.argv[2]
    config = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, credits_per_worker=8)
    client = WorkerClient(address, worker_id, config)
    client.wait_ready(20)
    print("ready", flush=True)
    version, i = -1, 0
    while True:
        got = client.latest_weights()
        if got is not None:
            version = got[0]
            client.set_version_held(version)
            print(f"weights {version}", flush=True)
        traj = Trajectory(f"{worker_id}-{time.time_ns()}-{i}", f"{worker_id}-g{i}", "p", worker_id, 1,
                          np.arange(4), np.arange(3), np.full(3, -0.5), np.full(3, max(version, 0)), 0.0,
                          time.time(), time.time())
        try:
            client.send(traj, timeout_s=0.5)
        except TransportTimeout:
            pass
        i += 1
        time.sleep(0.01)


if __name__ == "__main__":
    main()
