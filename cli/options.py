"""Command-line flags read off the config dataclasses, and the given flags back into a config.

A field made with `schemas.configs.option` (or `added(..., help=...)`) is the flag `--name`
(`_` as `-`), typed by its annotation, with its help and its default; a bool is `--name` /
`--no-name`. A section (a nested config) brings its own options, or those named by the
section field's `metadata["options"]`. Fields that share a flag take one value: the
pipeline's `--seed` sets the chunk plan's, sampling's and training's seeds. Options marked
`ablation` parse but stay out of `--help`.

A flag left out does not touch the config: `config_from` merges only the given ones into the
preset, as its overrides, and returns the preset's validated config.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from schemas.configs import ConfigError

PREFIX = "option_"  # of the flags' dests, apart from the other arguments'


def dest(flag: str) -> str:
    """Where the parsed value of `flag` lands in the namespace (None when the flag was not given)."""
    return PREFIX + flag.removeprefix("--").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag and the config fields it sets."""

    name: str  # "--chunk-max"
    paths: tuple[tuple[str, ...], ...]  # the fields, as paths from the top config: (("chunks", "chunk_max"),)
    fields: tuple[str, ...]  # the same fields as config errors name them: ("ChunkConfig.chunk_max",)
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None
    hidden: bool
    section: str  # its fields' section ("" at the top, or when they are in several)

    @property
    def dest(self) -> str:
        return dest(self.name)


def flags(config: type) -> list[Flag]:
    """The flags of a config class, in field order; fields that share a flag name are one flag."""
    merged: dict[str, Flag] = {}
    for path, owner, field, kind in _options(config, ()):
        meta = field.metadata
        name = meta["flag"] or "--" + field.name.replace("_", "-")
        new = Flag(name, (path,), (f"{owner.__name__}.{field.name}",), kind, field.default, meta["help"],
                   meta["choices"], meta["ablation"], ".".join(path[:-1]))
        old = merged.get(name)
        if old is None:
            merged[name] = new
            continue
        if (old.kind, old.default, old.choices) != (new.kind, new.default, new.choices):
            raise TypeError(f"{name}: {old.fields[0]} and {new.fields[0]} differ in type, default or choices")
        merged[name] = dataclasses.replace(old, paths=old.paths + new.paths, fields=old.fields + new.fields,
                                           help=old.help if new.help == old.help else f"{old.help}; {new.help}",
                                           hidden=old.hidden and new.hidden,
                                           section=old.section if old.section == new.section else "")
    return list(merged.values())


def _options(config: type, path: tuple[str, ...],
             only: tuple[str, ...] | None = None) -> Iterator[tuple[tuple[str, ...], type, dataclasses.Field, type]]:
    hints = typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from _options(hint, (*path, field.name), field.metadata.get("options"))
        elif "help" in field.metadata and (only is None or field.name in only):
            yield (*path, field.name), config, field, _kind(config, field.name, hint)


def _kind(config: type, name: str, hint: Any) -> type:
    """int, float, str, bool, or tuple (of str, given comma-separated); `X | None` is X (None
    being the field's own default)."""
    if isinstance(hint, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = kinds[0] if len(kinds) == 1 else hint
    if hint == tuple[str, ...]:
        return tuple
    if hint not in (int, float, str, bool):
        raise TypeError(f"{config.__name__}.{name}: a command-line option must be int, float, str, bool or "
                        "tuple[str, ...]")
    return hint


def _words(text: str) -> tuple[str, ...]:
    """A comma-separated flag value as its items (`a,b` or `a, b`)."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def add_options(parser: argparse.ArgumentParser, config: type, top: str = "") -> None:
    """Add the config's flags to `parser`, one argument group per section (`top` names the top)."""
    groups: dict[str, Any] = {}
    for flag in flags(config):
        title = flag.section or top
        if title not in groups:
            groups[title] = parser.add_argument_group(f"{title} options") if title else parser
        extra: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if flag.kind is bool else {
            "type": _words if flag.kind is tuple else flag.kind, "choices": flag.choices,
            "metavar": None if flag.choices else _METAVARS[flag.kind]}
        groups[title].add_argument(flag.name, dest=flag.dest, default=None, help=_help(flag), **extra)


_METAVARS = {int: "N", float: "X", str: "TEXT", tuple: "A,B"}


def _help(flag: Flag) -> str:
    if flag.hidden:
        return argparse.SUPPRESS
    text = flag.help.replace("%", "%%")
    if flag.default is None:  # the help says what the field's own default means
        return text
    shown = (("on" if flag.default else "off") if flag.kind is bool else
             ",".join(flag.default) if flag.kind is tuple else flag.default)
    return f"{text} (default: {shown})"


def given(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The flags given on the command line as overrides: nested dicts along the fields' paths."""
    out: dict[str, Any] = {}
    for flag in flags(config):
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        for path in flag.paths:
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
    return out


def config_from(args: argparse.Namespace, config: type, preset: Callable[[str, dict], Any], name: str) -> Any:
    """The preset `name` with the given flags as its overrides, validated. An invalid value's error
    starts with the flag that set it."""
    overrides = given(args, config)
    try:
        return preset(name, overrides)
    except ConfigError as e:
        for flag in flags(config):
            value = getattr(args, flag.dest, None)
            if value is not None and any(f"{field}:" in str(e) for field in flag.fields):
                raise ConfigError(f"{flag.name} {value}: {e}") from e
        raise
