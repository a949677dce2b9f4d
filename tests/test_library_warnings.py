"""The known library warnings are hidden behind one line per platform; everything else still shows.

The messages below are the libraries' own (megatron-core 0.16.1 / 0.12.1, mbridge 0.15.1, torch 2.13), as a
2-process CPU run printed them; the subprocess test imports real Megatron modules that raise them.
"""

import os
import subprocess
import sys
import warnings

import pytest

from mcore_rl.platform.library_warnings import (
    VERBOSE_ENV,
    fallback_notice,
    hide_known_warnings,
    quiet_startup,
    verbose_requested,
)
from tests.torchrun_util import REPO

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
APEX_NORM = "Apex is not installed. Falling back to Torch Norm"
GATHER = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` "
    "instead."
)

# (message, category, module the warning is attributed to, hidden)
CASES = [
    (TE_APEX, UserWarning, "megatron.core.optimizer", True),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier and multi_tensor_scale",
        UserWarning,
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        True,
    ),
    (APEX_NORM, UserWarning, "megatron.core.models.gpt.gpt_layer_specs", True),
    (APEX_NORM, UserWarning, "mbridge.models.internvl3.transformer_layer", True),
    (
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        UserWarning,
        "megatron.core.transformer.transformer_config",
        True,
    ),
    (GATHER, FutureWarning, "torch.distributed.c10d_logger", True),
    # sequence parallelism (TP > 1) reduce-scatters through the same deprecated name
    (
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single` "
        "instead.",
        FutureWarning,
        "torch.distributed.c10d_logger",
        True,
    ),
    # not known: another message of the same module, the same message from elsewhere or of another category
    ("Transformer Engine is too old: upgrade it", UserWarning, "megatron.core.optimizer", False),
    (APEX_NORM, UserWarning, "mcore_rl.megatron.actor", False),
    (APEX_NORM, DeprecationWarning, "megatron.core.models.backends", False),
    (GATHER, UserWarning, "torch.distributed.c10d_logger", False),
    (
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        FutureWarning,
        "torch.distributed",
        False,
    ),
]


def shown(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_known_warnings()
        warnings.warn_explicit(message, category, f"/site-packages/{module.replace('.', '/')}.py", 1, module=module)
    return len(caught) == 1


SP_CONNECTIONS = (
    "When using sequence parallelism it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
)


@pytest.mark.parametrize("platform, hidden", [("cpu", True), ("cuda", False), ("npu", False)])
def test_device_advice_is_hidden_on_cpu_only(platform, hidden):
    module = "megatron.core.tensor_parallel.layers"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_known_warnings(platform)
        warnings.warn_explicit(SP_CONNECTIONS, UserWarning, "/site-packages/megatron/core/x.py", 1, module=module)
    assert (len(caught) == 0) == hidden


@pytest.mark.parametrize("message, category, module, hidden", CASES)
def test_exactly_the_known_warnings_are_hidden(message, category, module, hidden):
    assert shown(message, category, module) == (not hidden)


def test_the_one_line_says_what_is_absent_and_what_it_means_per_platform():
    cpu = fallback_notice("cpu", have_te=False, have_apex=False)
    assert cpu.startswith("Transformer Engine and Apex are not installed: not used on CPU")
    assert "trainer.verbose=true" in cpu and f"{VERBOSE_ENV}=1" in cpu
    assert fallback_notice("cpu", have_te=True, have_apex=False).startswith("Apex is not installed: not used on CPU")
    cuda = fallback_notice("cuda", have_te=False, have_apex=True)
    assert cuda.startswith("Transformer Engine is not installed: Megatron runs its local PyTorch layers on cuda")
    assert "slower" in cuda and "pip install transformer-engine" in cuda
    assert "not needed" in fallback_notice("cuda", have_te=True, have_apex=False)
    assert "MindSpeed" in fallback_notice("npu", have_te=False, have_apex=False)
    assert fallback_notice("cuda", have_te=True, have_apex=True) is None


def test_verbose_from_the_config_or_the_environment():
    assert not verbose_requested(False, {})
    assert verbose_requested(True, {})
    assert [verbose_requested(False, {VERBOSE_ENV: v}) for v in ("1", "true", "yes", "0", "false", "", "No")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    with warnings.catch_warnings():
        assert quiet_startup("cpu", verbose=True) is None  # nothing hidden, nothing to say instead


IMPORT_MEGATRON = """
import sys, warnings
from mcore_rl.platform.library_warnings import quiet_startup
print(quiet_startup("cpu", verbose=sys.argv[1] == "verbose"))
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # warn at import without TE / Apex
warnings.warn("an unknown warning still shows")
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_real_megatron_imports(mode):
    """The filters precede Megatron's import-time warnings; with verbose every one of them shows."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_MEGATRON, mode],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning: an unknown warning still shows" in proc.stderr
    library = [line for line in proc.stderr.splitlines() if "Warning: " in line and "unknown warning" not in line]
    if mode == "quiet":
        assert proc.stdout.startswith("Transformer Engine and Apex are not installed: not used on CPU"), proc.stdout
        assert library == [], proc.stderr
    else:
        assert proc.stdout.strip() == "None"
        assert any(TE_APEX in line for line in library) and any(APEX_NORM in line for line in library), library
