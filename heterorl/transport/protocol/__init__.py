"""Wire protocol between rollout workers and the learner: versioned messages, msgpack frames, strict decoding.

A message travels as ZeroMQ frames: a msgpack map (the header, with ``"v"`` = schema version and ``"kind"``),
then at most one raw little-endian data frame — a weight chunk's bytes, or the four arrays of all trajectories of
a batch back to back — which the receiver views without a copy (``numpy.frombuffer``). A single ``trajectory``
message keeps its arrays as msgpack ``bin`` fields. Nothing is ever pickled.

``decode`` trusts nothing: it checks the schema version, the kind, every field's type, every array's dtype size,
length and bounds, finiteness and the size limits of `Limits`, and raises `ProtocolError` naming the field. A
service catches that one exception type, counts the reason and keeps serving. A frame that decodes may still not
fit the learner: `TrajectoryContract` says what a trajectory must satisfy to reach its model and names every
trajectory of a batch that breaks it (docs/RELIABILITY.md).

Modules, from the bottom up: `fields` (the `Message` base, `Limits`, `ProtocolError`, the field checks, raw
little-endian arrays), one per subject — `control` (hello, ready, heartbeat, ack, bye), `trajectories`
(`Trajectory`, `TrajectoryBatch`), `weights` (weights notice, request, header, chunk) — then `contract` (the
learner's `TrajectoryContract`) and `codec` (`SCHEMA_VERSION`, the kinds, `encode`, `decode`). Every name is
re-exported here.
"""

from heterorl.transport.protocol.codec import MESSAGES, SCHEMA_VERSION, decode, encode
from heterorl.transport.protocol.contract import MIN_LOGPROB, Breach, TrajectoryContract
from heterorl.transport.protocol.control import (
    BYE_BUSY,
    BYE_LEARNER_STOPPING,
    BYE_REFUSED,
    BYE_RUN_FINISHED,
    BYE_WORKER_FAILED,
    MAX_OUTCOMES,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Ready,
)
from heterorl.transport.protocol.fields import (
    DEFAULT_LIMITS,
    Limits,
    Message,
    ProtocolError,
)
from heterorl.transport.protocol.trajectories import (
    BatchExtremes,
    Trajectory,
    TrajectoryBatch,
    max_trajectory_wire_bytes,
)
from heterorl.transport.protocol.weights import (
    TENSOR_DTYPES,
    WeightsChunk,
    WeightsHeader,
    WeightsNotice,
    WeightsRequest,
    chunk_checksum,
)

__all__ = [
    "BYE_BUSY", "BYE_LEARNER_STOPPING", "BYE_REFUSED", "BYE_RUN_FINISHED", "BYE_WORKER_FAILED", "DEFAULT_LIMITS",
    "MAX_OUTCOMES", "MESSAGES", "MIN_LOGPROB", "SCHEMA_VERSION", "TENSOR_DTYPES", "Ack", "BatchExtremes", "Breach",
    "Bye", "Heartbeat", "Hello", "Limits", "Message", "ProtocolError", "Ready", "Trajectory", "TrajectoryBatch",
    "TrajectoryContract", "WeightsChunk", "WeightsHeader", "WeightsNotice", "WeightsRequest", "chunk_checksum",
    "decode", "encode", "max_trajectory_wire_bytes",
]
