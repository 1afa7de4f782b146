"""The committed gRPC stubs are exactly what the .proto files generate (`make proto`)."""

from __future__ import annotations

from pathlib import Path

from appliance.grpc import build_proto


def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path) -> None:
    build_proto.generate(tmp_path)
    stale = [
        rel
        for rel in build_proto.generated_files()
        if (tmp_path / rel).read_bytes() != (build_proto.ROOT / rel).read_bytes()
    ]
    assert not stale, f"stubs out of date, run `make proto`: {stale}"


def test_kserve_stubs_coexist_with_tritonclients_in_one_process() -> None:
    import tritonclient.grpc.service_pb2 as triton_pb

    from appliance.grpc.proto.inference import grpc_service_pb2 as ours

    req = ours.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"\x01"])
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    theirs = triton_pb.ModelInferRequest.FromString(req.SerializeToString())
    assert (theirs.model_name, theirs.id, list(theirs.raw_input_contents)) == ("m", "7", [b"\x01"])
    assert theirs.parameters["triton_enable_empty_final_response"].bool_param


def test_kserve_subset_matches_tritons_field_numbers_and_types() -> None:
    import tritonclient.grpc.service_pb2 as triton_pb

    from appliance.grpc.proto.inference import grpc_service_pb2 as ours

    def shape(desc) -> dict:
        return {
            f.name: (
                f.number,
                f.type,
                f.is_repeated,
                shape(f.message_type) if f.message_type else None,
            )
            for f in desc.fields
        }

    for name, msg in ours.DESCRIPTOR.message_types_by_name.items():
        assert shape(msg) == shape(triton_pb.DESCRIPTOR.message_types_by_name[name]), name
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in ours.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        t = theirs.methods_by_name[m.name]
        assert (m.input_type.name, m.output_type.name) == (t.input_type.name, t.output_type.name)
        assert (m.client_streaming, m.server_streaming) == (t.client_streaming, t.server_streaming)
