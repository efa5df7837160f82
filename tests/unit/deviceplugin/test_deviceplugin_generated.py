"""The committed gRPC stubs are what `gen.py` makes from the committed api.proto."""

from __future__ import annotations

from pathlib import Path

from metaroce_agent.deviceplugin import gen
from metaroce_agent.deviceplugin.api import api_pb2, api_pb2_grpc


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    files = gen.generate(tmp_path)
    assert [f.name for f in files] == list(gen.GENERATED)
    stale = [f.name for f in files if f.read_bytes() != (gen.PACKAGE_DIR / f.name).read_bytes()]
    assert not stale, (
        f"{', '.join(stale)} differ from what api.proto generates with the installed "
        "grpcio-tools: run `python -m metaroce_agent.deviceplugin.gen` and commit the result"
    )


def test_stubs_speak_the_kubelet_service_names() -> None:
    services = api_pb2.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert services["DevicePlugin"].full_name == "v1beta1.DevicePlugin"
    assert hasattr(api_pb2_grpc, "add_DevicePluginServicer_to_server")


def test_the_proto_copy_keeps_its_provenance_header() -> None:
    text = gen.PROTO.read_text()
    head, marker, body = text.partition("// ---- upstream k8s.io/kubelet api.proto follows ----\n")
    assert marker, "the marker line separating our header from the upstream file is gone"
    assert "Apache License, Version 2.0" in head and "k8s.io/kubelet@" in head
    assert body.startswith("// To regenerate api.pb.go")
