"""verl's overrides -> this project's config: every rule over a script's overrides, and a row for every key.

The rules live by topic (`actor_rules`, `algo_rules`, `run_rules`); the table of known keys and verl's defaults
in `keys`. A setting the script leaves at verl's default gets verl's default, not this project's: the preset
states what the verl run ran.
"""

from __future__ import annotations

from typing import Callable

from mcore_rl.from_verl import actor_rules, algo_rules, run_rules
from mcore_rl.from_verl.hydra import HydraCommand
from mcore_rl.from_verl.keys import known_entry
from mcore_rl.from_verl.verl_run import Conversion, Row, VerlRun

RULES: tuple[Callable[[VerlRun], None], ...] = (
    actor_rules.cluster,
    run_rules.trainer,
    actor_rules.layout,
    actor_rules.offload,
    actor_rules.model,
    actor_rules.batch,
    algo_rules.loss,
    algo_rules.optim,
    run_rules.rollout,
    run_rules.data,
    run_rules.reward,
    run_rules.dynamic_sampling,  # after reward: the filter metric's meaning depends on the overlong buffer
)


def convert(command: HydraCommand) -> Conversion:
    """All rules over the script's overrides; every key the script sets gets a row."""
    out = Conversion()
    run = VerlRun(command, out)
    for rule in RULES:
        rule(run)
    for key, o in command.overrides.items():
        if key in out.rows:
            continue
        entry = known_entry(key)
        if o.form == "~":
            out.rows[key] = Row(o.text, "", "not supported", "", "deleting a key: verl's default stays")
        elif entry is None:
            out.rows[key] = Row(o.form + key, o.raw, "unknown", "", "not a key this converter knows: not carried over")
        elif entry.status is not None:
            out.rows[key] = Row(o.form + key, o.raw, entry.status, entry.target, entry.rule)
        else:  # a key the rules read only in some cases (e.g. SAPO's taus with GSPO) and did not here
            out.rows[key] = Row(o.form + key, o.raw, "no effect in verl", entry.target, entry.rule)
    for word in command.other_args:
        out.rows[word] = Row(word, "", "unknown", "", "not a Hydra override (key=value): not carried over")
    for key in command.repeated:
        out.notes.append(f"{key} is given more than once: the last value is used")
    return out
