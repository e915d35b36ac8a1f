"""One RL step scripted by hand, in one process: the in-process engine (``LocalEngine``) samples answers
through SGLang's ``/generate`` API, the Megatron actor scores them (``compute_logprobs``), takes this
rank's share of the batch (``share_of``), trains on it (``train``), exports its weights in Hugging Face
names (``export_hf``) and the engine serves them (``update_weights_from_tensors``).

    .venv/bin/python examples/scripting/one_step.py [--model DIR]

Without ``--model`` it runs on the tiny random Qwen2 the tests use (built in code, nothing downloaded).
Under ``torchrun`` the same script runs at TP or DP > 1: every rank builds the actor and trains its
share; ``export_hf`` returns the whole model on global rank 0 only, which serves it.
"""

from __future__ import annotations

import argparse

import httpx
import torch


def generate(url: str, prompt_ids: list[int], n: int, max_new_tokens: int = 16) -> list[dict]:
    """``n`` answers to one prompt, with their tokens' log-probs (SGLang's request and answer)."""
    body = {
        "input_ids": [prompt_ids] * n,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=120).json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: the tiny random Qwen2)")
    args = parser.parse_args()

    from slime_mt.assets import tiny_model_dir
    from slime_mt.backends.megatron.actor import MegatronActor
    from slime_mt.backends.megatron.parallel import init_parallel
    from slime_mt.config import AlgoConfig, TrainConfig
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of
    from slime_mt.types import TrainingSample

    model = args.model or str(tiny_model_dir("qwen2"))
    tokenizer = tokenizer_of(load_tokenizer_or_processor(model))
    messages = [{"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)

    info = init_parallel(tp_size=1, seed=1234)  # one process; under torchrun, its rank of the world
    actor = MegatronActor(model, TrainConfig(lr=1e-5, micro_batch_size=4), AlgoConfig(), info)

    with LocalEngine(model, seed=0) as engine:
        # 1. sample: four answers to one prompt, one GRPO group
        answers = generate(engine.url, prompt, n=4)
        samples = []
        for k, answer in enumerate(answers):
            ids = answer["output_ids"]
            logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
            reward = float("red" in answer["text"].lower())
            samples.append(TrainingSample(prompt, ids, [1] * len(ids), logprobs, reward, f"{k}", 0, True))

        # 2. score: the trainer's log-probs of the same tokens equal the engine's (same weights)
        trainer_logprobs = actor.compute_logprobs(samples)
        gap = max((t - torch.tensor(s.rollout_log_probs)).abs().max().item() for t, s in zip(trainer_logprobs, samples))
        print(f"trainer vs engine log-probs: largest gap {gap:.2e}")

        # 3. train: GRPO advantages (reward minus the group mean), this rank's share, one optimizer step
        rewards = [s.reward for s in samples]
        advantages = [r - sum(rewards) / len(rewards) for r in rewards]
        metrics = actor.train(actor.share_of(samples, advantages, prompts_per_step=1))
        print(f"trained: loss {metrics['train/loss']:.4f}, grad norm {metrics['train/grad_norm']:.4f}")

        # 4. serve the new weights: HF-named tensors from rank 0, into the engine, as version "1"
        weights = actor.export_hf()
        if info.rank == 0:
            engine.update_weights_from_tensors(weights, weight_version="1")
            after = generate(engine.url, prompt, n=1)[0]
            print(f"the engine serves version {after['meta_info']['weight_version']}: {after['text']!r}")


if __name__ == "__main__":
    main()
