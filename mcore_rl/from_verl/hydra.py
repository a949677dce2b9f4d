"""verl's command line after the trainer module: Hydra's `--config-path` / `--config-name` and overrides
`key=value`, `+key=value` (add a key), `++key=value` (add or override), `~key` (delete), values in Hydra's
grammar (null, booleans, numbers, quoted strings, [lists])."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

OVERRIDE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w.\-@/]*)(?:=(.*))?$", re.S)
INT = re.compile(r"[+-]?\d+(_\d+)*")
FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?|[+-]?inf|nan", re.I)


@dataclass
class Override:
    key: str  # dotted key, without the + / ++ prefix
    value: Any  # parsed value
    raw: str  # the text after '='
    form: str  # "", "+", "++" or "~"
    position: int  # index among the overrides (later ones win)

    @property
    def text(self) -> str:
        return f"{self.form}{self.key}" + ("" if self.form == "~" else f"={self.raw}")


@dataclass
class HydraCommand:
    overrides: dict[str, Override]  # by key, the last one given
    config_name: Optional[str] = None
    config_path: Optional[str] = None
    other_args: list[str] = field(default_factory=list)  # words that are neither an override nor a known flag
    repeated: list[str] = field(default_factory=list)  # keys given more than once (the last value is used)


def parse_value(raw: str) -> Any:
    """One override value in Hydra's grammar (the shell has already removed its own quoting)."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.lower()
    if low in ("null", "none", "~") or text == "":
        return None if text != "" else ""
    if low in ("true", "false"):
        return low == "true"
    if INT.fullmatch(text):
        return int(text.replace("_", ""))
    if FLOAT.fullmatch(text):
        return float(text)
    if text.startswith("[") and text.endswith("]"):
        return [parse_value(item) for item in _split_list(text[1:-1])]
    return text


def _split_list(body: str) -> list[str]:
    """Top-level comma split of a list body, respecting quotes and nested brackets."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(body):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    if body.strip():
        items.append(body[start:])
    return items


def parse_command(words: list[str]) -> HydraCommand:
    """The words after `-m verl.trainer.main_ppo` (or the script path)."""
    cmd = HydraCommand(overrides={})
    k = 0
    position = 0
    while k < len(words):
        word = words[k]
        flag = re.fullmatch(r"(--config-name|-cn|--config-path|-cp)(?:=(.*))?", word, re.S)
        if flag:
            value = flag.group(2)
            if value is None and k + 1 < len(words):
                value = words[k + 1]
                k += 1
            if flag.group(1) in ("--config-name", "-cn"):
                cmd.config_name = value
            else:
                cmd.config_path = value
            k += 1
            continue
        m = OVERRIDE.match(word)
        if word.startswith("-") or not m or (m.group(3) is None and m.group(1) != "~"):
            cmd.other_args.append(word)
            k += 1
            continue
        form, key, raw = m.group(1) or "", m.group(2), m.group(3) or ""
        if key in cmd.overrides:
            cmd.repeated.append(key)
        cmd.overrides[key] = Override(key, None if form == "~" else parse_value(raw), raw, form, position)
        position += 1
        k += 1
    return cmd
