"""What a resumed run may change against the config its checkpoint was written with.

Each checkpoint carries the resolved config of the run that wrote it (`config.yaml` in the checkpoint
folder, checksummed with it and checked before it is parsed; older ones: the run directory's). Resuming
compares it with the new config, key by key, and
every difference falls into one class (RULES, first matching prefix wins):

  applied, and listed in the log:
    optimizer     actor.optim.lr, min_lr, weight_decay, betas, eps, clip_grad, ...: the new values replace
                  the checkpoint's; Adam's moments and the step count are kept (megatron/checkpoint.py)
    schedule      warmup_steps, decay_style, decay_steps, trainer.steps: the schedule continues from the
                  saved step count in its new shape
    batch         prompts per step, samples per prompt, mini-batches, micro-batches: the sampler's
                  position counts prompts, so it continues where it was
    loss options  algo.*: no state depends on them (the KL reference is the initial model either way)
    layout        actor.parallel.*: a checkpoint loads into any TP / PP / EP layout of the same world size
    other         rollout, reward, validation, checkpointing, logging
  refused before any process starts (the error names the key, both values and the fix):
    world size    trainer.nproc x trainer.nnodes: every rank's sampler and random state are saved per rank
    data          train_path, prompt_key, max_prompt_len, shuffle, data.seed: the saved sampler position
                  indexes this dataset in this order
    seed          trainer.seed: the run continues the checkpoint's random streams; another seed is another run
    model         model.path, model.dtype: the checkpoint holds this model's weights in this dtype

docs/reliability.md has the table; tests/test_resume_changes.py and tests/test_trainer_e2e.py show it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mcore_rl.config import ConfigError, config_to_dict

CONFIG_FILE = "config.yaml"  # in a checkpoint folder (and in RUN_DIR, for the newest start)


@dataclass(frozen=True)
class Rule:
    prefix: str  # a dotted key, or a section ending in "."
    name: str
    applied: bool
    why: str = ""  # for a refused class: why it cannot change


RULES: tuple[Rule, ...] = (
    Rule("checkpoint.resume", "resume", True),  # how to resume is not a setting of the run
    Rule("trainer.run_dir", "run directory", True),
    Rule("trainer.nproc", "world size", False, "every rank's data-sampler and random state are saved per rank"),
    Rule("trainer.nnodes", "world size", False, "every rank's data-sampler and random state are saved per rank"),
    *(
        Rule(f"data.{key}", "data", False, "the saved sampler position indexes this dataset in this order")
        for key in ("train_path", "prompt_key", "max_prompt_len", "shuffle", "seed")
    ),
    Rule(
        "trainer.seed", "seed", False, "the run continues the checkpoint's random streams; another seed is another run"
    ),
    Rule("model.path", "model", False, "the checkpoint holds this model's weights"),
    Rule("model.dtype", "model", False, "the checkpoint holds this model's weights in this dtype"),
    *(Rule(f"actor.optim.{key}", "schedule", True) for key in ("warmup_steps", "decay_style", "decay_steps")),
    Rule("trainer.steps", "schedule", True),
    Rule("actor.optim.", "optimizer", True),
    *(
        Rule(key, "batch", True)
        for key in (
            "data.prompts_per_step",
            "rollout.n",
            "algo.mini_batches",
            "actor.parallel.micro_batch_size",
            "actor.max_tokens_per_micro_batch",
            "actor.max_tokens_per_forward_micro_batch",
        )
    ),
    Rule("algo.", "loss options", True),
    Rule("actor.parallel.", "layout", True),
    Rule("", "other", True),
)

_PATH_KEYS = ("data.train_path", "model.path")  # the same file under another spelling is no change


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    new: Any
    rule: Rule

    def __str__(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.new!r}"


def rule_for(key: str) -> Rule:
    return next(
        r for r in RULES if key == r.prefix or (r.prefix.endswith(".") or not r.prefix) and key.startswith(r.prefix)
    )


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(key: str, saved: Any, new: Any) -> bool:
    if saved == new:
        return True
    if key in _PATH_KEYS and isinstance(saved, str) and isinstance(new, str) and saved and new:
        return os.path.realpath(saved) == os.path.realpath(new)
    return False


def saved_config_path(ckpt_path: Path) -> Optional[Path]:
    """The config a checkpoint was written with: its own copy, else its run directory's (older checkpoints)."""
    for path in (ckpt_path / CONFIG_FILE, ckpt_path.parent.parent / CONFIG_FILE):
        if path.is_file():
            return path
    return None


def changes(saved: dict, new: dict) -> list[Change]:
    """Every key whose value differs (keys only one side has count too: a config of another version)."""
    a, b = _flat(saved), _flat(new)
    return [
        Change(key, a.get(key), b.get(key), rule_for(key))
        for key in sorted(set(a) | set(b))
        if not _same(key, a.get(key), b.get(key))
    ]


def _check_world(cfg, ckpt_path: Path) -> None:
    """The checkpoint's own record of its world size (COMPLETE marker), for those without a saved config."""
    import json

    world = cfg.trainer.nproc * cfg.trainer.nnodes
    try:
        saved_world = json.loads((Path(ckpt_path) / "COMPLETE").read_text()).get("world_size")
    except (OSError, ValueError, AttributeError):
        saved_world = None
    if saved_world is not None and saved_world != world:
        raise ConfigError(
            f"resuming from {ckpt_path}, written by {saved_world} processes, with {world} cannot work: every "
            f"rank's data-sampler and random state are saved per rank. Set trainer.nproc x trainer.nnodes = "
            f"{saved_world}, or start a new run in another trainer.run_dir (checkpoint.resume=never)"
        )


def check_resume_changes(cfg, ckpt_path: Path) -> list[Change]:
    """The applied changes of resuming `cfg` from the checkpoint at ckpt_path; ConfigError for a refused
    one (or an unreadable saved config). No saved config at all (written by hand): nothing to compare."""
    import yaml

    from mcore_rl.run_dir.checksums import file_problem

    path = saved_config_path(Path(ckpt_path))
    if path is None:
        _check_world(cfg, Path(ckpt_path))
        return []
    own = path == Path(ckpt_path) / CONFIG_FILE  # checksummed with the checkpoint; the run directory's is not
    damaged = file_problem(Path(ckpt_path), CONFIG_FILE) if own else None  # before it is parsed: no YAML error
    if damaged:
        raise ConfigError(
            f"checkpoint {ckpt_path} is damaged: {damaged}; resume from another checkpoint (checkpoint.resume=auto "
            f"takes the newest that verifies)"
        )
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        why = " ".join(str(e).split())  # YAML's own message spans several lines
        raise ConfigError(f"{path} (the config checkpoint {ckpt_path} was written with) is unreadable: {why}") from None
    found = changes(saved if isinstance(saved, dict) else {}, config_to_dict(cfg))
    refused = [c for c in found if not c.rule.applied and c.saved is not None]
    if refused:
        first = refused[0]
        raise ConfigError(
            f"resuming from {ckpt_path} with {'; '.join(f'{c.rule.name}: {c}' for c in refused)} cannot work: "
            f"{first.rule.why}. Set {', '.join(f'{c.key}={c.saved}' for c in refused)} as saved in {path}, or "
            f"start a new run in another trainer.run_dir (checkpoint.resume=never)"
        )
    _check_world(cfg, Path(ckpt_path))
    return [c for c in found if c.rule.name not in ("resume", "run directory")]


def describe(found: list[Change]) -> str:
    """One line: the applied changes by class."""
    by_class: dict[str, list[str]] = {}
    for change in found:
        by_class.setdefault(change.rule.name, []).append(str(change))
    return "; ".join(f"{name}: {', '.join(items)}" for name, items in by_class.items())
