"""A rollout worker's end of the transport. Modules, from the bottom up: `outbox` (trajectories held until due,
sent in batches from reused buffers), `fetch` (one weights version pulled over one channel, rebuilt and
verified), `receiver` (the worker's weights channels, a sharded learner's slices assembled), `worker_client`
(`WorkerClient`: the control session, credit, admission, heartbeats and the I/O loop over all of them)."""

from heterorl.transport.client.fetch import AdapterWeights, ReceiveBuffers
from heterorl.transport.client.outbox import SendBuffers
from heterorl.transport.client.worker_client import WorkerClient

# the buffer pools under the names the transport tests import them by
_ReceiveBuffers, _SendBuffers = ReceiveBuffers, SendBuffers

__all__ = ["AdapterWeights", "ReceiveBuffers", "SendBuffers", "WorkerClient"]
