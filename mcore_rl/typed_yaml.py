"""Typed values from YAML text: a config file read strictly (UTF-8, one mapping, no key given twice) and one
value checked or converted to a dataclass field's declared type (bool, int, float, str, Literal, Optional, list).

`mcore_rl.config` builds its sections with these; nothing here knows the sections themselves.
"""

from __future__ import annotations

import os
import types
from typing import Any, Literal, Optional, Union, get_args, get_origin


class ConfigError(ValueError):
    """A bad configuration; the message names the key, the problem and the fix."""


def literal_choices(tp: Any) -> Optional[tuple]:
    """The allowed values of a Literal (or Optional[Literal]) field type, None included; None otherwise."""
    base = inner_type(tp)
    if get_origin(base) is not Literal:
        return None
    return ((None,) if is_optional(tp) else ()) + get_args(base)


_NONE_WORDS = ("null", "none", "~", "")


def is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def inner_type(tp: Any) -> Any:
    """Optional[X] -> X."""
    if is_optional(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]
    return tp


def type_name(tp: Any) -> str:
    base = inner_type(tp)
    name = "str" if get_origin(base) is Literal else getattr(base, "__name__", str(base))
    return f"{name} or null" if is_optional(tp) else name


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML or override value to the field's declared type."""
    if value is None:
        if is_optional(tp):
            return None
        raise ConfigError(
            f"{key}: null is not allowed, expected {type_name(tp)}: give it a value or remove the key for its default"
        )
    base = inner_type(tp)
    origin = get_origin(base)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}: write e.g. {key}=[1,2]")
        (item_tp, *_) = get_args(base) or (Any,)
        return origin(coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if base is Any:
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str or get_origin(base) is Literal:  # a Literal's value is checked against its choices later
        if isinstance(value, str):
            return value
    example = {bool: "true", int: "2", float: "0.5", str: "text"}.get(base, "...")
    raise ConfigError(
        f"{key}: expected {type_name(tp)}, got {value!r} ({type(value).__name__}): write e.g. {key}={example}"
    )


def parse_override_value(raw: str, tp: Any) -> Any:
    """Typed parse of the text after '=': the field's type decides how the text is read."""
    if is_optional(tp) and raw.strip().lower() in _NONE_WORDS:
        return None
    if inner_type(tp) is str or get_origin(inner_type(tp)) is Literal:
        return raw  # strings stay verbatim: model.path=123 or trainer.run_dir=runs/1e3
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _unique_key_loader():
    """A YAML SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key '{key}' is given twice (line {key_node.start_mark.line + 1}; remove one)",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_yaml(path: str | os.PathLike) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path} does not exist: pass the path of a YAML file, e.g. configs/tiny/gspo_cpu.yaml"
        )
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): save it "
            f"as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} is unreadable ({e.strerror}): check its permissions") from None
    try:
        data = yaml.load(text, Loader=_unique_key_loader())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (platform, model, actor, algo, ...), got {type(data).__name__}"
        )
    return data
