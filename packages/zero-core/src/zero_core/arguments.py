"""``add_config_arguments``: the command-line switches of a zero training script.

Scripts written for DeepSpeed keep working: ``--deepspeed``/``--deepspeed_config`` are
accepted (dest names ``deepspeed``/``deepspeed_config``, as ``deepspeed.initialize(args=...)``
reads them), next to the new ``--zero``/``--zero_config``; so are DeepSpeed's deprecated
``--deepscale``/``--deepscale_config`` (hidden from ``--help``, as in DeepSpeed; the config loader
warns when it reads ``args.deepscale_config``).
"""

from __future__ import annotations

import argparse
import os


def _env_local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"add_config_arguments: environment variable LOCAL_RANK={raw!r} is not an integer"
        ) from None


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the zero argument group to ``parser`` and return it.

    Adds ``--zero`` (store_true: enable zero), ``--zero_config PATH`` (the JSON config),
    their DeepSpeed spellings ``--deepspeed`` and ``--deepspeed_config``, and ``--local_rank``
    (int, default ``$LOCAL_RANK`` or -1) unless the parser already defines it. The config
    loader accepts either pair: ``args.zero_config`` or ``args.deepspeed_config``.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(
            f"add_config_arguments: parser must be an argparse.ArgumentParser, got {type(parser).__name__}"
        )
    existing = {opt for action in parser._actions for opt in action.option_strings}
    ours = {
        "--zero",
        "--zero_config",
        "--deepspeed",
        "--deepspeed_config",
        "--deepscale",
        "--deepscale_config",
    }
    clash = sorted(existing & ours)
    if clash:
        raise ValueError(
            f"add_config_arguments: the parser already defines {clash}; call add_config_arguments once"
        )
    group = parser.add_argument_group("zero", "zero (ZeRO training) configuration")
    group.add_argument("--zero", action="store_true", default=False, help="enable zero (ZeRO training)")
    group.add_argument(
        "--zero_config", default=None, type=str, metavar="PATH", help="zero JSON configuration file"
    )
    group.add_argument(
        "--deepspeed",
        action="store_true",
        default=False,
        help="same as --zero (accepted for DeepSpeed scripts)",
    )
    group.add_argument(
        "--deepspeed_config",
        default=None,
        type=str,
        metavar="PATH",
        help="same as --zero_config (accepted for DeepSpeed scripts)",
    )
    # DeepSpeed's deprecated spellings, hidden from --help as DeepSpeed hides them.
    group.add_argument("--deepscale", action="store_true", default=False, help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    if "--local_rank" not in existing and "--local-rank" not in existing:
        group.add_argument(
            "--local_rank",
            "--local-rank",
            dest="local_rank",
            type=int,
            default=_env_local_rank(),
            help="local rank of this process (set by launchers; default: $LOCAL_RANK or -1)",
        )
    return parser
