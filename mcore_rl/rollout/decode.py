"""The embedded engine's decode loop, one step at a time, so that a generation can stop between decode steps, take
new weights and continue (partial rollout, docs/async.md).

`DecodeBatch` holds one batch of left-padded rows between steps: the sampled tokens, their log-probs, the weight
version that produced each token and its routes. A step draws one token per row from the pending logits and feeds
it, so every token is drawn and fed (its routes recorded) under the same weights. `Generation` runs the batches of
one request one after another (the engine's memory bound, `max_batch_tokens`); the engine's `generate` is one
`Generation` run to its end.

At a weight update the in-flight batch **recomputes** its KV cache: one forward of every row's prompt and generated
tokens under the new weights (`refill`). Keeping the old cache would be cheaper, but the keys and values of the
earlier tokens would stay those of the old weights, so the next tokens' log-probs would be neither version's: a
mixture no policy computes, which the trainer could not reproduce. Recomputed, every token's log-prob is that of the
weights that drew it (what `engine.score` gives for the sequence under those weights), and so are its routes. The
tokens generated before the update are kept with their log-probs and routes from their own version.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from mcore_rl.batch import RolloutSample

if TYPE_CHECKING:
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.embedded import EmbeddedEngine


class DecodeBatch:
    """One batch of rows between decode steps (see the module docstring); `version` None: nothing tracks versions
    (plain `generate`: the samples' `token_versions` stay None)."""

    def __init__(self, engine: EmbeddedEngine, prompts, params: SamplingParams, stop, gen, version: Optional[int]):
        self.engine, self.prompts, self.params, self.gen = engine, prompts, params, gen
        self.version = version
        self.batch, self.width = len(prompts), max(len(p) for p in prompts)
        self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=engine.device)
        self.capture = engine.num_moe_layers > 0 and engine.return_routed_experts
        self.tokens, self.logps, self.versions, self.step_routes = [], [], [], []
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=engine.device)
        self.lengths = torch.zeros(self.batch, dtype=torch.long, device=engine.device)
        self.done = False
        self._prefill()

    def _prefill(self) -> None:
        """Each distinct prompt once; its rows start from copies of its cache and logits."""
        engine = self.engine
        distinct, rows = _distinct_rows(self.prompts)
        ids, mask = engine._left_padded(distinct, self.width)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = engine._new_cache()
        logits, self.prompt_routes = self._forward(ids, mask, positions, len(distinct), self.width)
        if len(distinct) < self.batch:
            rows = rows.to(engine.device)
            self.cache.reorder_cache(rows)
            logits, mask, positions = logits[rows], mask[rows], positions[rows]
            self.prompt_routes = self.prompt_routes[rows] if self.capture else None
        self.logits, self.mask, self.positions = logits, mask, positions

    def _forward(self, ids, mask, positions, rows: int, seq: int, capture: Optional[bool] = None):
        """The last position's logits and, when routes are captured, every fed token's routes [rows, seq, L, k]."""
        capture = self.capture if capture is None else capture
        with _RouteRecorder(self.engine.model, self.engine.top_k_experts) if capture else _null() as rec:
            logits = self.engine._forward(ids, mask, positions, self.cache, keep=1)[:, -1]
            return logits, rec.take(rows, seq) if capture else None

    def step(self) -> None:
        """Draw one token per row from the pending logits and feed it (the next logits, the token's routes)."""
        params = self.params
        token, logp = self.engine._pick(self.logits, params, self.gen)
        self.tokens.append(token)
        self.logps.append(logp)
        self.versions.append(self.version)
        self.lengths += (~self.finished).long()
        self.finished |= torch.isin(token, self.stop_ids)
        last = bool(self.finished.all()) or len(self.tokens) == params.max_new_tokens
        if last and not self.capture:
            self.done = True
            return
        one = torch.ones((self.batch, 1), dtype=self.mask.dtype, device=self.engine.device)
        self.mask = torch.cat([self.mask, one], dim=1)
        self.positions = self.positions[:, -1:] + 1
        self.logits, routes = self._forward(token[:, None], self.mask, self.positions, self.batch, 1)
        if self.capture:
            self.step_routes.append(routes)
        self.done = last

    def refill(self, version: Optional[int]) -> None:
        """The engine's weights changed: recompute the KV cache and the pending logits of every row (its prompt and
        the tokens generated so far) under them; the tokens, log-probs and routes so far are kept."""
        engine = self.engine
        ids, _ = engine._left_padded(self.prompts, self.width)
        ids = torch.cat([ids, *(t[:, None] for t in self.tokens)], dim=1)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = engine._new_cache()
        self.logits, _ = self._forward(ids, self.mask, positions, self.batch, ids.shape[1], capture=False)
        self.version = version

    @property
    def interrupted_rows(self) -> int:
        return 0 if self.done else int((~self.finished).sum())

    def collect(self) -> list[RolloutSample]:
        tokens = torch.stack(self.tokens, 1).cpu()
        logps = torch.stack(self.logps, 1).float().cpu()
        lengths = self.lengths.cpu()
        # whole-batch tensor work, then plain lists per row: every response has at least one token, and it ended
        # by a stop token ("stop") or at max_new_tokens ("length")
        stopped = torch.isin(tokens.gather(1, (lengths - 1)[:, None]).squeeze(1), self.stop_ids.cpu()).tolist()
        rows, counts = tokens.tolist(), lengths.tolist()
        response_routes = torch.cat(self.step_routes, 1).cpu() if self.step_routes else None
        out = []
        for i, p in enumerate(self.prompts):
            n = counts[i]
            routes = None
            if self.prompt_routes is not None:
                routes = torch.cat([self.prompt_routes[i, self.width - len(p) :].cpu(), response_routes[i, :n]], 0)
            out.append(
                RolloutSample(
                    prompt_ids=list(p),
                    response_ids=rows[i][:n],
                    logprobs=logps[i, :n].clone(),
                    finish_reason="stop" if stopped[i] else "length",
                    routed_experts=routes,
                    token_versions=None if self.version is None else list(self.versions[:n]),
                )
            )
        return out


class Generation:
    """One request's samples, generated in batches one after another and interruptible between decode steps:
    `advance` runs decode steps, `weights_changed` (after the engine's `load_weights`) makes the in-flight batch
    recompute its cache under the new weights, `result` gives the samples once `done`. A batch not yet started is
    prefilled under the weights current when it starts."""

    def __init__(self, engine: EmbeddedEngine, prompts, n: int, params: SamplingParams, version: Optional[int]):
        self.engine, self.n, self.params, self.version = engine, n, params, version
        self.count = len(prompts)
        expanded = [list(p) for p in prompts for _ in range(n)]
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.gen = torch.Generator(device=engine.device).manual_seed(seed)
        eos = engine.eos_token_id
        self.stop = set(params.stop_token_ids) | ({eos} if eos is not None else set())
        per_batch = max(1, engine.max_batch_tokens // (max(len(p) for p in expanded) + params.max_new_tokens))
        self.pending = [expanded[s : s + per_batch] for s in range(0, len(expanded), per_batch)]
        self.current: Optional[DecodeBatch] = None
        self.samples: list[RolloutSample] = []
        self.interrupted = 0  # samples in flight at a weight update (each counted once per update)

    @property
    def done(self) -> bool:
        return self.current is None and not self.pending

    @torch.no_grad()
    def advance(self, steps: Optional[int] = None) -> bool:
        """Run up to `steps` decode steps (None: to the end); whether the request is done."""
        while not self.done and (steps is None or steps > 0):
            if self.current is None:  # a batch's prefill and its first step go together: no update between them
                self.current = DecodeBatch(
                    self.engine, self.pending.pop(0), self.params, self.stop, self.gen, self.version
                )
            self.current.step()
            steps = None if steps is None else steps - 1
            if self.current.done:
                self.samples += self.current.collect()
                self.current = None
        return self.done

    @property
    def in_flight(self) -> int:
        """The samples a weight update now would interrupt: the unfinished rows of the batch in flight."""
        return 0 if self.current is None else self.current.interrupted_rows

    @torch.no_grad()
    def weights_changed(self, version: Optional[int]) -> None:
        """The engine now holds the weights of `version`: the in-flight rows continue under them."""
        self.version = version
        if self.current is not None:
            self.interrupted += self.in_flight
            self.current.refill(version)

    def result(self) -> list[list[RolloutSample]]:
        if not self.done:
            raise RuntimeError("the generation is still in flight: advance it to the end first")
        return [self.samples[i * self.n : (i + 1) * self.n] for i in range(self.count)]


def _distinct_rows(prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """The distinct prompts in first-seen order, and for each row of `prompts` the index of its distinct prompt."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], torch.tensor(rows, dtype=torch.long)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE block, in layer order (a block has both `gate` and `experts`)."""
    return [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def _router_topk(output, top_k: int) -> torch.Tensor:
    """Top-k expert ids from a router's forward output.

    transformers >= 5: the router module returns (logits, weights, indices); 4.x: the gate is a Linear that
    returns logits and the block takes top-k of their softmax (same order as top-k of the logits).
    """
    if isinstance(output, tuple):
        return output[2]
    return torch.topk(output, top_k, dim=-1).indices


class _RouteRecorder:
    """Forward hooks that collect [tokens, k] expert ids per MoE layer for each forward call."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.routers = moe_routers(model)
        self.top_k = top_k
        self.current: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self.handles = []

    def __enter__(self) -> "_RouteRecorder":
        for i, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.current[layer] = _router_topk(output, self.top_k).to(torch.int16)

        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """Routes of the last forward as [batch, seq, layers, k]."""
        routes = torch.stack([r.reshape(batch, seq, self.top_k) for r in self.current], dim=2)
        self.current = [None] * len(self.routers)
        return routes


@contextmanager
def _null() -> Iterator[None]:
    yield None
