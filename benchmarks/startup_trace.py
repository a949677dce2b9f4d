"""Where `mcore-rl train` spends its start-up and its run's end: every process's CPU seconds and a timeline of
the phases from launch to the end (imports, the input check, torchrun, Megatron, the model, the engine, each
step's first calls, checkpoints, validations, the plots), per process, with wall and CPU seconds.

    python benchmarks/startup_trace.py [--repo DIR] [--out DIR] [--preset PRESET] [key=value ...]

    python benchmarks/startup_trace.py trainer.steps=3                      # this tree
    python benchmarks/startup_trace.py --repo /path/to/other/tree trainer.steps=3   # a before / after pair

Runs `mcore-rl train PRESET` (default configs/tiny/gspo_cpu.yaml; the model and task files of this tree's
artifacts/ unless overridden) from `--repo` with a hook in every Python process it starts (a sitecustomize
module on PYTHONPATH, so the launcher, torchrun's agent, the ranks and the reward workers all load it): the
hook times the first import of a few large modules and the calls of a fixed list of functions (a name that a
tree does not have is skipped), appending one JSON line per event to OUT/events.jsonl. Meanwhile this script
samples every descendant's CPU time (psutil, every 20 ms). Printed: each process with its start after the
launch, its end and its CPU seconds; then the events in time order (the first three calls of a per-step
function per process), and the metrics rows' step times. On a shared machine compare the CPU seconds; the wall
times move with the load (printed before and after).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVENTS_ENV = "MCORE_RL_STARTUP_TRACE"

# module -> [(class name or "", function name)]: the calls timed once the module is imported
TRACED = {
    "mcore_rl.cli": [("", n) for n in ("main", "check_inputs", "check_run_inputs", "check_run_dir", "run_supervised")],
    "mcore_rl.torchrun": [("", "main")],
    "mcore_rl.trainer": [("", "run")]
    + [
        ("Trainer", n)
        for n in ("__init__", "_load_inputs", "_build_actors", "train_step", "validate", "save", "export_hf", "_plot")
    ],
    "mcore_rl.colocation": [("Colocation", "start")],
    "mcore_rl.platform": [("Platform", "init_distributed"), ("Platform", "adapt_megatron")],
    "mcore_rl.megatron.actor": [("Actor", "__init__")],
    "mcore_rl.rewards.registry": [("RewardWorker", "_start"), ("RewardScorer", "__call__")],
}
IMPORTS = {"torch", "transformers", "megatron.core", "mbridge", "matplotlib.pyplot", "mcore_rl.trainer"}
PER_STEP = {"Trainer.train_step", "RewardScorer.__call__"}

HOOK = """
import functools, importlib.abc, importlib.util, json, os, sys, time
_FILE, _TRACED, _IMPORTS = os.environ[{env!r}], {traced!r}, {imports!r}

def _emit(name, kind):
    line = json.dumps({{"pid": os.getpid(), "rank": os.environ.get("RANK"), "name": name, "kind": kind,
                       "t": time.time(), "cpu": time.process_time()}})
    with open(_FILE, "a") as f:
        f.write(line + "\\n")

def _wrap(owner, attr, label):
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        return
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    fn = raw.__func__ if kind else raw
    @functools.wraps(fn)
    def traced(*a, **k):
        _emit(label, "B")
        try:
            return fn(*a, **k)
        finally:
            _emit(label, "E")
    setattr(owner, attr, kind(traced) if kind else traced)

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TRACED and name not in _IMPORTS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module
        def exec_module(module):
            if name in _IMPORTS:
                _emit("import " + name, "B")
            original(module)
            if name in _IMPORTS:
                _emit("import " + name, "E")
            for owner, attr in _TRACED.get(name, []):
                target = getattr(module, owner, None) if owner else module
                if target is not None:
                    _wrap(target, attr, (owner + "." if owner else name.split(".")[-1] + ".") + attr)
        spec.loader.exec_module = exec_module
        return spec

_emit("interpreter", "X")
sys.meta_path.insert(0, _Finder())
"""


def _sample(root_pid: int, procs: dict) -> None:
    import psutil

    try:
        root = psutil.Process(root_pid)
        family = [root] + root.children(recursive=True)
    except psutil.Error:
        return
    for proc in family:
        try:
            with proc.oneshot():
                cpu = proc.cpu_times()
                info = procs.setdefault(proc.pid, {"start": proc.create_time(), "cmd": " ".join(proc.cmdline())})
                info["cpu"], info["seen"] = cpu.user + cpu.system, time.time()
        except psutil.Error:
            pass


def _spans(events: list[dict]) -> list[tuple]:
    """(begin, end, cpu at begin, cpu at end, pid, rank, name) of each call / import, in time order."""
    open_calls, spans = collections.defaultdict(list), []
    for e in events:
        key = (e["pid"], e["name"])
        if e["kind"] == "B":
            open_calls[key].append(e)
        elif e["kind"] == "E" and open_calls[key]:
            b = open_calls[key].pop()
            spans.append((b["t"], e["t"], b["cpu"], e["cpu"], e["pid"], e["rank"], e["name"]))
        elif e["kind"] == "X":
            spans.append((e["t"], e["t"], e["cpu"], e["cpu"], e["pid"], e["rank"], e["name"]))
    return sorted(spans)


def report(out: Path, launched: float, procs: dict) -> None:
    print("processes: start .. last seen after launch, CPU seconds, command")
    for pid, p in sorted(procs.items(), key=lambda kv: kv[1]["start"]):
        print(
            f"  {pid:>7} {p['start'] - launched:+7.2f} .. {p['seen'] - launched:+7.2f}  {p['cpu']:6.2f}  {p['cmd'][:90]}"
        )
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    print("events: rank pid  begin .. end after launch (wall s, CPU s)  name")
    calls = collections.Counter()
    for b, e, cb, ce, pid, rank, name in _spans(events):
        calls[(pid, name)] += 1
        if name in PER_STEP and calls[(pid, name)] > 3:
            continue
        print(
            f"  r{rank or '-'} {pid:>7} {b - launched:+7.2f} .. {e - launched:+7.2f} ({e - b:5.2f}, {ce - cb:5.2f})  {name}"
        )
    metrics = out / "run" / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        print("metrics rows: step, seconds after launch, seconds since the previous row")
        for prev, row in zip([None] + rows, rows):
            since = row["time"] - (prev["time"] if prev else launched)
            print(f"  {row['step']:>4} {row['time'] - launched:7.2f} {since:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(REPO), help="source tree whose mcore_rl runs (default: this one)")
    parser.add_argument("--out", default=None, help="folder for events.jsonl and the run (default: a temp folder)")
    parser.add_argument("--preset", default="configs/tiny/gspo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the run")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="startup_trace_")).resolve()
    shutil.rmtree(out / "run", ignore_errors=True)
    (out / "hook").mkdir(parents=True, exist_ok=True)
    (out / "events.jsonl").write_text("")
    hook = HOOK.format(env=EVENTS_ENV, traced=TRACED, imports=IMPORTS)
    (out / "hook" / "sitecustomize.py").write_text(hook)
    artifacts = REPO / "artifacts"
    defaults = [
        f"model.path={artifacts / 'tiny-qwen3-moe'}",
        f"data.train_path={artifacts / 'task' / 'train.parquet'}",
        f"data.val_path={artifacts / 'task' / 'val.parquet'}",
    ]
    # the console script imports mcore_rl.cli (traced); `python -m mcore_rl.cli` would run it as __main__ (not)
    script = Path(sys.executable).parent / "mcore-rl"
    launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "mcore_rl.cli"]
    cmd = [*launcher, "train", args.preset, *defaults, f"trainer.run_dir={out / 'run'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{args.repo}{os.pathsep}{out / 'hook'}")
    env[EVENTS_ENV] = str(out / "events.jsonl")
    load = os.getloadavg()[0]
    launched = time.time()
    with open(out / "output.txt", "w") as log:
        proc = subprocess.Popen([*cmd, *args.overrides], cwd=args.repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs: dict = {}
        while proc.poll() is None:
            _sample(proc.pid, procs)
            time.sleep(0.02)
    print(
        f"mcore-rl train {args.preset} {' '.join(args.overrides)} in {args.repo}: exit {proc.returncode}, "
        f"{time.time() - launched:.2f} s, load {load:.1f} -> {os.getloadavg()[0]:.1f}; output: {out / 'output.txt'}"
    )
    report(out, launched, procs)


if __name__ == "__main__":
    main()
