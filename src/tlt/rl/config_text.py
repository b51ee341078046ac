"""The config's text: YAML files and `section.key=value` overrides read into checked field values, and the YAML
`tlt train --print-config` writes. Knows nothing of the sections themselves (rl/config.py)."""

from __future__ import annotations

import contextlib
import difflib
import types
import typing

import yaml

from tlt.errors import TltError


class ConfigError(TltError):
    """A config file or override that cannot be applied."""


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML keeps the last silently, so a
    second `run:` section would drop every key of the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` (its keys may be overridden: that is what it is for)
            key = self.construct_object(key_node, deep=deep)
            with contextlib.suppress(TypeError):  # an unhashable key fails in the constructor, as in safe_load
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one mapping (YAML would keep only the last)",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, 1-based)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


class FlowListDumper(yaml.SafeDumper):
    """Sections as blocks, lists inline (`betas: [0.9, 0.99]`)."""


FlowListDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True))


def parse_text(raw: str, annotation):
    optional = type(None) in typing.get_args(annotation)
    if optional and raw.lower() in ("", "null", "none", "~"):
        return None
    if annotation is str or (optional and str in typing.get_args(annotation)) or (
            is_name_list(annotation) and not raw.lstrip().startswith("[")):
        return raw  # a name list's comma string is split by coerce
    return yaml.safe_load(raw)  # a float field's 1e-3 (a string to YAML 1.1) is converted by coerce


def is_name_list(annotation) -> bool:
    """tuple[str, ...]: a list of names (YAML list or "a,b" string)."""
    return typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (str, ...)


def check_key(name: str, valid: list[str], what: str, prefix: str = "") -> str:
    if name in valid:
        return name
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(prefix + n for n in near)}?" if near else ""
    raise ConfigError(f"unknown config {what} {prefix + name!r}{hint} (valid: {', '.join(prefix + v for v in valid)})")


def coerce(key: str, value, annotation):
    """Check a value against a field's annotation (int, float, bool, str, optional, tuple of floats)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    elif origin in (typing.Union, types.UnionType):  # e.g. int | str: first fit
        for option in args:
            try:
                return coerce(key, value, option)
            except ConfigError:
                pass
        got = "an empty value" if value is None else repr(value)
        raise ConfigError(f"{key} expects {' or '.join(a.__name__ for a in args)}, got {got}")
    if is_name_list(annotation):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
            raise ConfigError(f"{key} expects a list of names or a comma string, got {value!r}")
        return tuple(item.strip() for item in items if item.strip())
    if origin is tuple:
        if isinstance(value, str) and "," in value:  # `optim.betas=0.9,0.99`, as `run.logger=jsonl,wandb`
            value = [item.strip() for item in value.strip("[]() ").split(",")]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} numbers (e.g. {key}=0.9,0.99), got {value!r}")
        return tuple(coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
    elif annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects a string, but YAML read {value!r} (from off/no/yes/on...): "
                              f"quote it, e.g. \"off\"")
    got = "an empty value" if value is None else repr(value)  # `key=` on the command line, `key:` in YAML
    raise ConfigError(f"{key} expects {getattr(annotation, '__name__', annotation)}, got {got}")
