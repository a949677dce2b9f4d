"""torchrun worker: every rank starts the vLLM engine through the external launcher (TP groups of `tp` ranks,
world / tp replicas), generates for the same prompts and scores them; rank 0 checks the gathered results
against a Hugging Face forward and that every rank got identical results; the trainer's path (generate_local:
the replica's share, no gather) gives the same samples as the gathered one.

usage: torchrun --nproc_per_node=N vllm_spmd.py --model-dir DIR --tp 2 --results DIR
Result per rank (tests/workers/harness.py): TP, replicas and the largest sampled / scored log-prob differences.
"""

import torch
import torch.distributed as dist

from tests.workers.harness import worker_args, write_result


def hf_logprobs(model_dir, sequences, prompt_lens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq, p in zip(sequences, prompt_lens):
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[p - 1 :, 0])
    return out


def main() -> None:
    args = worker_args(__doc__, model_dir=str, tp=int)
    model_dir, tp = args.model_dir, args.tp
    # The actor initialises torch.distributed first (gloo on CPU); vLLM joins that world.
    dist.init_process_group("gloo")
    from mcore_rl.config import RolloutConfig
    from mcore_rl.rollout import make_engine
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.data_parallel import generate_global, generate_local

    world = dist.get_world_size()
    engine = make_engine(RolloutConfig(engine="vllm", tp=tp), model_dir, dtype="float32", max_model_len=256)
    prompts = [[1, 44, 45, 46], [1, 50, 51], [1, 20, 21, 22, 23], [1, 30, 31]]
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    assert get_tensor_model_parallel_world_size() == tp, "vLLM did not form TP groups of rollout.tp ranks"
    assert engine.replicas.num_replicas == world // tp
    # generate_global hands the full list to an engine that splits it itself and gathers the results
    out = generate_global(engine, prompts, 2, SamplingParams(max_new_tokens=6), seed=7)
    assert [len(g) for g in out] == [2] * len(prompts)
    assert [g[0].prompt_ids for g in out] == prompts
    # the trainer's path (generate_local -> engine.generate_share): this replica's share only, the same samples
    local = generate_local(engine, prompts, 2, SamplingParams(max_new_tokens=6), seed=7)
    assert local.replicas == engine.replicas and local.prompts == engine.replicas.share(len(prompts))
    got = [[s.response_ids for s in g] for g in local.groups]
    assert got == [[s.response_ids for s in out[i]] for i in local.prompts], "generate_share differs from generate"
    samples = [s for g in out for s in g]
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    plens = [len(s.prompt_ids) for s in samples]
    scored = engine.score(seqs, plens)

    mine = ([s.response_ids for s in samples], [s.logprobs.tolist() for s in samples], [x.tolist() for x in scored])
    every = [None] * world
    dist.all_gather_object(every, mine)
    assert all(e == every[0] for e in every), "ranks disagree on the gathered results"
    ref = hf_logprobs(model_dir, seqs, plens)
    worst_sampled = max((s.logprobs - r).abs().max().item() for s, r in zip(samples, ref))
    worst_scored = max((x - r).abs().max().item() for x, r in zip(scored, ref))
    assert worst_sampled < 0.01 and worst_scored < 0.01, (worst_sampled, worst_scored)
    dist.barrier()
    engine.close()
    dist.destroy_process_group()
    write_result(args.results, tp=tp, replicas=world // tp, sampled_vs_hf=worst_sampled, scored_vs_hf=worst_scored)


if __name__ == "__main__":
    main()
