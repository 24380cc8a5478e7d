"""``model.config_overrides``: fields of the model's Transformers config replaced before the model is built.

The usual use is a longer context: ``rope_scaling`` (YaRN, linear, dynamic NTK, Llama-3, LongRoPE, as
Transformers defines them; written as ``rope_scaling`` or as Transformers 5's ``rope_parameters``) with
``max_position_embeddings``. The config is rebuilt from its dictionary with the overrides in it, so Transformers
standardizes the RoPE parameters as it does for a ``config.json`` (``rope_theta`` kept unless given,
``original_max_position_embeddings`` defaulting to the checkpoint's context). Each override is checked before
any weight is read: a field the config does not have, a value of another type than the field's, an unknown RoPE
type, or RoPE parameters the type's own frequency function rejects is a ConfigError naming
``model.config_overrides.<field>``.

The rotary embedding computes its (scaled) cos and sin tables from the config, and loralei's RoPE kernel applies
whatever tables it is given, so the fused path honours every scaling type.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..errors import ConfigError

FIELD = "model.config_overrides"
# what users write (the name of Transformers 4 and of most model cards) and where Transformers 5 keeps it
ROPE_KEYS = ("rope_scaling", "rope_parameters")
# RoPE types that scale from the pretraining context (Transformers reads original_max_position_embeddings)
ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def overridden_config(config: Any, overrides: dict[str, Any]) -> Any:
    """``config`` rebuilt with ``overrides`` in place (``config`` itself when there are none).

    Raises:
        ConfigError: an override names no field of the config, has another type than the field, or sets RoPE
            parameters the model type cannot compute.
    """
    if not overrides:
        return config
    fields = config.to_dict()
    for key, value in overrides.items():
        _check_field(config, fields, key, value)
    updated = {**fields, **{k: v for k, v in overrides.items() if k not in ROPE_KEYS}}
    rope = next((overrides[k] for k in ROPE_KEYS if k in overrides), None)
    if rope is not None:
        updated["rope_parameters"] = _rope_parameters(config, rope)
    key = next((k for k in ROPE_KEYS if k in overrides), next(iter(overrides)))
    try:  # Transformers validates the RoPE parameters as it builds the config (raising or warning by version)
        rebuilt = type(config).from_dict(updated)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{FIELD}.{key}: the model's config rejects it: {type(exc).__name__}: {exc}"
        ) from None
    if rope is not None:
        _check_rope(rebuilt, key)
    return rebuilt


def _check_field(config: Any, fields: dict[str, Any], key: str, value: Any) -> None:
    model_type = getattr(config, "model_type", type(config).__name__)
    if key in ROPE_KEYS:
        if not isinstance(value, dict):
            raise ConfigError(
                f"{FIELD}.{key}: {value!r} is not a mapping; give e.g. "
                "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}"
            )
        if getattr(config, "rope_parameters", None) is None:
            raise ConfigError(f"{FIELD}.{key}: the {model_type} config has no rotary embedding parameters")
        return
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=3)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"its fields include {', '.join(sorted(fields)[:12])}"
        )
        raise ConfigError(f"{FIELD}.{key}: the {model_type} config has no field {key!r}; {hint}")
    current = fields[key]
    if not _same_kind(current, value):
        raise ConfigError(
            f"{FIELD}.{key}: {value!r} is of type {type(value).__name__}, but the {model_type} config's {key} "
            f"is of type {type(current).__name__} ({current!r})"
        )


def _same_kind(current: Any, value: Any) -> bool:
    """Whether ``value`` may replace ``current``: unset fields take anything; numbers stay numbers (an int may
    replace a float), booleans booleans, strings strings."""
    if current is None or value is None:
        return True
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, int if isinstance(current, int) else (int, float))
    return isinstance(value, type(current))


def _rope_parameters(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters with ``rope`` in them: ``type`` read as ``rope_type``, the checkpoint's theta kept,
    and for the types scaled from a pretraining length, that length defaulting to the checkpoint's
    ``max_position_embeddings`` (not to an overridden one)."""
    current = dict(getattr(config, "rope_parameters", None) or {})
    given = {("rope_type" if k == "type" else k): v for k, v in rope.items()}
    kept = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
    if given.get("rope_type") in ORIGINAL_LENGTH_TYPES and hasattr(config, "max_position_embeddings"):
        kept["original_max_position_embeddings"] = getattr(
            config, "original_max_position_embeddings", config.max_position_embeddings
        )
    return {**kept, **given}


def _check_rope(config: Any, key: str) -> None:
    """Runs the RoPE type's own frequency function on ``config``: what the model does when it is built."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return
    if rope_type not in ROPE_INIT_FUNCTIONS:
        types = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise ConfigError(
            f"{FIELD}.{key}.rope_type: {rope_type!r} is not a RoPE type; Transformers has {types}"
        )
    try:
        ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as exc:
        raise ConfigError(
            f"{FIELD}.{key}: rope_type {rope_type!r} cannot use {params}: {type(exc).__name__}: {exc}"
        ) from None
