"""add_config_arguments: zero and DeepSpeed spellings, --local_rank."""

from __future__ import annotations

import argparse

import pytest
from zero_core.arguments import add_config_arguments


def _parser() -> argparse.ArgumentParser:
    return add_config_arguments(argparse.ArgumentParser(prog="train"))


def test_defaults(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = _parser().parse_args([])
    assert (args.zero, args.zero_config, args.deepspeed, args.deepspeed_config, args.local_rank) == (
        False,
        None,
        False,
        None,
        -1,
    )


def test_zero_spelling():
    args = _parser().parse_args(["--zero", "--zero_config", "cfg.json", "--local_rank", "3"])
    assert args.zero is True and args.zero_config == "cfg.json" and args.local_rank == 3


def test_deepspeed_spelling_keeps_deepspeed_dest_names():
    args = _parser().parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--local-rank=1"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json" and args.local_rank == 1
    assert args.zero is False and args.zero_config is None


def test_local_rank_default_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert _parser().parse_args([]).local_rank == 5


def test_bad_local_rank_env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "five")
    with pytest.raises(ValueError, match="LOCAL_RANK='five' is not an integer"):
        _parser()


def test_existing_local_rank_is_kept():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=7)
    add_config_arguments(parser)
    args = parser.parse_args(["--zero"])
    assert args.local_rank == 7 and args.zero


def test_returns_the_parser_and_keeps_user_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    assert add_config_arguments(parser) is parser
    args = parser.parse_args(["--lr", "0.5", "--zero_config", "c.json"])
    assert args.lr == 0.5 and args.zero_config == "c.json"
    assert any(g.title == "zero" for g in parser._action_groups)


def test_added_twice_is_an_error():
    parser = _parser()
    with pytest.raises(ValueError, match="already defines"):
        add_config_arguments(parser)


def test_not_a_parser():
    with pytest.raises(TypeError, match="must be an argparse.ArgumentParser"):
        add_config_arguments({"zero": True})


def test_missing_path_value_is_a_parse_error(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--zero_config"])
    assert "--zero_config" in capsys.readouterr().err
