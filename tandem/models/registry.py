"""The registry of model adapters, chosen by config.json's ``architectures`` / ``model_type``.

Adapters register lazily by module path so importing the registry imports no model code. A test (or a plug-in)
may ``register`` a new architecture at run time; the engine then serves it with no edit outside its folder.
"""

from __future__ import annotations

import importlib
from typing import cast

from tandem.config import ConfigError, RawConfig
from tandem.models.protocol import Adapter

# key (architecture class name or model_type) -> "module:attribute" of the adapter class
_ADAPTERS: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "tandem.models.qwen3_5.model:Qwen3_5Model",
    "Qwen3_5ForCausalLM": "tandem.models.qwen3_5.model:Qwen3_5Model",
    "qwen3_5": "tandem.models.qwen3_5.model:Qwen3_5Model",
    "qwen3_5_text": "tandem.models.qwen3_5.model:Qwen3_5Model",
    "Qwen3_5MoeForConditionalGeneration": "tandem.models.qwen3_5_moe.model:Qwen3_5MoeModel",
    "Qwen3_5MoeForCausalLM": "tandem.models.qwen3_5_moe.model:Qwen3_5MoeModel",
    "qwen3_5_moe": "tandem.models.qwen3_5_moe.model:Qwen3_5MoeModel",
    "qwen3_5_moe_text": "tandem.models.qwen3_5_moe.model:Qwen3_5MoeModel",
    "Qwen3NextForCausalLM": "tandem.models.qwen3_next.model:Qwen3NextModel",
    "qwen3_next": "tandem.models.qwen3_next.model:Qwen3NextModel",
}


def register(keys: list[str], target: str) -> None:
    """Register an adapter class (``"module:Class"``) under architecture names and/or model types."""
    for key in keys:
        _ADAPTERS[key] = target


def registered() -> list[str]:
    """All registered architecture names and model types, sorted."""
    return sorted(_ADAPTERS)


def resolve(raw: RawConfig) -> Adapter:
    """Return the adapter class for a config (its ``load`` builds a model: tandem/models/protocol.py).

    The first of ``architectures``, then the top-level ``model_type``, then the text ``model_type`` that is
    registered wins.

    Raises:
        ConfigError: nothing matches; the message names what the config declares and every registered key.
    """
    keys = [*raw.architectures, raw.model_type, str(raw.text.get("model_type", ""))]
    for key in keys:
        if key and key in _ADAPTERS:
            module_name, _, attr = _ADAPTERS[key].partition(":")
            return cast(Adapter, getattr(importlib.import_module(module_name), attr))
    declared = ", ".join(k for k in keys if k) or "nothing"
    raise ConfigError(
        f"{raw.path}: unsupported model (config declares {declared}); registered: {', '.join(registered())}"
    )
