"""A verl script's overrides over verl's defaults, as the rules read them, and what the conversion collects."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from mcore_rl.from_verl.hydra import HydraCommand, parse_value
from mcore_rl.from_verl.keys import A, M, Status, known_entry, load_schema

Strategy = Literal["megatron", "fsdp"]


class ConversionError(ValueError):
    """A value the rules cannot read (a word where a number belongs); the message names the override."""


@dataclass
class Setting:
    value: Any
    source: str  # the verl override (or default, or rule) it came from


@dataclass
class Row:
    key: str  # as written in the script (+ / ++ kept)
    value: str
    status: Status
    target: str
    why: str


@dataclass
class Conversion:
    settings: dict[str, Setting] = field(default_factory=dict)  # dotted project key -> value and source
    rows: dict[str, Row] = field(default_factory=dict)  # by verl key
    notes: list[str] = field(default_factory=list)
    strategy: Strategy = "megatron"

    @property
    def world(self) -> int:
        return int(self.settings["trainer.nnodes"].value) * int(self.settings["trainer.nproc"].value)


class VerlRun:
    """A script's overrides over verl's defaults, for one actor strategy."""

    def __init__(self, command: HydraCommand, out: Conversion):
        self.command = command
        self.out = out
        self.overrides = command.overrides
        self.strategy: Strategy = self._strategy()
        out.strategy = self.strategy

    def _strategy(self) -> Strategy:
        given = self.overrides.get(A + "strategy")
        if given is not None:
            return "megatron" if str(given.value) == "megatron" else "fsdp"
        name = (self.command.config_name or "").removesuffix(".yaml")
        if name:
            return "megatron" if "megatron" in name else "fsdp"
        if any(k.startswith(M) for k in self.overrides):
            self.out.notes.append(
                "no --config-name: the Megatron actor's keys are set, so the Megatron actor is assumed"
            )
            return "megatron"
        return "fsdp"

    def _check_known(self, key: str) -> None:
        if known_entry(key) is None:
            raise KeyError(f"from_verl: {key} is read but not in known_keys.yaml (add a row with its rule)")

    def given(self, key: str) -> bool:
        self._check_known(key)
        o = self.overrides.get(key)
        return o is not None and o.form != "~"

    def default(self, key: str) -> Any:
        """verl's default for this actor strategy; `${oc.select:OTHER,FALLBACK}` follows OTHER."""
        self._check_known(key)
        entry = load_schema()["keys"].get(key)
        if entry is None:
            return None  # a '+' addition: absent unless the script adds it
        value = entry.get(self.strategy, entry.get("fsdp" if self.strategy == "megatron" else "megatron"))
        m = re.fullmatch(r"\$\{oc\.select:([\w.]+),(.*)\}", value) if isinstance(value, str) else None
        if m:
            other = m.group(1)
            if known_entry(other) is not None and (self.given(other) or other in load_schema()["keys"]):
                return self.get(other)
            return parse_value(m.group(2))
        return value

    def get(self, key: str) -> Any:
        """The script's value (a Hydra interpolation `${other.key}` of a known key followed), else verl's default."""
        if not self.given(key):
            return self.default(key)
        value = self.overrides[key].value
        m = re.fullmatch(r"\$\{([\w.]+)\}", value) if isinstance(value, str) else None
        if m and m.group(1) != key and known_entry(m.group(1)) is not None:
            return self.get(m.group(1))
        return value

    def as_int(self, key: str, fallback: Optional[int] = None) -> int:
        return self._number(key, int, fallback)

    def as_float(self, key: str, fallback: Optional[float] = None) -> float:
        return self._number(key, float, fallback)

    def _number(self, key: str, kind: type, fallback: Any) -> Any:
        value = self.get(key)
        if value is None or value == "":
            if fallback is not None:
                return fallback
            raise ConversionError(f"{self.source(key)}: this key needs a number; give it one in the script")
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            what = "an integer" if kind is int else "a number"
            raise ConversionError(f"{self.source(key)}: expected {what}, got {value!r}; fix it in the script") from None

    def source(self, key: str) -> str:
        if self.given(key):
            return self.overrides[key].text
        return f"{key} not set: verl's default {show(self.default(key))}"

    def mark(self, key: str, status: Status, target: str = "", why: str = "") -> None:
        """Record what became of a key the script sets (no row for keys it leaves at verl's default)."""
        if not self.given(key):
            return
        o = self.overrides[key]
        entry = known_entry(key)
        self.out.rows[key] = Row(o.form + key, o.raw, status, target or (entry.target if entry else ""), why)

    def set(self, target: str, value: Any, *keys: str, source: Optional[str] = None) -> None:
        """Set a project key from verl keys (marked mapped), with the source comment."""
        text = source or "; ".join(self.source(k) for k in keys)
        self.out.settings[target] = Setting(value, text)
        for key in keys:
            if key not in self.out.rows:
                self.mark(key, "mapped", target)


def show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def int_or_note(value: Any, key: str, notes: list[str]) -> Optional[int]:
    try:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(value)
    except (TypeError, ValueError):
        notes.append(f"{key} = {value!r} is not an integer: left out")
        return None
