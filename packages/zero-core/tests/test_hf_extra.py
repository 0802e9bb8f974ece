"""The Hugging Face integrations are zero-core's ``hf`` extra: without transformers (or accelerate,
for the Trainer) ``zero_core.integrations`` still imports, and using ``from_pretrained`` or
``ZeroTrainer`` is an error naming the extra and its install command."""

from __future__ import annotations

import sys

import pytest
import zero_core.integrations
from zero_core.plugins import MissingPackageError

HINT = r"\(zero-core's 'hf' extra\), which is not installed: pip install 'packages/zero-core\[hf\]'"


def test_from_pretrained_without_transformers_names_the_extra(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(MissingPackageError, match=rf"from_pretrained needs transformers {HINT}"):
        zero_core.integrations.from_pretrained(object, tmp_path, {"train_micro_batch_size_per_gpu": 1})


@pytest.mark.parametrize("absent", ["transformers", "accelerate"])
def test_zero_trainer_without_transformers_or_accelerate_names_the_extra(monkeypatch, absent) -> None:
    monkeypatch.setitem(sys.modules, absent, None)  # not installed
    with pytest.raises(MissingPackageError, match=rf"ZeroTrainer needs {absent} {HINT}"):
        zero_core.integrations.ZeroTrainer  # noqa: B018


def test_with_the_extra_the_names_resolve() -> None:
    import transformers

    assert issubclass(zero_core.integrations.ZeroTrainer, transformers.Trainer)
