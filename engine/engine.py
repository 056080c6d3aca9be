"""The engine's public face: the synchronous core and its asyncio front.

    EngineCore   engine/core.py          add_request / abort_request / step() -> outputs
    AsyncEngine  engine/async_engine.py  async generate() / abort(), the core in its own thread
"""
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore, tokenize_prompt
from engine.scheduler import QueueFullError
from engine.stats import EngineStats

__all__ = ["AsyncEngine", "EngineConfig", "EngineCore", "EngineStats", "QueueFullError", "tokenize_prompt"]
