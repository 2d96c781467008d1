"""The weight path, learner to workers, in one folder:

- `pack`: a state dict packed into one buffer for the wire (and back), the wire dtype (`wire_dtype_for`);
- `deltas`: the exact step between two versions (sparse, XOR + zstd, or whole) and the chain of them;
- `store`: the versions a weights server holds, packed, and the steps between them (`WeightsStore`);
- `release`: the learner's release of versions to each worker, after its weights link's delay (`WeightsRelease`);
- `reshard`: placements, the plan of every slice between a trainer's layout and a worker's, the assembler;
- `shards`: a sharded learner's other ranks, each sending its own slices (`ShardServer`).

Packing's names are importable from here (``from heterorl.transport.weights import pack_state_dict``); the
rest from their modules.
"""

from heterorl.transport.weights.pack import (
    BF16_FROM_PARAMETERS,
    WIRE_DTYPES,
    PackedWeights,
    dtype_name,
    pack_state_dict,
    unpack_state_dict,
    wire_dtype,
    wire_dtype_for,
)

__all__ = ["BF16_FROM_PARAMETERS", "WIRE_DTYPES", "PackedWeights", "dtype_name", "pack_state_dict",
           "unpack_state_dict", "wire_dtype", "wire_dtype_for"]
