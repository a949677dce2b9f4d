"""The embedded engine against an independent reference: the HF model run on each full sequence, unpadded."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_rl.config import RolloutConfig
from mcore_rl.rollout import make_engine, sampling_params
from mcore_rl.rollout.base import SamplingParams
from mcore_rl.rollout.embedded import EmbeddedEngine

CONTENTS = ["hi", "what is 2+2?", "reverse abc", "x" * 17]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EmbeddedEngine(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(engine):
    out = []
    for c in CONTENTS:
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len({len(p) for p in out}) > 1  # different lengths: left padding is exercised
    return out


def hf_reference(model, sequence, prompt_len, temperature=1.0):
    """(log-probs of tokens >= prompt_len under softmax(logits/T), router top-k ids [S, L, k]) for one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_router_logits=True)
    logp = torch.log_softmax(out.logits[0].float() / temperature, -1)[:-1]
    logp = logp.gather(-1, torch.tensor(sequence[1:])[:, None]).squeeze(-1)[prompt_len - 1 :]
    k = model.config.num_experts_per_tok
    routes = torch.stack([torch.topk(r.float(), k, -1).indices for r in out.router_logits], 1)
    return logp, routes


def test_sampled_logprobs_and_routes_match_hf(engine, hf_model, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_new_tokens=24, seed=7)
    groups = engine.generate(prompts, 3, params)
    assert [len(g) for g in groups] == [3] * len(prompts)
    L, k = engine.num_moe_layers, engine.top_k_experts
    assert (L, k) == (2, 2)
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert s.prompt_ids == prompt
            assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == (len(s.response_ids),)
            ref_lp, ref_routes = hf_reference(hf_model, s.prompt_ids + s.response_ids, len(prompt), 0.8)
            assert (s.logprobs - ref_lp).abs().max().item() <= 1e-4
            assert s.routed_experts.dtype == torch.int16
            assert s.routed_experts.shape == (len(prompt) + len(s.response_ids), L, k)
            assert torch.equal(s.routed_experts.long().sort(-1).values, ref_routes.sort(-1).values)
            if s.finish_reason == "stop":
                assert s.response_ids[-1] == engine.eos_token_id
                assert engine.eos_token_id not in s.response_ids[:-1]
            else:
                assert s.finish_reason == "length" and len(s.response_ids) == 24
                assert engine.eos_token_id not in s.response_ids


def test_routes_off_same_samples_fewer_forwards(engine, tiny_model_dir, prompts):
    """Without route capture (the trainer's default outside R3): identical samples, no routes, and the
    last sampled token is not fed through the model (max_new_tokens=1: one forward instead of two)."""
    plain = EmbeddedEngine(tiny_model_dir, return_routed_experts=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, seed=3)
    forwards = {}
    for name, eng in (("routes", engine), ("plain", plain)):
        calls = []
        handle = eng.model.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        try:
            forwards[name] = (eng.generate(prompts, 2, params), len(calls))
        finally:
            handle.remove()
    (with_routes, n_routes), (without, n_plain) = forwards["routes"], forwards["plain"]
    assert (n_routes, n_plain) == (2, 1)
    for a, b in zip((s for g in with_routes for s in g), (s for g in without for s in g)):
        assert a.response_ids == b.response_ids and torch.equal(a.logprobs, b.logprobs)
        assert a.routed_experts is not None and b.routed_experts is None


def test_score_matches_hf(engine, hf_model, prompts):
    seqs = [p + list(range(5, 5 + 3 * i + 1)) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    scored = engine.score(seqs, lens, temperature=1.3)
    for s, p, got in zip(seqs, lens, scored):
        ref, _ = hf_reference(hf_model, s, p, 1.3)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4


def test_seeded_sampling_is_deterministic(engine, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)
    a = engine.generate(prompts, 4, params)
    b = engine.generate(prompts, 4, params)
    c = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=12))
    flat = lambda groups: [(s.response_ids, s.logprobs.tolist()) for g in groups for s in g]
    assert flat(a) == flat(b)
    assert [r for r, _ in flat(a)] != [r for r, _ in flat(c)]
    # the samples of one prompt differ from each other (n independent draws, not copies)
    assert len({tuple(s.response_ids) for s in a[0]}) > 1


def test_top_k_1_is_greedy_and_logprobs_are_unfiltered(engine, hf_model, prompts):
    """top_k only picks the token; the reported log-prob is log softmax(logits/T), not renormalised (would be 0)."""
    greedy = engine.generate(prompts[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    topk1 = engine.generate(prompts[:2], 2, SamplingParams(temperature=0.5, top_k=1, max_new_tokens=8, seed=1))
    nucleus = engine.generate(prompts[:2], 2, SamplingParams(temperature=0.5, top_p=1e-6, max_new_tokens=8, seed=1))
    for g, k1, nu in zip(greedy, topk1, nucleus):
        assert k1[0].response_ids == k1[1].response_ids == g[0].response_ids == nu[0].response_ids
        ref, _ = hf_reference(hf_model, g[0].prompt_ids + g[0].response_ids, len(g[0].prompt_ids), 0.5)
        assert (k1[0].logprobs - ref).abs().max().item() <= 1e-4
        assert k1[0].logprobs.max().item() < -1e-3


def test_sampled_tokens_respect_top_k_and_top_p(engine, hf_model, prompts):
    """Every drawn token lies in the top-k set / the nucleus of the HF model's temperature-scaled distribution."""
    cases = [
        (SamplingParams(temperature=1.5, top_k=3, max_new_tokens=12, seed=5), "k"),
        (SamplingParams(temperature=1.5, top_p=0.3, max_new_tokens=12, seed=5), "p"),
    ]
    for params, kind in cases:
        seen = set()
        for s in (s for g in engine.generate(prompts, 4, params) for s in g):
            seq = s.prompt_ids + s.response_ids
            with torch.no_grad():
                logits = hf_model(torch.tensor([seq])).logits[0].float() / params.temperature
            for t, token in enumerate(s.response_ids):
                row = logits[len(s.prompt_ids) - 1 + t]
                rank = int((row > row[token]).sum())  # tokens strictly more likely than the drawn one
                if kind == "k":
                    assert rank < 3
                else:
                    probs = torch.softmax(row, -1)
                    assert probs[probs > probs[token]].sum().item() < 0.3 + 1e-5
                seen.add(rank)
        assert len(seen) > 1  # not greedy: lower-ranked tokens were drawn too


def test_stop_tokens_end_responses(engine, prompts):
    stop_all = list(range(engine.config.vocab_size))
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=10, stop_token_ids=stop_all, seed=0))
    for s in (s for g in groups for s in g):
        assert len(s.response_ids) == 1 and s.finish_reason == "stop"
        assert s.routed_experts.shape[0] == len(s.prompt_ids) + 1


def test_bad_inputs_fail_with_clear_errors(engine, prompts):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 999]], 1, SamplingParams())
    with pytest.raises(ValueError, match="is empty"):
        engine.generate([[]], 1, SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        engine.generate([prompts[0]], 1, SamplingParams(max_new_tokens=600))
    with pytest.raises(ValueError, match="n=0"):
        engine.generate(prompts, 0, SamplingParams())
    with pytest.raises(ValueError, match="prompt_len"):
        engine.score([[1, 2, 3]], [3])


def test_load_weights_in_place_and_errors(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from mcore_rl.models.tiny import make_tiny_checkpoint

    other = make_tiny_checkpoint(tmp_path / "seed1", seed=1)
    engine = EmbeddedEngine(tiny_model_dir)
    params_before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    with safe_open(str(other / "model.safetensors"), "pt") as f:
        engine.load_weights((k, f.get_tensor(k)) for k in f.keys())
        with pytest.raises(KeyError, match="no weight named 'model.layers.0.mlp.gate.weights'"):
            engine.load_weights([("model.layers.0.mlp.gate.weights", f.get_tensor("model.layers.0.mlp.gate.weight"))])
        with pytest.raises(ValueError, match=r"got shape \(64, 8\), engine expects \(8, 64\)"):
            engine.load_weights([("model.layers.0.mlp.gate.weight", f.get_tensor("model.layers.0.mlp.gate.weight").T)])
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == params_before  # in place
    reference = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32).eval()
    seq = list(range(3, 40))
    ref, _ = hf_reference(reference, seq, 5)
    assert (engine.score([seq], [5])[0] - ref).abs().max().item() <= 1e-4


def test_make_engine_and_noop_sleep(tiny_model_dir, caplog):
    cfg = RolloutConfig(engine="embedded", temperature=0.7, top_k=5, max_new_tokens=4)
    engine = make_engine(cfg, tiny_model_dir)
    assert isinstance(engine, EmbeddedEngine)
    params = sampling_params(cfg, seed=3)
    assert (params.temperature, params.top_k, params.max_new_tokens, params.seed) == (0.7, 5, 4, 3)
    with caplog.at_level("INFO"):
        engine.sleep()
        engine.wake_up()
    assert sum("no-ops" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="rollout.engine='sglang'"):
        make_engine(RolloutConfig(engine="sglang"), tiny_model_dir)


def padded_vocab_model(src: str, out, extra: int = 32) -> str:
    """The tiny model with its vocabulary padded by `extra` rows beyond the tokenizer's 128 ids (config vocab_size
    160), as Qwen3's 151,936 rows pad its 151,669 tokens. The padded output rows are long random directions, so the
    model itself puts nearly all its probability on them."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(out)
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, scale in (("model.embed_tokens.weight", 0.02), ("lm_head.weight", 100.0)):
        w = weights[name]
        weights[name] = torch.cat([w, scale * torch.randn(extra, w.shape[1], generator=gen, dtype=w.dtype)])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += extra
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_padded_vocabulary_ids_are_never_sampled(tiny_model_dir, tmp_path, prompts):
    """Issue 31 defect 8: ids above the tokenizer's are masked before sampling (and before the returned log-probs,
    as vLLM's allowed_token_ids masks them); the reference is the HF model's logits cut to the tokenizer's ids."""
    path = padded_vocab_model(tiny_model_dir, tmp_path / "padded")
    engine = EmbeddedEngine(path, return_routed_experts=False, share_weights=False)
    assert (engine.config.vocab_size, len(engine.tokenizer)) == (160, 128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = hf(torch.tensor([prompts[0]])).logits[0, -1]
    assert torch.softmax(first, -1)[128:].sum() > 0.99  # unmasked, a draw would almost surely be a padded id
    for temperature in (1.0, 0.0):
        groups = engine.generate(prompts, 4, SamplingParams(temperature=temperature, max_new_tokens=6, seed=3))
        for prompt, group in zip(prompts, groups):
            for s in group:
                assert max(s.response_ids) < 128, s.response_ids
                with torch.no_grad():
                    logits = hf(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, :, :128].float()
                ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
                ref = ref.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
                assert (s.logprobs - ref).abs().max().item() <= 1e-4
                if temperature == 0:
                    assert s.response_ids[0] == int(logits[len(prompt) - 1].argmax())
    assert engine.sampled_vocab == 128


def test_partial_rollout_is_right(tiny_model_dir, tmp_path, prompts):
    """Interrupt a generation twice between decode steps, load other weights, continue: the tokens drawn before an
    update are kept (those an uninterrupted generation draws), each token records the version that drew it, and its
    log-prob is what a fresh engine scores for the sequence under that version's weights (its routes: what the HF
    model of that version routes). The second batch starts after both updates, wholly on the newest weights."""
    from safetensors.torch import load_file

    from mcore_rl.models.tiny import make_tiny_checkpoint

    folders = [tiny_model_dir] + [str(make_tiny_checkpoint(tmp_path / f"v{v}", seed=v)) for v in (1, 2)]
    scorers = [EmbeddedEngine(f, return_routed_experts=False, share_weights=False) for f in folders]
    models = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in folders]
    params = SamplingParams(temperature=0.9, max_new_tokens=20, seed=11)
    engine = EmbeddedEngine(tiny_model_dir, share_weights=False)
    engine.max_batch_tokens = 6 * (max(len(p) for p in prompts) + params.max_new_tokens)  # batches of 6 and 2 rows
    plain = [s for g in engine.generate(prompts, 2, params) for s in g]
    generation = engine.start(prompts, 2, params, version=0)
    assert not generation.advance(4)
    for version in (1, 2):
        engine.load_weights(load_file(f"{folders[version]}/model.safetensors").items())
        generation.weights_changed(version)
        generation.advance(5)
    assert generation.advance()
    samples = [s for g in generation.result() for s in g]
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(2)]
    first, second = samples[:6], samples[6:]
    lengths = [len(s.response_ids) for s in first]
    assert generation.interrupted == sum((n > 4) + (n > 9) for n in lengths) > 0
    for s, p in zip(first, plain):
        assert s.token_versions == ([0] * 4 + [1] * 5 + [2] * 11)[: len(s.response_ids)]
        assert s.response_ids[:4] == p.response_ids[:4] and torch.equal(s.logprobs[:4], p.logprobs[:4])
    assert all(s.token_versions == [2] * len(s.response_ids) for s in second)
    assert all(p.token_versions is None for p in plain)
    spans = 0
    for s in samples:
        seq, start, versions = s.prompt_ids + s.response_ids, len(s.prompt_ids), torch.tensor(s.token_versions)
        spans += len(set(s.token_versions)) > 1
        for v in set(s.token_versions):
            own = versions == v
            scored = scorers[v].score([seq], [start], 0.9)[0]
            assert (s.logprobs[own] - scored[own]).abs().max().item() <= 1e-4, (v, s.token_versions)
            _, routes = hf_reference(models[v], seq, start, 0.9)
            positions = torch.cat([torch.full((start,), v == s.token_versions[0]), own])  # prompt: the first version
            got, ref = s.routed_experts[positions].long(), routes[positions]
            assert torch.equal(got.sort(-1).values, ref.sort(-1).values), (v, s.token_versions)
            if v > 0:  # the check can tell the versions apart: the older weights score these tokens otherwise
                older = scorers[v - 1].score([seq], [start], 0.9)[0]
                assert (s.logprobs[own] - older[own]).abs().max().item() > 1e-3
    assert spans == sum(n > 4 for n in lengths)
