"""``vocable serve``'s flags, generated from :class:`~server.config.serve_options.ServeOptions`.

Each flag's argparse default is its ``VOCABLE_*`` variable's text (else the model's default), so
a given flag overrides the variable; no flag has a ``type`` or ``choices``: the raw values of
both go through :func:`serve_options`, one check with one kind of refusal."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .llm import LLM_GROUP, add_llm_arguments
from .option_values import split_list
from .serve_options import OPTIONS, Option, ServeOptions, validate_options

__all__ = ["add_serve_arguments", "env_values", "parse_serve_options", "serve_options"]


def env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """Raw values by field name of the ``VOCABLE_*`` variables set (empty ones count as unset);
    a repeatable option's variable is split at commas."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        text = env.get(option.env)
        if text:
            values[option.name] = split_list(text) if option.cli.repeat else text
    return values


def add_serve_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ
) -> None:
    """Flags of ``vocable serve`` in --help groups, plus the LLM endpoint's; ``env`` is read
    now. Check the parsed namespace with :func:`serve_options`."""
    given = env_values(env)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in OPTIONS:
        if option.cli.group not in groups:
            groups[option.cli.group] = (
                add_llm_arguments(parser)
                if option.cli.group == LLM_GROUP
                else parser.add_argument_group(option.cli.group)
            )
        _add(groups[option.cli.group], option, given.get(option.name, _unset(option)))


def _unset(option: Option) -> Any:
    # a list, not the model's (), for argparse's "append" to add to
    return [] if option.cli.repeat else option.field.default


def _add(group: argparse._ArgumentGroup, option: Option, default: Any) -> None:
    if option.switch:
        group.add_argument(
            option.flag, dest=option.name, action="store_true", default=default, help=option.help()
        )
        return
    group.add_argument(
        option.flag,
        dest=option.name,
        action="append" if option.cli.repeat else "store",
        default=default,
        metavar=option.metavar,
        help=option.help(),
    )


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The checked options of a namespace parsed with :func:`add_serve_arguments`; raises
    ConfigError naming the flag and the variable of each value refused."""
    values = vars(args)
    return validate_options({o.name: values[o.name] for o in OPTIONS if o.name in values})


def parse_serve_options(
    argv: Sequence[str], env: Mapping[str, str] = os.environ
) -> tuple[ServeOptions, argparse.Namespace]:
    """``vocable serve ARGV`` under ``env``: the options, and the namespace (for the LLM flags);
    raises ConfigError as :func:`serve_options`."""
    parser = argparse.ArgumentParser(prog="vocable serve")
    add_serve_arguments(parser, env)
    args = parser.parse_args(argv)
    return serve_options(args), args
