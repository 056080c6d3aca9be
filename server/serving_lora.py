"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters while serving, as vLLM's.

    {"lora_name": "sql", "lora_path": "/adapters/sql"}  -> 200 "Success: LoRA adapter 'sql' added successfully."
    {"lora_name": "sql"}                                -> 200 "Success: LoRA adapter 'sql' removed successfully."

Off unless the server runs with --enable-lora-runtime-updates (404 lora_updates_disabled). A load
is read and checked in full (its directory, config, rank, every layer and shape against the
model, --lora-root, the name, --max-loras) before it answers: 400 naming the problem, 409 for a
name already loaded; the engine installs it between two steps. An unload is refused with 409
(lora_in_use) while a request of the adapter is running or waiting: requests are never cut.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from engine.lora import LoRAInUseError, LoRANameTakenError, LoRANotFoundError
from server.errors import APIError, invalid
from server.protocol import parse_body
from server.serving_common import ServerState, read_body


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what identify adapters here


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def outside_root(path: str, root: str | None) -> str | None:
    """Why `path` may not be read under --lora-root `root` (None: it may): it, and the adapter
    files in it, must resolve (symlinks followed) to `root` or below it."""
    if root is None:
        return None
    real_root = os.path.realpath(root)
    for candidate in (path, *(os.path.join(path, name) for name in ADAPTER_FILES)):
        if os.path.commonpath([os.path.realpath(candidate), real_root]) != real_root:
            return f"lora_path {path!r} resolves outside --lora-root {root!r}"
    return None


async def _parse(request: Request, model_cls: type[Any]) -> tuple[ServerState, Any, Any]:
    state: ServerState = request.app.state.server
    if not state.lora_runtime_updates:
        raise APIError(
            404,
            "Loading and unloading LoRA adapters while serving is off; start the server with "
            "--enable-lora-runtime-updates.",
            code="lora_updates_disabled",
        )
    raw = await read_body(request, state.max_body_bytes)
    engine = state.require_engine()
    if not engine.is_running:
        raise APIError(503, "The engine has stopped; no adapter can be loaded or unloaded.", code="engine_stopped")
    return state, engine, parse_body(raw, model_cls)


async def load_lora_adapter(request: Request) -> Response:
    state, engine, body = await _parse(request, LoadLoRAAdapterRequest)
    name = body.lora_name
    if not name or name == state.served_model_name or name in state.model_aliases:
        raise invalid(f"lora_name {name!r} is empty or names the base model", param="lora_name")
    if name in state.lora_names:
        raise APIError(
            409,
            f"A LoRA adapter named {name!r} is already loaded; unload it first.",
            param="lora_name",
            code="lora_name_taken",
        )
    problem = outside_root(body.lora_path, state.lora_root)
    if problem is not None:
        raise invalid(problem, param="lora_path", code="lora_path_outside_root")
    try:
        with anyio.CancelScope(shield=True):  # a client gone mid-load must not leave the names behind the engine
            # Read from the path as checked: a symlink changed meanwhile does not lead elsewhere.
            path = os.path.realpath(body.lora_path) if state.lora_root is not None else body.lora_path
            await engine.load_lora_adapter(name, path)
            state.lora_names = (*state.lora_names, name)
    except LoRANameTakenError as exc:  # loaded by a request that came in meanwhile
        raise APIError(409, str(exc), param="lora_name", code="lora_name_taken") from None
    except ValueError as exc:
        raise invalid(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    except Exception as exc:  # noqa: BLE001 - e.g. a reader's own error on a mangled file: still the adapter's fault
        raise invalid(
            f"LoRA adapter {name!r} ({body.lora_path}) cannot be read: {type(exc).__name__}: {exc}",
            param="lora_path",
            code="invalid_lora_adapter",
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state, engine, body = await _parse(request, UnloadLoRAAdapterRequest)
    name = body.lora_name
    try:
        with anyio.CancelScope(shield=True):
            await engine.unload_lora_adapter(name)
            state.lora_names = tuple(n for n in state.lora_names if n != name)
    except LoRANotFoundError:
        raise APIError(
            404, f"The LoRA adapter '{name}' is not loaded.", param="lora_name", code="model_not_found"
        ) from None
    except LoRAInUseError as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
