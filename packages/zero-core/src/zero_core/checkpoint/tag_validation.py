"""``checkpoint.tag_validation``: what ``save_checkpoint`` does when ranks pass different tags.

[Note: checkpoint tag agreement]
Every rank of a save writes its shard under one tag directory, so the ranks must agree on the
tag (``tag=f"step{rank}"`` by mistake, or a timestamp taken on each rank). DeepSpeed's config
key ``checkpoint.tag_validation`` says what happens when they do not: ``"Fail"`` raises on
every rank, ``"Warn"`` (the default) warns and saves, ``"Ignore"`` saves without a word.
Where DeepSpeed then writes each rank's files under that rank's own tag (a checkpoint no tag
of which is complete), every rank here saves under group rank 0's tag, so the result loads.

The comparison itself is the engine's store-based save agreement (``SaveAgreement`` in
``engine/agreement.py``, See [Note: rank agreement]), which also catches a rank that does not
call ``save_checkpoint`` at all; it runs once per save, before the saver writes anything. This
module owns the mode: its names and their parsing.
"""

from __future__ import annotations

MODES = ("ignore", "warn", "fail")


def parse_mode(mode: object) -> str:
    """``checkpoint.tag_validation`` (any case) as one of :data:`MODES`; a clear error otherwise."""
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ValueError(f'checkpoint.tag_validation must be "Ignore", "Warn" or "Fail", got {mode!r}')
    return mode.lower()
