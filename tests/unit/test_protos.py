"""The checked-in stubs are exactly what the protos generate."""

from __future__ import annotations

from tools.gen_protos import ROOT, generate


def test_stubs_match_protos(tmp_path):
    generated = generate(tmp_path)
    assert generated, "no stubs generated"
    for path in generated:
        relative = path.relative_to(tmp_path)
        checked_in = ROOT / relative
        assert checked_in.is_file(), f"{relative} is generated but not checked in: run python tools/gen_protos.py"
        assert checked_in.read_bytes() == path.read_bytes(), f"{relative} drifted: run python tools/gen_protos.py"
    checked = {p.relative_to(ROOT) for p in (ROOT / "vmesh" / "v1").rglob("*.py*") if "__pycache__" not in p.parts}
    stale = checked - {p.relative_to(tmp_path) for p in generated}
    assert not stale, f"checked-in stubs with no proto: {sorted(map(str, stale))}"


def test_enums_start_unspecified():
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("enum "):
                assert "_UNSPECIFIED = 0;" in lines[i + 1], f"{proto.name}: {line.strip()} must start at *_UNSPECIFIED"


