"""Step-wise vs merged training cost for multi-turn trajectories.

    .venv/bin/python benchmarks/step_wise_cost.py

For trajectories of T turns (64-token prompt, 32 generated + 32 observation tokens per turn), prints
the tokens to forward step-wise (one sequence per turn: O(T^2)) vs merged (one sequence: O(T)), and
the measured forward time of both on the tiny Qwen2 model (median of 3).

Then the same trajectories when the first 24 of each turn's 32 tokens are thinking that
``--context-policy strip_thinking`` removes from later contexts: turn k's context is the prompt and
the earlier turns' answers and observations, which does not extend turn k-1's context + output, so
no step merges. Printed: tokens (and forward time) under ``append`` + merge vs ``strip_thinking``
step-wise, the cost shared-prefix training is to cut.
"""

import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from slime_mt.assets import tiny_model_dir
from slime_mt.rollout.finalize import merge_step_wise, to_step_wise_samples
from slime_mt.types import Sample, Turn

PROMPT, OUT, OBS, THINKING = 64, 32, 32, 24


def trajectory(turns: int, strip_thinking: bool = False) -> Sample:
    """A linear trajectory; ``strip_thinking``: each turn's context is recorded as the prompt plus the
    earlier turns without their first THINKING output tokens, as that policy would send it."""
    g = torch.Generator().manual_seed(turns)
    ids = lambda n: torch.randint(100, 150000, (n,), generator=g).tolist()  # noqa: E731
    s = Sample(index=0, group_index=0, reward=1.0)
    s.set_prompt_tokens(ids(PROMPT))
    stripped = list(s.tokens)
    for k in range(turns):
        start = len(s.tokens)
        s.append_model_tokens(ids(OUT), [-1.0] * OUT)
        end = len(s.tokens)
        if k < turns - 1:
            s.append_observation_tokens(ids(OBS))
        context = list(stripped) if strip_thinking and k > 0 else None
        s.turns.append(Turn(output_start=start, output_end=end, observation_end=len(s.tokens), context_ids=context))
        stripped += s.tokens[start + THINKING : len(s.tokens)]
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


def count(sequences) -> int:
    return sum(len(x.prompt_ids) + len(x.response_ids) for x in sequences)


def main():
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("qwen2"))).eval()
    print(
        f"{'turns':>5} {'step-wise tokens':>16} {'merged tokens':>13} {'token ratio':>11} "
        f"{'step-wise s':>11} {'merged s':>9} {'time ratio':>10}"
    )
    for turns in (1, 2, 4, 8, 16, 32):
        steps = to_step_wise_samples([trajectory(turns)])
        merged = merge_step_wise(steps)
        t_steps, t_merged = forward_seconds(model, steps), forward_seconds(model, merged)
        print(
            f"{turns:>5} {count(steps):>16} {count(merged):>13} {count(steps) / count(merged):>10.1f}x "
            f"{t_steps:>11.3f} {t_merged:>9.3f} {t_steps / t_merged:>9.1f}x"
        )
    print(f"\n{THINKING} of each turn's {OUT} tokens are thinking: append + merge vs strip_thinking step-wise")
    print(
        f"{'turns':>5} {'append+merge':>12} {'strip steps':>11} {'after merge':>11} {'token ratio':>11} "
        f"{'append s':>8} {'strip s':>8} {'time ratio':>10}"
    )
    for turns in (1, 2, 4, 8, 16, 32):
        appended = merge_step_wise(to_step_wise_samples([trajectory(turns)]))
        steps = to_step_wise_samples([trajectory(turns, strip_thinking=True)])
        unmerged = merge_step_wise(steps)
        assert len(unmerged) == len(steps), "a strip_thinking step merged"
        t_append, t_strip = forward_seconds(model, appended), forward_seconds(model, steps)
        print(
            f"{turns:>5} {count(appended):>12} {count(steps):>11} {len(unmerged):>11} "
            f"{count(steps) / count(appended):>10.1f}x {t_append:>8.3f} {t_strip:>8.3f} {t_strip / t_append:>9.1f}x"
        )


if __name__ == "__main__":
    main()
