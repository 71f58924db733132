"""Reading the YAML configs a user gives (cluster specs, LLM configs): files or preset names.

One place for what every config loader needs: finding presets in ``configs/<kind>/``, resolving a
``--cluster``/``--llm`` argument to a file, safe YAML that rejects duplicated keys, and pydantic
errors folded into one line that names the field path.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tessera.core.errors import InputError
from tessera.core.user_files import read_user_file, regular_file

# Values a config may hold once its aliases are expanded: a cluster spec or LLM config holds a few
# hundred; nested aliases (a "billion laughs" document of a few hundred bytes) expand past any bound.
MAX_EXPANDED_VALUES = 1_000_000
# Bytes a config file may hold: the presets are a few KB, and YAML reads at about 1 MB/s (libyaml's
# parser, PyYAML's constructor in Python), so a 50 MB file would take a minute before any check.
MAX_CONFIG_BYTES = 2**20

# libyaml's parser where PyYAML was built with it (many times faster on a large file); the
# constructor, and so the duplicate-key check, is Python's either way.
_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UniqueKeyLoader(_SafeLoader):  # type: ignore[misc, valid-type]
    """A safe YAML loader that rejects a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key; the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class ConfigModel(BaseModel):
    """A config section: frozen, unknown fields rejected by name with a hint (a typo such as
    ``memroy`` gets "did you mean 'memory'?")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            allowed = list(cls.model_fields)
            for key in data:
                if key not in allowed:
                    close = difflib.get_close_matches(str(key), allowed, n=1)
                    hint = (
                        f"did you mean {close[0]!r}?" if close else f"expected one of: {', '.join(allowed)}"
                    )
                    raise ValueError(f"unknown field {key!r} ({hint})")
        return data


def presets_dir(kind: str) -> Path:
    """The folder of presets of one kind: ``tessera/configs/<kind>`` (``configs/`` at the repository
    root links there; a wheel ships them in the package)."""
    return Path(__file__).resolve().parents[1] / "configs" / kind


def list_presets(kind: str) -> list[str]:
    """The preset names of one kind (file stems), sorted."""
    folder = presets_dir(kind)
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_config(
    path_or_preset: str | Path, *, kind: str, what: str
) -> tuple[Path, Literal["file", "preset"]]:
    """A config argument as a file: an existing path, or a preset name of ``kind``.

    ``what`` names the config in messages ("cluster spec", "LLM config").
    """
    path = Path(path_or_preset)
    if path.is_file():
        return path, "file"
    text = str(path_or_preset)
    if path.exists():
        regular_file(path, what=f"{what} YAML")  # names what it is instead: a directory, a FIFO
    if "/" in text or "\\" in text or path.suffix in (".yaml", ".yml"):
        raise InputError(f"{what} file not found", source=path)
    preset = presets_dir(kind) / f"{text}.yaml"
    if preset.is_file():
        return preset, "preset"
    presets = ", ".join(list_presets(kind)) or "none found"
    label = what.split()[0] if what.endswith("spec") else what.removesuffix(" config")
    raise InputError(
        f"unknown {label} preset {text!r}: give a YAML file path or a preset ({presets})", source=text
    )


def read_yaml(path: Path, *, what: str) -> tuple[Any, bytes]:
    """Safe-load a YAML file (duplicate keys rejected); returns the data and the raw bytes."""
    raw = read_user_file(path, what=what, limit=MAX_CONFIG_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"not {_a(what)}: not UTF-8 text", source=path) from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise InputError(f"not valid YAML: {problem}{where}", source=path) from None
    except RecursionError:
        raise InputError(f"not {_a(what)}: nested too deeply", source=path) from None
    except ValueError as err:  # a scalar PyYAML resolves but cannot build: 2024-02-30, 5000 digits
        why = "an integer too long to read" if "integer string conversion" in str(err) else str(err)
        raise InputError(f"not valid YAML: {why[:120]}", source=path) from None
    if (why := too_large(data)) is not None:
        raise InputError(f"not {_a(what)}: {why}", source=path)
    return data, raw


def too_large(data: Any, limit: int = MAX_EXPANDED_VALUES) -> str | None:
    """Why ``data`` (as YAML loads it, aliases shared) is no config: it holds more than ``limit``
    values once its aliases are expanded, or refers to itself. None when it is fine. Linear in the
    distinct values (each container is counted once and its expanded size remembered)."""
    expanded: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(data, False)]
    open_: set[int] = set()
    distinct = 1  # values as written, each alias's target once
    while stack:
        value, done = stack.pop()
        children = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
        if not isinstance(value, dict | list):
            continue
        key = id(value)
        if done:
            open_.discard(key)
            expanded[key] = 1 + sum(expanded.get(id(c), 1) for c in children)
            if distinct > limit:
                return f"it holds more than {limit:,} values"
            if expanded[key] > limit:
                return f"it expands to more than {limit:,} values (aliases nested inside aliases)"
            continue
        if key in expanded:
            continue
        if key in open_:
            return "a value contains itself (a recursive alias)"
        open_.add(key)
        distinct += len(children)
        stack.append((value, True))
        stack.extend((c, False) for c in children if isinstance(c, dict | list))
    return None


def _a(noun: str) -> str:
    return ("an " if noun[0].lower() in "aeiou" or noun.startswith("LLM") else "a ") + noun


def format_loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if part == "[key]":  # the error is in a mapping key, which the previous part names
            path += " (key)"
        elif isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def format_validation_error(err: ValidationError) -> str:
    """The first error as one line, ``path: what was expected (got …)``, plus how many others."""
    # A default computed from other fields is not computed once they fail: not a problem of its own.
    errors = [e for e in err.errors(include_url=False) if e["type"] != "default_factory_not_called"]
    errors = errors or err.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    message = str(first["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind == "missing":
        message = "required field is missing"
    elif kind not in ("value_error", "assertion_error") and "input" in first:
        message += f" (got {short_repr(first['input'])})"
    path = format_loc(tuple(first["loc"]))
    line = f"{path}: {message}" if path else message
    if len(errors) > 1:
        others = len(errors) - 1
        line += f" (and {others} more problem{'s' if others > 1 else ''})"
    return line


_REPR = reprlib.Repr()  # Python 3.11's takes no arguments
_REPR.maxlevel = 2
_REPR.maxtuple = _REPR.maxlist = _REPR.maxarray = _REPR.maxdict = _REPR.maxset = 3
_REPR.maxstring = _REPR.maxother = 50
_REPR.maxlong = 40


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters without building the whole text first (a value
    with nested aliases would take minutes and all memory to print)."""
    shown = _REPR.repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
