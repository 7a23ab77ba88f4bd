"""vLLM's LoRA endpoints on the HTTP API: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(served with --allow-runtime-lora-updating), and the adapters' entries in /v1/models."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from vmesh.services.frontend.core import FrontendCore


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


async def adapter_cards(frontend: FrontendCore, base: str, created: int) -> list[dict[str, Any]]:
    """One /v1/models entry per adapter every group holds, its parent the base model (as vLLM lists them)."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "vmesh", "root": name, "parent": base}
            for name in await frontend.adapters.refresh()]


def add_lora_routes(app: FastAPI, frontend: FrontendCore) -> None:
    if not frontend.settings.allow_runtime_lora_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        frontend.ready()
        await frontend.adapters.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        frontend.ready()
        await frontend.adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
