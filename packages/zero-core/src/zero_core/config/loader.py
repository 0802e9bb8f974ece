"""``load_config``: from a dict, a JSON file, JSON text or argparse args to a validated ``ZeroConfig``.

Steps: pick the one config source; read it (JSON files with duplicate keys are rejected, as
DeepSpeed does; a file that is not strict JSON is read as Hjson, as DeepSpeed reads its config
files with the ``hjson`` library: comments, unquoted keys, trailing commas); report unknown keys (see [Note: unknown config keys]); validate with the models;
resolve the batch-size triple for the data-parallel world size. All problems found in one pass are
raised together as one :class:`ConfigError`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zero_core.config import sections
from zero_core.config.errors import ConfigError, format_validation_error
from zero_core.config.no_effect import check_no_effect
from zero_core.config.root import ZeroConfig
from zero_core.config.unimplemented import check_unimplemented, check_unimplemented_keys
from zero_core.config.unknown_keys import ENV_VAR, strip_unknown_keys, unknown_key_policy

#: closing line of a ConfigError that reports unknown keys.
UNKNOWN_KEYS_HINT = (
    "(DeepSpeed silently ignores keys it does not know; zero rejects them to catch typos. If these keys "
    f'are meant for another tool, set "zero_allow_unknown_keys": true or {ENV_VAR}=warn to ignore them '
    "with a warning)"
)

#: argparse attributes holding a config, in the order they are looked at (``deepscale_config`` is
#: DeepSpeed's deprecated name of ``deepspeed_config``).
ARGS_ATTRIBUTES = ("zero_config", "deepspeed_config", "deepspeed", "deepscale_config")

ConfigSource = Mapping[str, Any] | str | os.PathLike | ZeroConfig


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError([f"{key}: duplicate key in the JSON config (given twice)"])
        out[key] = value
    return out


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"], source=source
        ) from None
    except ConfigError as exc:
        raise ConfigError(exc.problems, source=source) from None
    if not isinstance(data, dict):
        raise ConfigError([f"the config must be a JSON object, got {type(data).__name__}"], source=source)
    return data


def _parse_file(text: str, source: str) -> dict[str, Any]:
    """Strict JSON first (its messages are the clearest); otherwise Hjson, a superset of JSON
    that DeepSpeed parses every config file with. When neither parses, both errors are given."""
    try:
        return _parse_json(text, source)
    except ConfigError as json_error:
        if not any(p.startswith("not valid JSON") for p in json_error.problems):
            raise  # valid JSON with a problem (a duplicate key, not an object): Hjson reads it the same
        import hjson

        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except ConfigError as exc:
            raise ConfigError(exc.problems, source=source) from None
        except hjson.HjsonDecodeError as exc:
            raise ConfigError(
                [
                    *json_error.problems,
                    f"not valid Hjson either: {exc.msg} at line {exc.lineno} column {exc.colno}",
                ],
                source=source,
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                [f"the config must be an object, got {type(data).__name__}"], source=source
            ) from None
        return json.loads(json.dumps(data))  # plain dicts and floats, as the JSON path gives


def read_config(source: ConfigSource) -> tuple[dict[str, Any], str | None]:
    """The raw config dict (a copy) and where it came from (None for a dict)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), None
    if isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and source.lstrip().startswith("{"):
            return _parse_json(source, "JSON text"), "JSON text"
        path = Path(source)
        if not path.is_file():
            raise ConfigError([f"config file not found: {str(path)!r} (expected a JSON file)"])
        return _parse_file(path.read_text(encoding="utf-8"), str(path)), str(path)
    raise ConfigError(
        [
            f"config: expected a dict, a path to a JSON file, JSON text or a ZeroConfig, got {type(source).__name__}"
        ]
    )


def _check_deepscale(args: object) -> None:
    """DeepSpeed's deprecated ``args.deepscale_config``: warn, and refuse it next to
    ``args.deepspeed_config`` (DeepSpeed does not know which to use either)."""
    old = getattr(args, "deepscale_config", None)
    if old is None:
        return
    if getattr(args, "deepspeed_config", None) is not None or getattr(args, "zero_config", None) is not None:
        raise ConfigError(
            [
                f"args.deepscale_config={old!r} is given next to args.deepspeed_config/zero_config: "
                "pass the config once (--deepscale_config is the deprecated name of --deepspeed_config)"
            ]
        )
    import warnings

    warnings.warn(
        "--deepscale_config is deprecated (as in DeepSpeed): use --zero_config or --deepspeed_config",
        FutureWarning,
        stacklevel=4,
    )


def _pick_source(
    config: ConfigSource | None, args: object, config_params: ConfigSource | None
) -> ConfigSource | None:
    if config is not None and config_params is not None and config is not config_params:
        raise ConfigError(
            ["config and config_params are both given: pass the config once (config_params is the old name)"]
        )
    explicit = config if config is not None else config_params
    from_args = None
    if args is not None:
        _check_deepscale(args)
        for attr in ARGS_ATTRIBUTES:
            value = getattr(args, attr, None)
            # `--deepspeed` is a boolean flag in DeepSpeed's own parser, a path in HF's.
            if value is None or isinstance(value, bool):
                continue
            from_args = (attr, value)
            break
    if explicit is not None and from_args is not None:
        raise ConfigError(
            [
                f"a config is given both to load_config and in args.{from_args[0]}={from_args[1]!r}: "
                "pass only one of them"
            ]
        )
    if explicit is not None:
        return explicit
    if from_args is not None:
        return from_args[1]
    raise ConfigError(
        [
            "no config given: pass config=<dict or JSON path>, or args with a zero_config/deepspeed_config attribute"
        ]
    )


def _check_key_values(cfg: ZeroConfig, policy: str, where: str | None) -> None:
    """Unimplemented keys set (errors) and keys without effect set (warnings), judged on the
    validated config. See [Note: config key truth] in ``key_paths.py``."""
    problems: list[str] = []
    check_unimplemented_keys(cfg, policy, problems)
    if problems:
        raise ConfigError(problems, source=where)
    check_no_effect(cfg)


def load_config(
    config: ConfigSource | None = None,
    *,
    args: object = None,
    config_params: ConfigSource | None = None,
    world_size: int | None = None,
    world_size_source: str | None = None,
    resolve_batch: bool = True,
) -> ZeroConfig:
    """Load and validate a DeepSpeed-format config.

    ``config`` (or its old name ``config_params``) is a dict, a path to a JSON file, JSON text or a
    :class:`ZeroConfig`; otherwise it is taken from ``args.zero_config``, ``args.deepspeed_config``
    or ``args.deepspeed`` (when a path). ``world_size`` is the data-parallel world size used to
    resolve the batch sizes, and ``world_size_source`` says where it came from (for messages); when
    omitted it is detected (see :func:`zero_core.config.batch.detect_world_size`). With
    ``resolve_batch=False`` the batch sizes stay as given (for inference or tools).

    Raises :class:`ConfigError` listing every problem, each with its key path.
    """
    source = _pick_source(config, args, config_params)
    if isinstance(source, ZeroConfig):
        cfg, where = source, None
        _check_key_values(
            cfg, unknown_key_policy({"zero_allow_unknown_keys": cfg.zero_allow_unknown_keys}), None
        )
    else:
        raw, where = read_config(source)
        try:
            policy = unknown_key_policy(raw)
        except ConfigError as exc:
            raise ConfigError(exc.problems, source=where) from None
        problems: list[str] = []
        raw = check_unimplemented(raw, policy, problems)  # See [Note: unimplemented features].
        known_before = len(problems)
        cleaned = strip_unknown_keys(
            raw, ZeroConfig, "", policy, problems, sections=sections.config_sections()
        )
        # Configs written for DeepSpeed often carry keys it silently ignores (other tools' keys,
        # "_comment"): say how to load them anyway. See [Note: unknown config keys].
        hint = UNKNOWN_KEYS_HINT if len(problems) > known_before else None
        try:
            cfg = ZeroConfig.model_validate(cleaned, context={"unknown_keys": policy})
        except ValidationError as exc:
            raise ConfigError(problems + format_validation_error(exc), source=where, hint=hint) from None
        if problems:
            raise ConfigError(problems, source=where, hint=hint)
        _check_key_values(cfg, policy, where)
    if resolve_batch:
        try:
            cfg = cfg.with_batch_sizes(world_size, world_size_source)
        except ConfigError as exc:
            raise ConfigError(exc.problems, source=where) from None
    return cfg
