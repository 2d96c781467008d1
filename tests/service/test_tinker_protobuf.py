"""heterorl's hand-written protobuf of Tinker's messages against the SDK's own (generated) code: what the SDK
writes, heterorl reads; what heterorl writes, the SDK reads; and bytes that are not a message are a
`ProtobufError`, never another exception or an allocation bigger than they are."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from heterorl.service.tinker import protobuf  # noqa: E402


def sdk_request(data, loss_fn="ppo", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="t-0123456789ab:train:3", seq_id=7)
    message = request_conv.forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def test_a_request_the_sdk_writes_reads_back_whole():
    import torch

    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={
        "target_tokens": [6, 7, 8], "logprobs": [-0.5, -1.25, -2.0], "advantages": [0.0, 1.5, -1.5]}),
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]).append_int(3), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch_sparse(torch.tensor([[0, 4], [9, 0], [0, 0]])),
            "weights": types.TensorData.from_numpy(np.array([1.0, 0.5, 0.0], dtype=np.float32))})]
    got = protobuf.read_forward_backward(sdk_request(data, config={"clip_low_threshold": 0.75, "mode": "x"},
                                                     forward_only=True), max_datums=10)
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("t-0123456789ab:train:3", 7, "ppo", True)
    assert got.loss_fn_config == {"clip_low_threshold": 0.75, "mode": "x"}
    first, second = got.data
    assert first.tokens == [5, 6, 7] and second.tokens == [1, 2, 3]
    assert first.inputs["target_tokens"].dtype == np.int64 and first.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert first.inputs["advantages"].tolist() == [0.0, 1.5, -1.5]
    assert second.inputs["target_tokens"].tolist() == [[0, 4], [9, 0], [0, 0]]  # sparse, made dense
    assert second.inputs["weights"].tolist() == [1.0, 0.5, 0.0]


def test_what_heterorl_writes_the_sdk_reads():
    out = protobuf.forward_backward_output([np.array([-1.0, -2.5], np.float32), np.array([-0.25], np.float32)],
                                           {"loss:sum": 3.75})
    decoded = response_conv.deserialize_forward_backward_output(out)
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    assert decoded.metrics == {"loss:sum": 3.75}
    sample = protobuf.sample_response([protobuf.Sequence([4, 5], [-0.5, -0.75], True),
                                       protobuf.Sequence([6], [-2.0], False)], [math.nan, -1.5, -3.0])
    decoded = response_conv.deserialize_sample_response(sample)
    assert [(list(s.tokens), s.stop_reason) for s in decoded.sequences] == [([4, 5], "stop"), ([6], "length")]
    assert decoded.sequences[0].logprobs == [-0.5, -0.75]
    assert decoded.prompt_logprobs == [None, -1.5, -3.0]


def test_bad_bytes_and_oversized_claims_are_refused_before_any_allocation():
    with pytest.raises(protobuf.ProtobufError, match="past the end"):
        protobuf.read_forward_backward(b"\x1a\xff\xff\xff\x0f", max_datums=10)  # a datum of 4 GB declared
    datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})
    with pytest.raises(protobuf.ProtobufError, match="more than 1 datums"):
        protobuf.read_forward_backward(sdk_request([datum, datum]), max_datums=1)
    huge = pb.ForwardBackwardRequest()
    tensor = huge.data.add().loss_fn_inputs["weights"]
    tensor.dtype, tensor.sparse_csr.values = pb.DTYPE_FLOAT32, b""
    tensor.shape.extend([1, 10**12])
    tensor.sparse_csr.crow_indices = np.array([0, 0], dtype="<i8").tobytes()
    with pytest.raises(protobuf.ProtobufError, match="dense"):
        protobuf.read_forward_backward(huge.SerializeToString(), max_datums=10)
    image = pb.ForwardBackwardRequest()
    image.data.add().model_input.add().image.data = b"png"
    with pytest.raises(protobuf.ProtobufError, match="image chunk"):
        protobuf.read_forward_backward(image.SerializeToString(), max_datums=10)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_either_read_or_are_a_protobuf_error(raw):
    try:
        protobuf.read_forward_backward(raw, max_datums=16)
    except protobuf.ProtobufError:
        pass
