"""The separate placement (rollout.placement=separate): rollout ranks generate while the actor ranks train.

The job's ranks split into actor ranks (the Megatron layout, in their own default process group) and rollout ranks
(engine replicas, in theirs); actor rank 0 and the rollout ranks share the bridge (mcore_rl.platform.split). Both
roles run the bridge's messages in one order, which is the whole protocol:

  handshake          actor -> rollout: where the run starts; rollout -> actor: what the engine offers
  samples(k)         rollout -> actor: every round of step k, generated and scored on the rollout ranks
  session after k    actor -> rollout: the sync of the weights after step k (buckets), the verification's
                     requests (probe log-probs, fingerprints, rebuild), validation; "end" closes it
  stop               actor -> rollout, in place of a session's next request: the run stopped (SIGTERM / SIGINT /
                     RUN_DIR/STOP) at a step boundary; the rollout ranks end without an error

  samples(1), session 1, samples(2), session 2, ..., samples(N), session N

The rollout ranks generate step k with the newest weights they hold once they hold the weights after step
k - 1 - max_staleness: with max_staleness 1 they generate step k + 1 on the weights before step k's update while the
actor trains step k (and then take session k before sending it); with 0 they take session k first (exactly the
colocated run). A resume sends the rollout ranks the weights of the checkpoint first (its own session).

Rewards are scored on the rollout ranks (each sample once, by one rank of its replica, as in the colocated
placement); the actor ranks receive every sample with its reward and run the same rounds (mcore_rl.generation)
from their own sampler, checked against the prompts the rollout ranks used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from mcore_rl.batch import RolloutSample
from mcore_rl.generation import EngineRounds, StepGenerator, build_engine, load_step_inputs, validation_examples
from mcore_rl.generation import validation_reward as local_validation_reward
from mcore_rl.placement import Phase, Placement, staleness_metrics, token_staleness
from mcore_rl.platform import collectives
from mcore_rl.rewards import RewardBatch
from mcore_rl.rollout.base import EngineCapabilities, RolloutEngine, WeightReader
from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout
from mcore_rl.safety import StopSignals
from mcore_rl.step_data import exchange_meta
from mcore_rl.weight_sync.bridge import BridgeEngineWeights, BridgeSender, receive_bucket
from mcore_rl.weight_sync.verify import ProbeBatch

log = logging.getLogger("mcore_rl.separate")

_FIELDS = ("rewards", "task_rewards", "penalties", "valid")


def resolved_staleness(rollout_cfg) -> int:
    """rollout.max_staleness with its default: 0 colocated, 1 separate."""
    if rollout_cfg.max_staleness is not None:
        return rollout_cfg.max_staleness
    return 1 if rollout_cfg.placement == "separate" else 0


def split_sizes(rollout_cfg, world: int) -> int:
    """The actor ranks of a separate job of `world` ranks (rollout.ranks of them generate; None: half)."""
    rollout = rollout_cfg.ranks if rollout_cfg.ranks is not None else world // 2
    if not 1 <= rollout < world:
        raise ValueError(
            f"rollout.placement=separate splits the {world} ranks into rollout.ranks = {rollout} rollout ranks and the "
            f"actor's: both need at least one; set rollout.ranks between 1 and {world - 1} (or trainer.nproc >= 2)"
        )
    return world - rollout


@dataclass
class StepSamples:
    """What the rollout ranks send for one step."""

    step: int  # 1-based
    version: int  # the weight version that generated them (0: the initial weights; k: after step k's update)
    rounds: list[dict]  # per round: every group (all prompts) and each sample's reward fields, in sample order
    sampler_state: dict  # the rollout ranks' sampler after these rounds
    probe: Optional[ProbeBatch] = None  # step 1: the calibration probe and the engine's log-probs of it
    probe_scores: Optional[list] = None
    generate_seconds: float = 0.0
    wait_seconds: float = 0.0  # the rollout ranks' time waiting for the actor since their last samples
    generated_tokens: int = 0
    stop_signal: int = 0  # a SIGTERM / SIGINT that a rollout rank received (0: none): the actor stops for it too
    extra: dict = field(default_factory=dict)  # metrics of the rollout role for the step's row (streaming)


_CLASS = "__class__"
_SAMPLE_CLASSES = {cls.__name__: cls for cls in (StepSamples, RolloutSample, ProbeBatch)}


def _plain(value):
    """`value` with every dataclass as a dict tagged with its class name: a checkpoint's trainer state holds only
    tensors and plain types, which torch reads with weights_only=True (mcore_rl/run_dir/trainer_state.py)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {_CLASS: type(value).__name__, **fields}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _restored(value):
    """The inverse of _plain, building only the classes a step's samples hold."""
    if isinstance(value, dict):
        fields = {k: _restored(v) for k, v in value.items() if k != _CLASS}
        return _SAMPLE_CLASSES[value[_CLASS]](**fields) if _CLASS in value else fields
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(v) for v in value)
    return value


class _Link(BridgeSender):
    """Actor rank 0's end of the bridge: commands to the rollout ranks, their replies; whether a session is open."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.open = False

    def command(self, kind: str, *args) -> None:
        if not self.open:
            self.bridge.ring()  # a session begins: a streaming rollout rank takes it between decode steps
        self.bridge.object((kind, args), from_actor=True)
        self.open = kind != "end"

    def reply(self):
        return self.bridge.object(from_actor=False)

    def end(self) -> None:
        if self.open:
            self.command("end")


class RemoteEngine(BridgeEngineWeights, RolloutEngine, WeightReader):
    """Actor rank 0's stand-in for the rollout replicas: the sync and the verification (weight_sync/) run unchanged
    against it; each call is a message on the bridge (weight_sync/bridge.py: the leader's replies; every replica
    loads)."""

    def __init__(self, link: _Link, info: dict):
        self.link, self.info = link, info

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(routes=self.info["routes"], reads_weights=self.info["reads_weights"])

    def score(self, sequences, prompt_lens, temperature: float = 1.0) -> list[torch.Tensor]:
        self.link.command("score", sequences, prompt_lens, temperature)
        return self.link.reply()

    def generate(self, prompts, n, params):
        raise RuntimeError("the separate placement generates on the rollout ranks, not through the actor's stand-in")

    def sleep(self) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def close(self) -> None:
        self.link.end()


class ReceivedRounds:
    """The actor ranks' rounds: those of the step's samples, in order, as this actor world's LocalRollout (every actor
    rank holds every sample; each scores - here: takes the reward of - its contiguous part)."""

    def __init__(self):
        self.pending: list[dict] = []

    def round(self, examples, n: int, temperature: float, seed: int, stats=None):
        if not self.pending:
            raise RuntimeError("the step asked for more rounds than the rollout ranks generated for it")
        got = self.pending.pop(0)
        groups = got["groups"]
        if [g[0].prompt_ids for g in groups] != [ex.prompt_ids for ex in examples]:
            raise RuntimeError(
                "the rollout ranks generated other prompts than the actor's sampler drew: the two roles' samplers "
                "or configs differ (a bug: report it with the run's config.yaml)"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        local = LocalRollout(ReplicaLayout(rank, world, world), len(examples), n, groups)
        part = {key: [got[key][i] for i in local.scored] for key in _FIELDS}
        scored = RewardBatch(
            part["rewards"],
            part["task_rewards"],
            errors=sum(not v for v in part["valid"]),
            first_error=got["first_error"],
            penalties=part["penalties"],
            valid=part["valid"],
        )
        return local, exchange_meta(local, scored.rewards, scored.valid, stats), scored


class SeparatePlacement(Placement):
    """The actor ranks' side: samples from the bridge, weights to it (actor rank 0 talks; the others follow)."""

    def __init__(self, cfg, actor, bridge):
        self.cfg, self.actor = cfg, actor
        self.link = _Link(bridge) if bridge is not None else None
        self.engine = None  # actor rank 0: a RemoteEngine after the handshake
        self.rounds = ReceivedRounds()
        self.max_staleness = resolved_staleness(cfg.rollout)
        self.ahead: Optional[StepSamples] = None  # samples received before the step that trains on them
        self.current: Optional[StepSamples] = None
        self.actor_wait = 0.0

    @property
    def receiver(self):
        return EngineCapabilities().receiver  # copy-in: the export's own gather, then the bridge

    @property
    def engine_label(self) -> str:
        """The engines the verification checks, as the launcher names ranks: the first rollout rank's global rank is
        the actor ranks' count (WORLD_SIZE: the job's, torchrun's and ray_launch's)."""
        leader, world = dist.get_world_size(), int(os.environ.get("WORLD_SIZE", dist.get_world_size() + 1))
        if world - leader == 1:
            return f"the engine of rollout rank {leader}"
        return (
            f"the engines of rollout ranks {leader}-{world - 1} (the probe scored by rank {leader}'s; the weights "
            f"compared on every replica, the rollout ranks' warnings above name the one that differs)"
        )

    # the device: each role holds its own
    def ensure(self, phase: Phase) -> None:
        pass

    def ensure_actor_state(self) -> None:
        pass

    def weights_replaced(self) -> None:
        pass

    @contextlib.contextmanager
    def handover(self) -> Iterator[None]:
        yield None

    def actor_reads(self, probe: ProbeBatch):
        return self.actor.probe_log_probs, self.actor.export_hf_weights

    def close(self) -> None:
        if self.link is not None:
            self.link.end()

    def peer_stop_signal(self) -> int:
        """The signal a rollout rank received, as the newest samples from them say (0: none)."""
        return max((s.stop_signal for s in (self.current, self.ahead) if s is not None), default=0)

    def stop(self) -> None:
        """The run stops at this step boundary: the rollout ranks, waiting for the next request, end cleanly."""
        if self.link is not None:
            if self.current is None and self.ahead is None:  # before step 1: they send its samples first
                self.ahead = self._receive()
            self.link.command("stop")
            self.link.open = False

    # the step's samples
    def begin_run(self, step: int, sampler_state: dict, unit: int) -> None:
        if self.link is None:
            return
        ahead = self.ahead
        start = {
            "first": step + 1 + (ahead is not None),
            "resumed": step > 0,  # the resume's sync of the checkpoint's weights comes first (its own session)
            "synced": step,
            "sampler": ahead.sampler_state if ahead is not None else sampler_state,
            "unit": unit,
        }
        self.link.bridge.object(start, from_actor=True)
        self.engine = RemoteEngine(self.link, self.link.reply())

    def _receive(self) -> StepSamples:
        self.link.end()
        return self.link.reply()

    def begin_step(self, step: int) -> None:
        start = time.perf_counter()
        samples = None
        if self.link is not None:
            self.link.end()  # the session before this step (a resume's sync too) ends before the next one starts
            samples, self.ahead = (self.ahead if self.ahead is not None else self._receive()), None
        box = [samples]
        dist.broadcast_object_list(box, src=0)  # every actor rank runs the same rounds
        self.current = box[0]
        if self.current.step != step + 1:
            raise RuntimeError(f"the rollout ranks sent step {self.current.step}'s samples for step {step + 1}")
        self.rounds.pending = list(self.current.rounds)
        self.actor_wait = time.perf_counter() - start

    def probe_scores(self, probe: ProbeBatch) -> list:
        sent = self.current.probe
        if sent is None or sent.sequences != probe.sequences or sent.prompt_lens != probe.prompt_lens:
            raise RuntimeError("the rollout ranks scored another calibration probe than the actor built")
        return self.current.probe_scores

    def samples_version(self, step: int) -> int:
        return self.current.version

    def step_metrics(self, step: int) -> dict:
        got = self.current
        if self.cfg.rollout.streaming:
            staleness = token_staleness(got, step, self.max_staleness)
        else:
            staleness = staleness_metrics(step - got.version)
        return {
            **staleness,
            **got.extra,
            "time/actor_wait": self.actor_wait,
            "time/rollout_generate": got.generate_seconds,
            "time/rollout_wait": got.wait_seconds,
            "perf/rollout_role_tokens_per_s": got.generated_tokens / max(got.generate_seconds, 1e-9),
            "perf/rollout_idle_fraction": got.wait_seconds / max(got.wait_seconds + got.generate_seconds, 1e-9),
        }

    def validation_reward(self, examples, seed: int) -> float:
        value = None
        if self.link is not None:
            self.link.command("validate", len(examples), seed)
            value = self.link.reply()
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def state_dict(self, step: int) -> dict:
        """Off-policy, the next step's samples were generated from weights older than the checkpoint's: kept with it
        (docs/placement.md, "Resume"). Exact (max_staleness 0): nothing - the rollout ranks regenerate them."""
        if self.max_staleness == 0 or step >= self.cfg.trainer.steps or self.link is None:
            return {}
        if self.ahead is None:
            self.ahead = self._receive()
        return {"ahead": _plain(self.ahead)}

    def load_state_dict(self, state: dict) -> None:
        ahead = state.get("ahead")
        self.ahead = None if ahead is None else _restored(ahead)


class RecordingRounds:
    """The rollout ranks' rounds: generated and scored here (EngineRounds), every sample and reward gathered to
    every rollout rank for the samples message."""

    def __init__(self, source: EngineRounds):
        self.source = source
        self.recorded: list[dict] = []

    def round(self, examples, n: int, temperature: float, seed: int, stats=None):
        local, meta, scored = self.source.round(examples, n, temperature, seed, stats)
        holds = local.replicas.rank % local.replicas.tp == 0  # one rank of each replica sends its groups
        mine = (local.groups if holds else [], {key: list(getattr(scored, key)) for key in _FIELDS}, scored.first_error)
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        got = {"groups": [g for groups, _, _ in parts for g in groups]}
        for key in _FIELDS:
            got[key] = [v for _, fields, _ in parts for v in fields[key]]
        got["first_error"] = next((e for _, _, e in parts if e), None)
        self.recorded.append(got)
        return local, meta, scored


class _Stopped(Exception):
    """The actor's "stop" on the bridge: the rollout ranks leave their loop."""


def _quiet_exit() -> None:
    """Ctrl-C twice on a rollout rank: end at once; the actor ranks say what was kept (trainer._stop_at_once)."""
    os._exit(0)


class RolloutWorker:
    """A rollout rank: generates the steps, serves the actor's syncs and verification, until the run's last step."""

    def __init__(self, cfg, inputs, platform, bridge):
        self.cfg, self.bridge = cfg, bridge
        self.inputs = load_step_inputs(cfg, inputs)
        self.engine = build_engine(cfg, platform)
        self.staleness = resolved_staleness(cfg.rollout)
        self.source = EngineRounds(
            self.engine, self.inputs.reward_fn, self.inputs.tokenizer, cfg.rollout, [self.inputs.tokenizer.eos_token_id]
        )
        self.synced = 0
        self.served = 0  # sessions served (the resume's too): the actor rings the doorbell once for each
        self.waited = 0.0
        # a signal does not end this rank where it is: the actor ranks stop at a step boundary and say "stop"
        self.signals = StopSignals(at_once=_quiet_exit)

    def _handshake(self) -> dict:
        start = self.bridge.object(from_actor=True)
        caps = self.engine.capabilities
        info = {"names": sorted(self.engine.weight_names() or []), "reads_weights": caps.reads_weights}
        self.bridge.object({**info, "routes": caps.routes}, from_actor=False)
        return start

    def run(self) -> None:
        self.signals.install()
        try:
            self._run()
        except _Stopped:
            log.info("rollout rank %d: the actor ranks stopped the run", dist.get_rank())
        self.engine.close()
        self.inputs.reward_fn.close()

    def _run(self) -> None:
        start = self._handshake()
        if start["resumed"]:
            self._serve()
        self.synced = start["synced"]
        self.inputs.sampler.load_state_dict(start["sampler"])
        recorder = RecordingRounds(self.source)
        generator = StepGenerator(
            self.cfg,
            self.inputs.train_set,
            self.inputs.sampler,
            self.inputs.tokenizer,
            recorder,
            start["unit"],
            None,
            dist.get_rank(),
        )
        self._steps(start["first"], generator, recorder)

    def _steps(self, first: int, generator: StepGenerator, recorder: RecordingRounds) -> None:
        """Generate steps `first` .. the last, each sent after the session before it (the bridge's order)."""
        steps, lag = self.cfg.trainer.steps, self.staleness
        for step in range(first, steps + 1):
            self._serve_until(step - 1 - lag)
            samples = self._generate(generator, recorder, step)
            self._serve_until(step - 1)
            begin = time.perf_counter()
            self.bridge.object(samples, from_actor=False)
            self.waited += time.perf_counter() - begin
        self._serve_until(steps)

    def _generate(self, generator: StepGenerator, recorder: RecordingRounds, step: int) -> StepSamples:
        begin = time.perf_counter()
        recorder.recorded = []
        generator.step(step - 1, None)
        rounds = recorder.recorded
        samples = StepSamples(step, self.synced, rounds, self.inputs.sampler.state_dict())
        if step == 1:  # the calibration: the engine's log-probs at the initial weights
            samples.probe = ProbeBatch.from_samples(rounds[0]["groups"])
            if samples.probe is not None:
                p = samples.probe
                samples.probe_scores = self.engine.score(p.sequences, p.prompt_lens, p.temperature)
        samples.generated_tokens = sum(len(s.response_ids) for r in rounds for g in r["groups"] for s in g)
        samples.generate_seconds = time.perf_counter() - begin
        samples.wait_seconds, self.waited = self.waited, 0.0
        (samples.stop_signal,) = collectives.max_ints([self.signals.received])  # any rollout rank's
        return samples

    def _serve_until(self, version: int) -> None:
        while self.synced < version:
            begin = time.perf_counter()
            self._serve()
            self.synced += 1
            self.waited += time.perf_counter() - begin

    def _serve(self) -> None:
        """One session of the actor's requests, until its "end"."""
        self.served += 1
        collecting: Optional[list] = None
        while True:
            kind, args = self.bridge.object(from_actor=True)
            if kind == "end":
                return
            if kind == "stop":
                raise _Stopped
            if kind == "load":
                weights = receive_bucket(self.bridge, args[0])
                if collecting is not None:
                    collecting.extend(weights)
                else:
                    self.engine.load_weights(weights)
            elif kind in ("rebuild", "diffs"):
                collecting = []
            elif kind == "rebuilt":
                self.engine.rebuild_from(collecting)
                collecting = None
            else:
                self._answer(kind, args, collecting)
                collecting = None

    def _answer(self, kind: str, args: tuple, collecting: Optional[list]) -> None:
        if kind == "score":  # vLLM's replicas score their shares together (a collective): every rank calls it
            spmd = self.engine.capabilities.handles_data_parallel
            value = self.engine.score(*args) if self._leads or spmd else None
        elif kind == "fingerprints":
            value = self._fingerprints(*args)
        elif kind == "diffed":
            value = self.engine.weight_diffs(collecting) if self._leads else None
        elif kind == "validate":
            count, seed = args
            examples = validation_examples(self.cfg, self.inputs.val_set)[:count]
            value = local_validation_reward(self.source, examples, seed)
        else:
            raise RuntimeError(f"unknown request {kind!r} from the actor on the bridge")
        self.bridge.object(value, from_actor=False)

    def _fingerprints(self, names: list[str]) -> Optional[dict]:
        """The leader's answer: every replica's fingerprints compared (the engines that have them hold one replica a
        rank), and for each weight the first replica's that differs from the leader's, so a sync that one replica
        alone did not apply fails the verification (and its rebuild reaches every replica) as the leader's would."""
        mine = self.engine.weight_fingerprints(names)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # the rollout ranks' own group
        if not self._leads:
            return None
        answer, first = dict(mine), self.bridge.split.actor_ranks
        for index, theirs in enumerate(every[1:], start=1):
            differ = [name for name in names if not torch.equal(theirs[name], mine[name])]
            if differ:
                log.warning(
                    "rollout rank %d: its engine differs from rollout rank %d's in %d of %d tensors after the sync "
                    "(e.g. %s)",
                    first + index,
                    first,
                    len(differ),
                    len(names),
                    differ[0],
                )
            answer.update({name: theirs[name] for name in differ if answer[name] is mine[name]})
        return answer

    @property
    def _leads(self) -> bool:
        return self.bridge.split.bridge_rank == 1
