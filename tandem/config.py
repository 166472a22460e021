"""Read a checkpoint's ``config.json`` and pick the model adapter for it.

Official Qwen3.5 releases are vision-language checkpoints whose language model lives in a nested
``text_config`` (spec/qwen3_5.md §1.1); flat text-only configs (Qwen3-Next, text exports) are read as they are.
Architecture-specific validation lives with each adapter's hyper-parameter class; this module only reads JSON
and chooses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that is missing, unreadable, or names an unsupported or inconsistent model."""


@dataclass(frozen=True)
class RawConfig:
    """The parts of config.json an adapter needs.

    Attributes:
        path: the checkpoint directory.
        top: the whole top-level JSON object.
        text: the language model's fields (``text_config`` when nested, else ``top``), with top-level
            ``tie_word_embeddings`` / ``quantization_config`` carried in when the text part lacks them.
        architectures: the top-level ``architectures`` list (may be empty).
        model_type: the top-level ``model_type`` ("" when absent).
        generation: ``generation_config.json`` when present, else {}.
    """

    path: Path
    top: dict[str, Any]
    text: dict[str, Any]
    architectures: list[str]
    model_type: str
    generation: dict[str, Any] = field(default_factory=dict)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def read_config(path: str | Path) -> RawConfig:
    """Read ``<path>/config.json`` (and ``generation_config.json`` if present).

    Raises:
        ConfigError: the directory or config.json is missing, not JSON, or ``text_config`` is not an object.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a checkpoint directory")
    top = _read_json(root / "config.json")
    text: dict[str, Any]
    if "text_config" in top:
        if not isinstance(top["text_config"], dict):
            raise ConfigError(f"{root / 'config.json'}: text_config must be an object")
        text = dict(top["text_config"])
        for key in ("tie_word_embeddings", "quantization_config"):
            if key not in text and key in top:
                text[key] = top[key]
    else:
        text = dict(top)
    archs = top.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{root / 'config.json'}: architectures must be a list of strings")
    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    return RawConfig(root, top, text, list(archs), str(top.get("model_type", "")), generation)


def require(cfg: dict[str, Any], name: str, kind: type, *, positive: bool = False, default: Any = None) -> Any:
    """Fetch ``cfg[name]`` checked against ``kind``, naming the field in the error.

    Raises:
        ConfigError: the field is absent (and no default), has the wrong type, or is not positive when asked.
    """
    if name not in cfg or cfg[name] is None:
        if default is not None:
            return default
        raise ConfigError(f"config field {name!r} is missing")
    value = cfg[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"config field {name!r} must be {kind.__name__}, got {value!r}")
    if positive and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"config field {name!r} must be positive, got {value!r}")
    return value
