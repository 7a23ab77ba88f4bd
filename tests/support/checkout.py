"""The checkout the tests run from, and the mesh's service names as its deployment files spell them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
