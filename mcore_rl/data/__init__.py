"""Prompt data: verl-layout datasets, the resumable sampler, and the embedded task."""

from mcore_rl.data.dataset import (
    DatasetSummary,
    EpochSampler,
    PromptDataset,
    PromptExample,
    PromptInputs,
    load_prompt_dataset,
    tokenize_prompt,
)
from mcore_rl.data.task import TaskSpec, chance_reward, make_task_dataset

__all__ = [
    "DatasetSummary",
    "EpochSampler",
    "PromptDataset",
    "PromptExample",
    "PromptInputs",
    "TaskSpec",
    "chance_reward",
    "load_prompt_dataset",
    "make_task_dataset",
    "tokenize_prompt",
]
