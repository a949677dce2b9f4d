"""The embedded rollout engine: a transformers model in the trainer's own process (default on CPU and in tests).

Sampling is our own loop over a KV cache on left-padded batches (each prompt repeated n times; the prefill runs
once per distinct prompt and its n rows start from copies of its cache and logits):

- log-probs: the log-prob returned for a sampled token is ``log_softmax(logits / T)[token]``, the
  temperature-scaled distribution *before* top-k / top-p filtering (no renormalisation over the kept set).
  That is what the trainer recomputes in training (log softmax of the actor's logits divided by the same T),
  so the two agree whenever the weights agree. Top-k / top-p only decide which token is drawn.
  ``temperature == 0`` means greedy decoding; its log-probs are then those of T = 1. Where the model's vocabulary
  is padded beyond the tokenizer's, the padded ids are masked before all of it (never sampled; vLLM's
  ``allowed_token_ids`` does the same, also before its processed log-probs).
- determinism: every draw uses one ``torch.Generator`` seeded from ``SamplingParams.seed``; the same prompts,
  n, params and weights give the same samples.
- stopping: a response ends at the first token in ``stop_token_ids`` or the model's end-of-turn token (kept in
  ``response_ids``, finish reason "stop") or after ``max_new_tokens`` (finish reason "length").
- routed experts (when ``return_routed_experts``; the trainer asks only under R3): forward hooks on every MoE
  router record the top-k expert ids of every token fed through the model, prompt tokens included; each sample
  gets them as int16 ``[prompt + response, moe_layers, k]`` (else ``routed_experts`` is None).
- weights: ``load_weights`` copies (Hugging Face checkpoint name, tensor) pairs into the live parameters in
  place; ``weight_buffer(name)`` (``capabilities.receiver.buffer``) hands out those parameters (or slices) so an exporter can gather into them
  directly, and a pair that already is the engine's own tensor is then skipped. transformers >= 5 stores the experts of a layer fused as 3-D ``gate_up_proj`` / ``down_proj``; the
  checkpoint's per-expert names are mapped onto slices of those (see ``_weight_targets``). On the CPU the
  parameters live in one shared-memory region (mcore_rl/platform/shared_memory.py) whose table of weight names
  ``capabilities.receiver.shared`` hands out: the exporter's other ranks on the same host map it and write their shards
  straight into the engine (mcore_rl/weight_sync/direct_write.py); ``share_weights=False`` keeps plain memory.
- partial rollout: ``start`` returns a generation that stops between decode steps, takes new weights and continues
  its in-flight rows with their tokens kept, the KV cache recomputed under the new weights; every token records
  its weight version, its log-prob and routes are those of that version (mcore_rl/rollout/decode.py says why).
"""

from __future__ import annotations

import difflib
import inspect
import logging
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from mcore_rl.compat import transformers as compat_transformers
from mcore_rl.models.hf_io import torch_dtype
from mcore_rl.platform.shared_memory import SharedRegion, SharedTensors, share_parameters
from mcore_rl.rollout.base import (
    EngineCapabilities,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    WeightReader,
    WeightReceiver,
    check_generate_request,
    check_score_request,
)
from mcore_rl.rollout.decode import Generation, moe_routers
from mcore_rl.weight_sync.fingerprints import fingerprint

log = logging.getLogger(__name__)


def _weight_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Map every Hugging Face checkpoint name to the tensor (or slice view) that holds it in `model`.

    Plain parameters map to themselves. Fused expert tensors (transformers >= 5: ``experts.gate_up_proj``
    [E, 2I, H] with gate rows first, ``experts.down_proj`` [E, H, I]) are also reachable by the per-expert
    checkpoint names ``experts.{e}.{gate,up,down}_proj.weight`` that checkpoints and exporters use.
    """
    targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
    targets = {name: t for name, t in targets.items() if isinstance(t, torch.nn.Parameter)}
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.nn.Parameter) or gate_up.dim() != 3:
            continue
        if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
            raise NotImplementedError(f"{name}: fused experts in a transposed or interleaved layout are not supported")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            targets[f"{name}.{e}.gate_proj.weight"] = gate_up[e, :inter]
            targets[f"{name}.{e}.up_proj.weight"] = gate_up[e, inter:]
            targets[f"{name}.{e}.down_proj.weight"] = down[e]
    return targets


def _checkpoint_names(model: torch.nn.Module) -> set[str]:
    """The names a complete sync delivers: each parameter once (tied aliases not required), with per-expert
    names in place of the fused expert tensors they cover."""
    names = {name for name, _ in model.named_parameters()}  # deduplicates tied parameters
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3:
            names -= {f"{name}.gate_up_proj", f"{name}.down_proj"}
            names |= {
                f"{name}.{e}.{proj}.weight"
                for e in range(gate_up.shape[0])
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
    return names


def _filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf; the most likely token always survives."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass of the tokens before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


class EmbeddedEngine(RolloutEngine, WeightReader):
    """A Hugging Face causal LM that samples, scores and takes weights in place."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        max_batch_tokens: int = 65536,
        config=None,
        return_routed_experts: bool = True,
        share_weights: Optional[bool] = None,
    ):
        """Load the HF checkpoint folder `model_path` (config, safetensors, tokenizer).

        `return_routed_experts`: record every token's experts (rollout routing replay, R3). It costs one
        more forward per batch (the last sampled token's routes), so leave it off when nothing replays them.

        With `config` (a transformers config), the model is built from it with random weights instead and
        `model_path` only supplies the tokenizer: for engines whose weights all come by sync (benchmarks).

        `share_weights` (default: on the CPU): parameters in a shared-memory region that the exporter's ranks on
        this host write into (see module doc); where the host refuses one, plain memory (logged).
        """
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens  # bounds the sequences run in one batch (memory)
        self.return_routed_experts = return_routed_experts
        self.share_weights = self.device.type == "cpu" if share_weights is None else share_weights
        self._shared: Optional[SharedTensors] = None
        self.config = config if config is not None else compat_transformers.load_config(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        # ids at or above it are padded rows of the model's vocabulary, never sampled (they are no token)
        self.sampled_vocab = min(len(self.tokenizer), self.config.vocab_size)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._noop_logged = False
        # streaming (mcore_rl/streaming.py): called between decode steps with the in-flight `decode.Generation`,
        # which it may give new weights; and the version every generated token records (None: not recorded)
        self.between_steps: Optional[Callable[[Generation], None]] = None
        self.weights_version: Optional[int] = None
        self._set_model(self._empty_model() if config is not None else self._load_pretrained())

    # ----- model lifecycle -----

    def _load_pretrained(self) -> torch.nn.Module:
        """Build from config, then stream the checkpoint's safetensors through the engine's own weight loader.

        Not `from_pretrained`: it materialises the model on the meta device and recomputes non-persistent
        buffers afterwards, and in a process where Megatron's CPU adaptation wrapped torch's tensor factories
        (mcore_rl.platform.cpu_adapt) that left rotary `inv_freq` uninitialised (transformers 5.24).
        """
        from safetensors import safe_open

        model = self._empty_model()
        files = sorted(Path(self.model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {self.model_path}; the engine needs a Hugging Face "
                f"checkpoint folder (config.json + safetensors + tokenizer)"
            )
        targets = _weight_targets(model)
        seen = set()
        with torch.no_grad():
            for file in files:
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        if name not in targets:
                            raise KeyError(
                                f"{file.name}: weight {name!r} has no place in the model built from "
                                f"{self.model_path}/config.json"
                            )
                        targets[name].copy_(f.get_tensor(name))
                        seen.add(name)
        missing = _checkpoint_names(model) - seen
        if missing:
            raise ValueError(f"{self.model_path}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        return model

    def _empty_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        # eager attention: fully masked (left-padding) rows stay finite, which sdpa does not promise
        return AutoModelForCausalLM.from_config(self.config, dtype=self.dtype, attn_implementation="eager")

    def _set_model(self, model: torch.nn.Module) -> None:
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        region = self._share(self.model)
        self._targets = _weight_targets(self.model)
        self._shared = None
        if region is not None:
            self._shared = SharedTensors.describe(region, {n: t.detach() for n, t in self._targets.items()})
        self._names = _checkpoint_names(self.model)
        self.top_k_experts = getattr(self.config, "num_experts_per_tok", 0)
        self.num_moe_layers = len(moe_routers(self.model))
        # transformers 5 renamed the forward's `past_key_values` argument to `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _share(self, model: torch.nn.Module) -> Optional[SharedRegion]:
        if not self.share_weights:
            return None
        try:
            return share_parameters(model)
        except (OSError, ValueError) as e:  # e.g. no memfd on this host: the exporter copies instead
            log.warning("embedded engine: parameters stay in private memory (%s)", e)
            return None

    @property
    def capabilities(self) -> EngineCapabilities:
        """One process, one replica; routes where the model has MoE layers and they are recorded; it reads its
        weights back; it never sleeps; the sync writes into its parameters (shared on the CPU); interruptible."""
        return EngineCapabilities(
            routes=self.return_routed_experts and self.num_moe_layers > 0,
            reads_weights=True,
            receiver=WeightReceiver(buffer=self.weight_buffer, shared=self._shared),
            interruptible=True,
        )

    # ----- weights -----

    def close(self) -> None:
        if self._shared is not None:
            self._shared.region.close()

    def weight_names(self) -> set[str]:
        return set(self._names)

    def _target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        target = self._targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(self._names), n=3)
            raise KeyError(
                f"engine has no weight named {name!r} (closest: {close}); the exporter and the engine "
                f"disagree on Hugging Face names"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r}: got shape {tuple(tensor.shape)}, engine expects {tuple(target.shape)}; "
                f"the exporter must gather full (unsharded) tensors of the same model"
            )
        return target

    def weight_buffer(self, name: str) -> Optional[torch.Tensor]:
        """The parameter (or slice) holding weight `name`, None for a name the model lacks (WeightReceiver.buffer)."""
        return self._targets.get(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            target = self._target(name, tensor)
            if not _same_memory(target, tensor):  # an exporter may have written it in place (weight_buffer)
                target.copy_(tensor)

    @torch.no_grad()
    def weight_diffs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        return {
            name: (self._target(name, t).float() - t.to(self.device).float()).abs().max().item() for name, t in weights
        }

    @torch.no_grad()
    def weight_fingerprints(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: fingerprint(name, self._targets[name]) for name in names}

    def rebuild_from(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A fresh model object filled from `weights`; every engine weight must be delivered."""
        old_model = self.model
        self._set_model(self._empty_model())
        seen = set()
        with torch.no_grad():
            for name, tensor in weights:
                self._target(name, tensor).copy_(tensor)
                seen.add(name)
        missing = self._names - seen
        if missing:
            self._set_model(old_model)
            raise ValueError(
                f"rebuild got {len(seen)} of {len(self._names)} weights; missing e.g. {sorted(missing)[:3]}"
            )
        log.warning("rollout engine rebuilt from %d exported tensors", len(seen))

    def sleep(self) -> None:
        self._log_noop("sleep")

    def wake_up(self, tags=None) -> None:
        self._log_noop("wake_up")

    def _log_noop(self, what: str) -> None:
        if not self._noop_logged:
            log.info("embedded engine: sleep/wake_up are no-ops (%s); its memory stays allocated", what)
            self._noop_logged = True

    # ----- forward -----

    def _forward(self, ids, mask, positions, cache=None, keep: int = 0) -> torch.Tensor:
        kwargs = {self._cache_kwarg: cache} if cache is not None else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=cache is not None,
            logits_to_keep=keep,
            **kwargs,
        )
        return out.logits

    def _new_cache(self):
        from transformers import DynamicCache

        try:  # transformers >= 5 sizes the cache from the config; 4.x takes no arguments
            return DynamicCache(config=self.config)
        except TypeError:
            return DynamicCache()

    # ----- generate -----

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        generation = self.start(prompts, n, params, self.weights_version)
        while not generation.advance(1 if self.between_steps is not None else None):
            self.between_steps(generation)
        return generation.result()

    def start(self, prompts: list[list[int]], n: int, params: SamplingParams, version: Optional[int] = None):
        """An interruptible generation (`decode.Generation`): advance it step by step, give it new weights between
        steps (`load_weights`, then its `weights_changed(version)`); with `version`, every sample records each
        token's version (`RolloutSample.token_versions`)."""
        self._check_sampling(prompts, n, params)
        return Generation(self, prompts, n, params, version)

    def _check_sampling(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        check_generate_request(prompts, n, params, self.config.vocab_size)
        limit = getattr(self.config, "max_position_embeddings", None)
        longest = max(len(p) for p in prompts)
        if limit is not None and longest + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds the model's "
                f"max_position_embeddings {limit}; shorten prompts (data.max_prompt_len) or max_new_tokens"
            )

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator):
        """Next token per row and its log-prob under the temperature-scaled, unfiltered distribution over the
        tokenizer's ids (padded vocabulary rows masked, as vLLM's allowed_token_ids masks them)."""
        logits = logits.float()
        if self.sampled_vocab < logits.shape[-1]:
            logits = logits.masked_fill(self._padded_ids(logits.shape[-1]), float("-inf"))
        if params.temperature == 0:
            token = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            scaled = logits / params.temperature
            logp = torch.log_softmax(scaled, -1)
            probs = torch.softmax(_filter_logits(scaled, params.top_k, params.top_p), -1)
            token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    def _padded_ids(self, width: int) -> torch.Tensor:
        return torch.arange(width, device=self.device) >= self.sampled_vocab

    def _left_padded(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask [rows, width], left-padded: every prompt ends at the same column."""
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    # ----- score -----

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        check_score_request(sequences, prompt_lens, temperature, self.config.vocab_size)
        longest = max(len(s) for s in sequences)
        # bound the [rows, seq, vocab] fp32 logits of one chunk to ~256 MB
        rows = max(1, min(self.max_batch_tokens // longest, (64 << 20) // max(1, longest * self.config.vocab_size)))
        out: list[torch.Tensor] = []
        for start in range(0, len(sequences), rows):
            out += self._score_batch(sequences[start : start + rows], prompt_lens[start : start + rows], temperature)
        return out

    def _score_batch(self, sequences, prompt_lens, temperature):
        batch, width = len(sequences), max(len(s) for s in sequences)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, s in enumerate(sequences):  # right padding: positions start at 0 for every row
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = torch.arange(width, device=self.device).expand(batch, width)
        logits = self._forward(ids, mask, positions).float()
        logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return [logp[i, p - 1 : len(s) - 1].cpu().clone() for i, (s, p) in enumerate(zip(sequences, prompt_lens))]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
