"""The launcher's answer round-trips through its JSON file unchanged."""

from __future__ import annotations

from vmesh.services.mesh_description import MeshDescription, ServiceEntry, description_path


def test_description_round_trips():
    description = MeshDescription(
        address="127.0.0.1:50051", http_url="http://127.0.0.1:8000/v1", certificates="/tmp/certs",
        services={"worker": ServiceEntry("127.0.0.1:4001", 11, "http://127.0.0.1:9001/metrics"),
                  "frontend": ServiceEntry("127.0.0.1:50051", 12)})
    assert MeshDescription.from_json(description.to_json()) == description
    assert description_path("/run/x/ready").name == "ready.mesh.json"
