"""`mcore-rl from-verl SCRIPT_OR_COMMAND [--out PRESET.yaml] [--strict]`: a verl launch -> a checked preset.

Reads the launch without running it (`shell`), takes Hydra's overrides (`hydra`), maps them with the rules
(`mapping`, by topic in `*_rules`) and the table of known keys (`keys`), writes the preset with a comment per setting naming the verl
override (or default) it came from, runs `mcore-rl check` on it at the script's cluster size, and prints
what became of every key: mapped / not needed here / not supported / no effect in verl / unknown.
Pure Python: no torch, no process started. The rules are in docs/from-verl.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, get_type_hints

from mcore_rl.config import Config, ConfigError, load_config
from mcore_rl.from_verl.hydra import parse_command
from mcore_rl.from_verl.keys import STATUSES
from mcore_rl.from_verl.mapping import convert
from mcore_rl.from_verl.shell import ShellError, read_script
from mcore_rl.from_verl.verl_run import Conversion, ConversionError
from mcore_rl.preflight.check import describe_run, model_dims
from mcore_rl.preflight.layout import LayoutError
from mcore_rl.preflight.run import validate_run

__all__ = [
    "ShellError",
    "ConversionError",
    "Converted",
    "convert_launch",
    "preset_text",
    "check_preset",
    "report",
    "run",
]


@dataclass
class Converted:
    conversion: Conversion
    source: str  # the script's path, or "command line"
    line: int  # the trainer command's line in the script
    shell_notes: list[str]
    unset: list[str] = field(default_factory=list)  # variables the trainer command read unset (expanded to "")


def convert_launch(source: str, positional: Sequence[str] = ()) -> Converted:
    """A script file (or the command line itself, when `source` is no file) -> the conversion."""
    path = Path(source)
    one_word = "\n" not in source and " " not in source.strip()
    if one_word and len(source) < 4096 and (path.is_file() or path.is_dir()):
        text, name = _script_text(path), str(path)
    elif one_word:
        raise ShellError(f"{source} does not exist: give the launch script's path, or the command line in quotes")
    else:
        text, name = source, "command line"
    shell = read_script(text, tuple(positional), script_name=name)
    command = parse_command(_after_trainer(shell.argv))
    return Converted(convert(command), name, shell.line, shell.notes + shell.unset_notes(), shell.unset)


def _script_text(path: Path) -> str:
    """The launch script's text; a folder or a file that is not text is refused by name."""
    if path.is_dir():
        raise ShellError(f"this is a directory: give the launch script inside it (e.g. {path}/run.sh)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShellError(
            f"not a text file (byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8): give the "
            f"launch script (a shell script), or the command line in quotes"
        ) from None
    if "\0" in text:
        raise ShellError(
            f"not a text file (a NUL byte at offset {text.index(chr(0))}): give the launch script "
            f"(a shell script), or the command line in quotes"
        )
    return text


def _after_trainer(argv: list[str]) -> list[str]:
    for k, word in enumerate(argv):
        if word == "-m" and k + 1 < len(argv):
            return argv[k + 2 :]
        if word.endswith(".py") and "main_" in word:
            return argv[k + 1 :]
    return argv


# ------------------------------------------------------------------------------------------------ the preset


def _yaml_scalar(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _section_order(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the Config dataclasses, in declaration order."""
    out: list[str] = []
    hints = get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        out += _section_order(tp, f"{prefix}{f.name}.") if is_dataclass(tp) else [f"{prefix}{f.name}"]
    return out


def preset_text(conv: Converted, out_name: str) -> str:
    """The preset YAML: nested sections, one comment per setting naming where it came from."""
    c = conv.conversion
    settings = c.settings
    order = [k for k in _section_order(Config) if k in settings]
    nnodes, nproc = settings["trainer.nnodes"].value, settings["trainer.nproc"].value
    lines = [
        f"{HEADER}{conv.source} (trainer command at line {conv.line}),",
        f"# {c.strategy} actor; verl key names and defaults of verl 0.8.0.dev (mcore_rl/from_verl/verl_schema.yaml).",
        f"# The script's cluster: {nnodes} node(s) x {nproc} devices = {c.world}.",
        f"#   mcore-rl check {out_name} --nnodes {nnodes} --nproc-per-node {nproc}",
    ]
    open_sections: list[str] = []
    for key in order:
        *sections, name = key.split(".")
        common = 0
        while common < min(len(open_sections), len(sections)) and open_sections[common] == sections[common]:
            common += 1
        for depth in range(common, len(sections)):
            lines.append("  " * depth + f"{sections[depth]}:")
        open_sections = sections
        setting = settings[key]
        lines.append("  " * len(sections) + f"{name}: {_yaml_scalar(setting.value)}  # {setting.source}")
    return "\n".join(lines) + "\n"


def check_preset(path: str | os.PathLike, world: int, model_config: Optional[str] = None) -> tuple[bool, str]:
    """`mcore-rl check` in this process: (passed, the check's report or its error with the fix)."""
    try:
        cfg = load_config(path)
        if model_config is None and not (Path(cfg.model.path) / "config.json").is_file():
            return True, (
                f"config OK; layout not checked: model.path = {cfg.model.path} has no config.json here - "
                f"pass --model-config CONFIG_JSON to check the layout at world {world}"
            )
        layout = validate_run(cfg, world, model_dims(cfg, model_config))
    except (ConfigError, LayoutError) as e:
        return False, str(e)
    return True, describe_run(cfg, layout, cfg.trainer.nnodes, cfg.trainer.nproc)


def report(conv: Converted) -> str:
    """The table of every key the script sets, by what became of it, then the notes. Unknown keys are part of
    "not supported" (they are not carried over), marked as unknown."""
    c = conv.conversion
    groups: dict[str, list] = {status: [] for status in STATUSES if status != "unknown"}
    for row in c.rows.values():
        groups["not supported" if row.status == "unknown" else row.status].append(row)
    lines = []
    for status, rows in groups.items():
        if not rows:
            continue
        unknown = sum(r.status == "unknown" for r in rows)
        lines.append(f"{status} ({len(rows)}" + (f", {unknown} of them unknown keys" if unknown else "") + "):")
        for r in sorted(rows, key=lambda r: (r.status == "unknown", r.key.lstrip("+~"))):
            shown = f"{r.key}={r.value}" if r.value != "" else r.key
            target = f" -> {r.target}" if r.target else ""
            mark = "unknown key - " if r.status == "unknown" else ""
            lines.append(f"  {shown}{target}: {mark}{r.why}" if r.why or mark else f"  {shown}{target}")
    notes = conv.shell_notes + c.notes
    if notes:
        lines.append(f"notes ({len(notes)}):")
        lines += [f"  {n}" for n in notes]
    return "\n".join(lines)


def run(args) -> int:
    """The `mcore-rl from-verl` command (argparse namespace: source, overrides, out, strict, model_config)."""
    conv = convert_launch(args.source, args.overrides)
    out = args.out or _default_out(conv)
    _write_preset(Path(out), preset_text(conv, out))
    print(f"preset written: {out}")
    print(report(conv))
    passed, message = check_preset(out, conv.conversion.world, args.model_config)
    c = conv.conversion
    where = f"world {c.world} ({c.settings['trainer.nnodes'].value} x {c.settings['trainer.nproc'].value})"
    if passed:
        print(f"check at {where}: OK\n{message}")
    else:
        print(f"check at {where}: FAILED - the preset is written as converted; fix it before training:\n  {message}")
    incomplete = any(r.status in ("not supported", "unknown") for r in c.rows.values()) or bool(conv.unset)
    return 1 if args.strict and (incomplete or not passed) else 0


HEADER = "# Converted by `mcore-rl from-verl` from "


def _write_preset(path: Path, text: str) -> None:
    """Atomically; a file that from-verl did not write is never replaced (it may be someone's preset)."""
    if path.exists() and (path.is_dir() or not path.read_text(errors="replace").startswith(HEADER)):
        raise ConversionError(
            f"--out {path} exists and was not written by mcore-rl from-verl: give another --out, or move that file"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _default_out(conv: Converted) -> str:
    stem = Path(conv.source).stem if conv.source != "command line" else "verl_command"
    return f"{stem}.yaml"
