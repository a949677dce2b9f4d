"""The engine protocol: every engine class of mcore_rl.rollout implements all of `RolloutEngine` (nothing optional,
nothing that answers None for "not supported") and declares capabilities that match what it implements and does.

`check_capabilities(engine)` is the instance check; test_vllm_engine.py runs it on a started vLLM engine too."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import mcore_rl.rollout
from mcore_rl.rollout.base import COPY_IN, EngineCapabilities, RolloutEngine, SamplingParams, WeightReader
from mcore_rl.rollout.data_parallel import DataParallelEngine, ReplicaLayout
from mcore_rl.rollout.embedded import EmbeddedEngine
from mcore_rl.rollout.vllm_engine import VllmEngine

# The protocol every engine implements (a new method here is a decision, not an accident).
PROTOCOL = {
    "capabilities",
    "generate",
    "score",
    "weight_names",
    "load_weights",
    "rebuild_from",
    "sleep",
    "wake_up",
    "close",
}


def engine_classes() -> list[type]:
    """Every concrete engine class defined in the modules of mcore_rl.rollout (read from the package)."""
    found = set()
    for info in pkgutil.iter_modules(mcore_rl.rollout.__path__):
        module = importlib.import_module(f"mcore_rl.rollout.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, RolloutEngine) and cls.__module__ == module.__name__ and not inspect.isabstract(cls):
                found.add(cls)
    return sorted(found, key=lambda c: c.__name__)


def test_the_protocol_is_small_and_every_method_of_it_required():
    public = {name for name in dir(RolloutEngine) if not name.startswith("_")}
    assert public == PROTOCOL
    # abstract: no default that does nothing or answers None for "not supported"
    assert RolloutEngine.__abstractmethods__ == PROTOCOL
    assert DataParallelEngine.__abstractmethods__ == PROTOCOL | {"replicas", "generate_share"}
    assert WeightReader.__abstractmethods__ == {"weight_diffs", "weight_fingerprints"}


def test_every_engine_class_implements_the_protocol():
    classes = engine_classes()
    assert classes == [EmbeddedEngine, VllmEngine]  # a new engine is found here and checked below
    for cls in classes:
        for name in PROTOCOL:
            assert getattr(cls, name) is not getattr(RolloutEngine, name), f"{cls.__name__}.{name} is not implemented"
        assert isinstance(inspect.getattr_static(cls, "capabilities"), property), cls


def test_capabilities_are_frozen_and_default_to_nothing_extra():
    caps = EngineCapabilities()
    assert (caps.handles_data_parallel, caps.routes, caps.reads_weights, caps.sleeps) == (False,) * 4
    assert caps.receiver == COPY_IN and caps.receiver.kind == "copy"
    with pytest.raises(AttributeError):
        caps.routes = True  # frozen: an engine states them, callers only read


def check_capabilities(engine: RolloutEngine, prompt: list[int]) -> EngineCapabilities:
    """What `engine.capabilities` states holds for the started engine."""
    caps = engine.capabilities
    assert isinstance(caps, EngineCapabilities)
    assert caps.handles_data_parallel == isinstance(engine, DataParallelEngine)
    if caps.handles_data_parallel:
        assert isinstance(engine.replicas, ReplicaLayout)
    assert caps.reads_weights == isinstance(engine, WeightReader)
    names = sorted(engine.weight_names())
    assert names, "a complete sync must deliver some weights"
    if caps.reads_weights:
        assert set(engine.weight_fingerprints(names)) == set(names)
    receiver = caps.receiver
    if receiver.kind in ("buffers", "shared"):
        for name in names:  # the exporter may write every weight in place; load_weights then skips it
            assert isinstance(receiver.buffer(name), torch.Tensor), name
        assert receiver.buffer("no.such.weight") is None
    if receiver.kind == "shared":
        for name in names:
            assert receiver.shared.view(name).data_ptr() == receiver.buffer(name).data_ptr(), name
    # routes: the samples carry them exactly where the engine says so
    (group,) = engine.generate([prompt], 2, SamplingParams(max_new_tokens=3, seed=5))
    assert {s.routed_experts is not None for s in group} == {caps.routes}
    if caps.interruptible:  # between decode steps the generation goes to between_steps; every token its version
        seen: list = []
        engine.between_steps, engine.weights_version = seen.append, 3
        try:
            (group,) = engine.generate([prompt], 2, SamplingParams(max_new_tokens=3, seed=5))
        finally:
            engine.between_steps, engine.weights_version = None, None
        assert seen and all(callable(g.weights_changed) for g in seen)
        assert all(s.token_versions == [3] * len(s.response_ids) for s in group)
    return caps


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir).encode("what is 2+2?")


@pytest.mark.parametrize("share_weights", [True, False], ids=["shared", "private"])
def test_embedded_engine_capabilities(tiny_model_dir, prompt, share_weights):
    engine = EmbeddedEngine(tiny_model_dir, share_weights=share_weights)
    try:
        caps = check_capabilities(engine, prompt)
        assert not caps.handles_data_parallel and not caps.sleeps and caps.reads_weights
        assert caps.routes  # the tiny model is an MoE, routes recorded by default
        assert caps.receiver.kind == ("shared" if share_weights else "buffers")
        # a buffer written in place and handed back is taken as it is (no copy onto itself)
        name = sorted(engine.weight_names())[0]
        buffer = caps.receiver.buffer(name)
        buffer.fill_(0.25)
        engine.load_weights([(name, buffer)])
        assert float(engine.weight_diffs([(name, torch.full_like(buffer, 0.25))])[name]) == 0.0
        # the receiver follows a rebuild: the new model's own tensors
        engine.rebuild_from([(n, caps.receiver.buffer(n).detach().clone()) for n in engine.weight_names()])
        after = check_capabilities(engine, prompt)
        assert after.receiver.kind == caps.receiver.kind
        assert after.receiver.buffer(name).data_ptr() != buffer.data_ptr()
        assert torch.equal(after.receiver.buffer(name), torch.full_like(buffer, 0.25))
    finally:
        engine.close()


def test_embedded_engine_without_routes_says_so(tiny_model_dir, prompt):
    engine = EmbeddedEngine(tiny_model_dir, return_routed_experts=False, share_weights=False)
    assert not check_capabilities(engine, prompt).routes


def test_an_engine_asked_for_routes_it_cannot_give_is_refused_at_start(tiny_model_dir, tiny_dense_dirs):
    """make_engine reads `capabilities.routes`: R3 on an engine without routes (here a dense model; in a run, vLLM
    on CPU) stops before any step, and an engine that has them starts."""
    from mcore_rl.config import RolloutConfig
    from mcore_rl.rollout import make_engine

    with pytest.raises(ValueError, match="algo.routing_replay=r3 .* use algo.routing_replay=r2"):
        make_engine(RolloutConfig(), tiny_dense_dirs["qwen3"], return_routed_experts=True)
    assert make_engine(RolloutConfig(), tiny_model_dir, return_routed_experts=True).capabilities.routes
    assert not make_engine(RolloutConfig(), tiny_model_dir, return_routed_experts=False).capabilities.routes
