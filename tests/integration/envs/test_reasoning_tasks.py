"""reasoning-gym tasks (envs/reasoning_tasks.py): a dataset of two families written and loaded back
through the project's data loader, each family's own verifier as the reward, and the environment on
a real engine."""

import asyncio

from rollout_helpers import make_ctx  # noqa: E402

from envs.reasoning_tasks import ReasoningTaskEnv, make_rows, score  # noqa: E402
from slime_mt.rollout.multi_turn import run_episode  # noqa: E402
from slime_mt.types import Sample, Status  # noqa: E402


def test_the_env_grades_each_turn_and_tells_a_wrong_answer(farm, tiny_paths):
    row = make_rows(["basic_arithmetic"], 1, 5)[0]
    env = ReasoningTaskEnv(row["metadata"])
    observation, done, info = env.step(f"<answer>{row['label']}</answer>")
    assert done and info == {"reward": 1.0}
    observation, done, info = env.step("<answer>not a number</answer>")
    assert not done and info == {"reward": 0.0} and "incorrect" in observation["text"]
    target = farm.target("q2rg-direct", tiny_paths["qwen2"])
    ctx = make_ctx(target.url, target.model_path, max_turns=2, rollout_max_response_len=8)
    sample = Sample(index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
    stops = list(range(3, 151643, 4)) + [151645]
    params = {"temperature": 1.0, "sampling_seed": 2, "stop_token_ids": stops, "max_new_tokens": 8}
    asyncio.run(run_episode(ctx, sample, params, env=ReasoningTaskEnv(row["metadata"])))
    sample.validate()
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
    texts = [ctx.tokenizer.decode(sample.tokens[t.output_start : t.output_end]) for t in sample.turns]
    assert [t.reward for t in sample.turns] == [score(text, row["metadata"]) for text in texts]
