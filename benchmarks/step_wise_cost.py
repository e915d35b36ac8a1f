"""Step-wise vs merged training cost for linear multi-turn trajectories.

    .venv/bin/python benchmarks/step_wise_cost.py

For trajectories of T turns (64-token prompt, 32 generated + 32 observation tokens per turn), prints
the tokens to forward step-wise (one sequence per turn: O(T^2)) vs merged (one sequence: O(T)), and
the measured forward time of both on the tiny Qwen2 model (median of 3).
"""

import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from slime_mt.assets import tiny_model_dir
from slime_mt.rollout.finalize import merge_step_wise, to_step_wise_samples
from slime_mt.types import Sample, Turn

PROMPT, OUT, OBS = 64, 32, 32


def trajectory(turns: int) -> Sample:
    g = torch.Generator().manual_seed(turns)
    ids = lambda n: torch.randint(100, 150000, (n,), generator=g).tolist()  # noqa: E731
    s = Sample(index=0, group_index=0, reward=1.0)
    s.set_prompt_tokens(ids(PROMPT))
    for k in range(turns):
        start = len(s.tokens)
        s.append_model_tokens(ids(OUT), [-1.0] * OUT)
        end = len(s.tokens)
        if k < turns - 1:
            s.append_observation_tokens(ids(OBS))
        s.turns.append(Turn(output_start=start, output_end=end, observation_end=len(s.tokens)))
    return s


def forward_seconds(model, sequences, repeats=3):
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for seq in sequences:
                model(torch.tensor([seq.prompt_ids + seq.response_ids]))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main():
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("qwen2"))).eval()
    print(f"{'turns':>5} {'step-wise tokens':>16} {'merged tokens':>13} {'token ratio':>11} "
          f"{'step-wise s':>11} {'merged s':>9} {'time ratio':>10}")
    for turns in (1, 2, 4, 8, 16, 32):
        steps = to_step_wise_samples([trajectory(turns)])
        merged = merge_step_wise(steps)
        count = lambda xs: sum(len(x.prompt_ids) + len(x.response_ids) for x in xs)  # noqa: E731
        t_steps, t_merged = forward_seconds(model, steps), forward_seconds(model, merged)
        print(f"{turns:>5} {count(steps):>16} {count(merged):>13} {count(steps) / count(merged):>10.1f}x "
              f"{t_steps:>11.3f} {t_merged:>9.3f} {t_steps / t_merged:>9.1f}x")


if __name__ == "__main__":
    main()
