"""A worker process for transport tests: joins, reports weights it holds, streams trajectories until killed.

usage: worker_process.py ADDRESS WORKER_ID
Prints "ready", then "weights VERSION" for each version received, on stdout.
"""

import sys
import time

from heterorl.config import TransportConfig
from heterorl.transport import TransportTimeout, WorkerClient
from tests.conftest import trajectory


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
        traj = trajectory(trajectory_id=f"{worker_id}-{time.time_ns()}-{i}", group_id=f"{worker_id}-g{i}",
                          sampler_id=worker_id, group_size=1, version=max(version, 0), reward=0.0,
                          generation_start=time.time(), generation_end=time.time(), sent_at=0.0)
        try:
            client.send(traj, timeout_s=0.5)
        except TransportTimeout:
            pass
        i += 1
        time.sleep(0.01)

if __name__ == "__main__":
    main()
