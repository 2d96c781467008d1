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

# Exported lazily (PEP 562): `heterorl keys` and the other commands that only need keys or addresses do not pay for
# torch, which the worker's end (weights unpacking) imports.
_EXPORTS = {
    "WorkerClient": "heterorl.transport.client", "WorkerInfo": "heterorl.transport.registry",
    "LearnerServer": "heterorl.transport.server", "CurveConfig": "heterorl.transport.sockets",
    "DelaySchedule": "heterorl.transport.sockets", "TransportError": "heterorl.transport.sockets",
    "TransportTimeout": "heterorl.transport.sockets", "is_loopback": "heterorl.transport.sockets",
    "make_keypair": "heterorl.transport.sockets", "revoke_key": "heterorl.transport.sockets",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'heterorl.transport' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
