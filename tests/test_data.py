"""Prompt datasets (verl layout, parquet and jsonl) and the resumable seeded sampler."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.data import EpochSampler, load_prompt_dataset
from mcore_rl.models.tiny import build_tokenizer
from tests.torchrun_util import REPO

CONFIG = REPO / "configs" / "tiny" / "gspo_cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def row(content, truth="1", source="unit", **extra):
    return {
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": truth},
        "data_source": source,
        **extra,
    }


def expected_ids(tokenizer, content):
    # Independent of the chat template: the Qwen markup written out, one token per character.
    pieces = ["<|im_start|>", *"user\n", *content, "<|im_end|>", "\n", "<|im_start|>", *"assistant\n"]
    return tokenizer.convert_tokens_to_ids(pieces)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_are_tokenised_filtered_and_counted(tmp_path, tokenizer, caplog):
    rows = [
        row("abc", "a", extra_info={"k": 1}),
        "{not json",
        {"prompt": "a string, not messages", "reward_model": {"ground_truth": "1"}, "data_source": "x"},
        {"prompt": [{"role": "user", "content": "hi"}], "data_source": "x"},  # no ground truth
        row("x" * 40),  # too long for max_prompt_len=30
        row("hello world", "h", source="other"),
    ]
    with caplog.at_level(logging.INFO, logger="mcore_rl.data.dataset"):
        ds = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_len=30)
    s = ds.summary
    assert (s.rows, s.kept, s.too_long, s.malformed) == (6, 2, 1, 3)
    assert s.malformed_example.startswith("row 1: not valid JSON")
    assert [e.index for e in ds] == [0, 5]
    assert ds[0].prompt_ids == expected_ids(tokenizer, "abc")
    assert (ds[0].ground_truth, ds[0].data_source, ds[0].extra_info) == ("a", "unit", {"k": 1})
    assert ds[1].raw_prompt == [{"role": "user", "content": "hello world"}] and ds[1].extra_info == {}
    assert "2/6 prompts kept" in caplog.text and "3 malformed rows skipped" in caplog.text


def test_parquet_and_jsonl_give_the_same_examples(tmp_path, tokenizer):
    rows = [row(f"q{i}", str(i), extra_info={"i": i}) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = load_prompt_dataset(tmp_path / "d.parquet", tokenizer, max_prompt_len=64)
    b = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_len=64)
    assert [vars(e) for e in a] == [vars(e) for e in b]
    assert a[3].prompt_ids == expected_ids(tokenizer, "q3")


def test_prompts_tokenised_in_chunks_keep_file_order_and_filters(tmp_path, tokenizer, monkeypatch):
    """Prompts are tokenised in batches (dataset.TOKENIZE_CHUNK rows a call): chunks that cut through malformed and
    too-long rows give each kept prompt its own ids, in file order, with the same counts."""
    import mcore_rl.data.dataset as dataset

    monkeypatch.setattr(dataset, "TOKENIZE_CHUNK", 2)
    contents = ["a", "bb", "x" * 40, "ccc", "dd", "x" * 41, "e"]
    rows = [row(c, str(i)) for i, c in enumerate(contents)]
    rows.insert(3, "{not json")
    ds = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_len=30)
    kept = [c for c in contents if len(c) < 40]
    assert [e.prompt_ids for e in ds] == [expected_ids(tokenizer, c) for c in kept]
    assert [e.index for e in ds] == [0, 1, 4, 5, 7] and [e.ground_truth for e in ds] == ["0", "1", "3", "4", "6"]
    s = ds.summary
    assert (s.rows, s.kept, s.too_long, s.malformed) == (8, 5, 2, 1)


def test_prompt_inputs_key_names_the_validation_set_only_where_it_is_used(tmp_path):
    from mcore_rl.config import load_config
    from mcore_rl.data import PromptInputs

    base = ["model.path=m", "data.train_path=t.parquet", "data.val_path=v.parquet"]
    with_val = PromptInputs.key_of(load_config(CONFIG, [*base, "trainer.val_every=5"]))
    without = PromptInputs.key_of(load_config(CONFIG, [*base, "trainer.val_every=0"]))
    assert with_val == ("m", "t.parquet", "v.parquet", 64, "prompt") and without[2] is None
    assert PromptInputs.key_of(load_config(CONFIG, [*base, "data.max_prompt_len=32"]))[3] == 32


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "does not exist; expected a .parquet or .jsonl"),
        ("empty", "is empty"),
        ("all_bad", r"all 2 rows are malformed \(e.g. row 0: .reward_model.ground_truth. is missing\)"),
        ("all_long", r"longer than data.max_prompt_len=10 tokens \(shortest 2\d\); raise data.max_prompt_len"),
        ("suffix", "unknown file type '.csv'"),
    ],
)
def test_unusable_datasets_fail_with_a_clear_message(tmp_path, tokenizer, case, match):
    path = {
        "missing": tmp_path / "nope.parquet",
        "empty": write_jsonl(tmp_path / "e.jsonl", []),
        "all_bad": write_jsonl(
            tmp_path / "b.jsonl", [{"prompt": [{"role": "user", "content": "a"}], "data_source": "s"}] * 2
        ),
        "all_long": write_jsonl(tmp_path / "l.jsonl", [row("abcdef")]),
        "suffix": write_jsonl(tmp_path / "d.csv", [row("a")]),
    }[case]
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_prompt_dataset(path, tokenizer, max_prompt_len=10)


def test_sampler_epochs_are_seeded_permutations():
    s = EpochSampler(num_examples=10, batch_size=5, seed=3)
    epoch0 = s.next_batch() + s.next_batch()
    epoch1 = s.next_batch() + s.next_batch()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))
    other = EpochSampler(num_examples=10, batch_size=10, seed=4).next_batch()
    assert other != epoch0
    assert EpochSampler(10, 10, seed=3, shuffle=False).next_batch() == list(range(10))


def test_batches_cross_epoch_boundaries():
    s = EpochSampler(num_examples=5, batch_size=3, seed=1)
    batches = [s.next_batch() for _ in range(5)]  # 15 indices = 3 full epochs
    flat = sum(batches, [])
    for e in range(3):
        assert sorted(flat[5 * e : 5 * e + 5]) == list(range(5))
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 5


def test_resumed_sampler_continues_exactly():
    straight = EpochSampler(num_examples=7, batch_size=3, seed=11)
    first = [straight.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(straight.state_dict()))  # survives a round trip through a checkpoint file
    rest = [straight.next_batch() for _ in range(6)]

    resumed = EpochSampler(num_examples=7, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == rest
    assert first != rest[:4]


def test_sampler_refuses_a_different_dataset_or_seed():
    state = EpochSampler(num_examples=7, batch_size=3, seed=11).state_dict()
    with pytest.raises(ValueError, match="saved num_examples=7 but this run has num_examples=8"):
        EpochSampler(num_examples=8, batch_size=3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="saved seed=11"):
        EpochSampler(num_examples=7, batch_size=3, seed=12).load_state_dict(state)


def test_rows_pythons_parser_cannot_hold_are_skipped_as_malformed(tmp_path, tokenizer, caplog):
    """A line of 100,000 nested '[' raised RecursionError and a 5,000-digit integer "Exceeds the limit (4300
    digits)" naming neither file nor row, and the whole file was refused: each is one malformed row, counted and
    shown as the example like any other, and the good rows are kept."""
    deep = "[" * 100_000
    huge = json.dumps(row("big")).replace('"1"', "1" + "0" * 4_999)
    rows = [deep, row("abc"), huge, row("hello")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(RecursionError):  # the reference: the parser itself cannot hold these lines
        json.loads(deep)
    with pytest.raises(ValueError, match="4300 digits"):
        json.loads(huge)
    with caplog.at_level(logging.INFO, logger="mcore_rl.data.dataset"):
        ds = load_prompt_dataset(path, tokenizer, max_prompt_len=30)
    s = ds.summary
    assert (s.rows, s.kept, s.malformed) == (4, 2, 2) and [e.index for e in ds] == [1, 3]
    assert s.malformed_example == "row 0: not readable JSON (nested deeper than the parser's recursion limit)"
    assert "2 malformed rows skipped" in caplog.text
    only_huge = write_jsonl(tmp_path / "h.jsonl", [huge, row("abc")])
    assert load_prompt_dataset(only_huge, tokenizer, max_prompt_len=30).summary.malformed_example == (
        "row 0: not readable JSON (Exceeds the limit (4300 digits) for integer string conversion)"
    )
