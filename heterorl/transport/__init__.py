"""ZeroMQ transport between rollout workers and the learner.

Modules: `protocol` (versioned messages, the strict codec), `weights` (state-dict packing into chunks), `sockets`
(addresses, CurveZMQ keys, socket setup and the helpers both ends share), `server` (`LearnerServer`, the learner's
end: an I/O loop over `registry`, `intake` with `groups`, `admission`, `release` and `membership`) and `client`
(`WorkerClient`, a worker's end). Each end runs one I/O thread that owns its sockets; callers
talk to it through locked state.

Channels (patterns, HWMs and timeouts are stated where the sockets are made):

- control + trajectories: learner ROUTER (bind ``tcp://HOST:PORT``) ↔ a DEALER per worker. Hello/ready,
  heartbeats both ways, trajectories up, acks with cumulative credit down.
- weights: learner ROUTER (bind PORT+1 unless given) ↔ a DEALER per worker. Pull-based chunked transfer: a
  ``weights_notice`` on the control channel, then header and chunk requests, each chunk checksummed.

Security: CurveZMQ whenever a `CurveConfig` is given; plaintext only on loopback unless ``allow_plaintext``.
Delays (``heterorl.delay``) hold trajectories on the worker and weights notices on the learner.
"""

from heterorl.transport.client import WorkerClient
from heterorl.transport.registry import WorkerInfo
from heterorl.transport.server import LearnerServer
from heterorl.transport.sockets import (
    CurveConfig,
    DelaySchedule,
    TransportError,
    TransportTimeout,
    is_loopback,
    make_keypair,
    revoke_key,
)

__all__ = ["CurveConfig", "DelaySchedule", "LearnerServer", "TransportError", "TransportTimeout", "WorkerClient",
           "WorkerInfo", "is_loopback", "make_keypair", "revoke_key"]
