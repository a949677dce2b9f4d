"""verl's keys: the table every key of a script lands in, verl's defaults, and the docs' table.

Every verl key the converter knows is a row of `known_keys.yaml`, by topic (mapped by the rules, or not
needed / not supported here with the reason), read once into `KNOWN`; its verl default is read from
`verl_schema.yaml` (the keys the rules rely on, as verl's generated trainer configs list them). What verl
ignores (GSPO / SAPO's `loss_agg_mode`, GSPO's `clip_ratio_c`, ...) is listed as "no effect in verl" and the
preset gets what ran.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml

Status = Literal["mapped", "not needed", "not supported", "no effect in verl", "unknown"]
STATUSES: tuple[Status, ...] = ("mapped", "not needed", "not supported", "no effect in verl", "unknown")

SCHEMA_PATH = Path(__file__).with_name("verl_schema.yaml")
TABLE_PATH = Path(__file__).with_name("known_keys.yaml")

A = "actor_rollout_ref.actor."
M = A + "megatron."
F = A + "fsdp_config."
OT = M + "override_transformer_config."
R = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."
OB = "reward_model.reward_kwargs.overlong_buffer_cfg."
OB_RECIPE = "reward_model.overlong_buffer."  # the same buffer where the DAPO recipe's config declares it
FG = "algorithm.filter_groups."  # DAPO's group filtering (the DAPO recipe's trainer reads it)
# The short forms the table and the docs write the prefixes in, longest prefix first.
SHORT = {OT: "OT.", OB: "OB.", MODEL: "MODEL.", F: "F.", M: "M.", R: "R.", A: "A."}


@dataclass(frozen=True)
class Known:
    """A verl key (or every key under a prefix ending in '.*') and what becomes of it here."""

    key: str
    target: str  # this project's key(s) it sets; "" if none
    rule: str  # how it maps, or why it is not needed / not supported
    status: Optional[Status] = None  # fixed status; None: decided by the rules from the run's values
    plus: str = ""  # a key a script adds with '+' (not in verl's trainer configs): where verl reads it


def short_key(key: str) -> str:
    for prefix, short in SHORT.items():
        if key.startswith(prefix):
            return short + key[len(prefix) :]
    return key


def _full_key(key: str) -> str:
    for prefix, short in SHORT.items():
        if key.startswith(short):
            return prefix + key[len(short) :]
    return key


def _read_table(path: Path) -> tuple[Known, ...]:
    rows = []
    for topic, entries in yaml.safe_load(path.read_text()).items():
        if topic == "reasons":  # the anchors of shared reasons, not keys
            continue
        for entry in entries:
            status = entry.get("status")
            if status not in (None, "not needed", "not supported"):
                raise ValueError(f"{path}: {entry['key']}: status {status!r} (not needed / not supported / none)")
            rows.append(
                Known(_full_key(entry["key"]), entry.get("here", ""), entry["rule"], status, entry.get("plus", ""))
            )
    return tuple(rows)


KNOWN: tuple[Known, ...] = _read_table(TABLE_PATH)
ADDITIONS: dict[str, str] = {k.key: k.plus for k in KNOWN if k.plus}  # '+' keys -> where verl reads them


def known_entry(key: str) -> Optional[Known]:
    """The entry for a key: exact, else the longest matching 'prefix.*'."""
    exact = {k.key: k for k in KNOWN}
    if key in exact:
        return exact[key]
    best = None
    for entry in KNOWN:
        if entry.key.endswith(".*") and key.startswith(entry.key[:-1]):
            if best is None or len(entry.key) > len(best.key):
                best = entry
    return best


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


def doc_table() -> str:
    """The mapping table of docs/from-verl.md, from `KNOWN` (tests/test_from_verl.py keeps the doc equal to it)."""
    lines = ["| verl key | here | rule |", "|---|---|---|"]
    for entry in KNOWN:
        here = entry.target or "-"
        rule = entry.rule if entry.status is None else f"{entry.status}: {entry.rule}"
        lines.append(f"| `{short_key(entry.key)}` | {here} | {rule.replace('|', '/')} |")
    return "\n".join(lines)
