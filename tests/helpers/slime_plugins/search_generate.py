"""A search agent written against slime's API, in the style of slime's Search-R1 example: the context
goes to the engine as text (the prompt and the response so far), the search tool's answer is appended
as non-trainable tokens, and ``reward_func`` grades the final <answer> by exact match (partial credit
by the response's length, so a random model's rewards differ)."""

import json
import re
from pathlib import Path

from qa_em import em_score
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_TURNS = 3
CORPUS = {
    "capital of france": "Paris is the capital and largest city of France.",
    "tallest mountain": "Mount Everest is Earth's highest mountain above sea level.",
}


def search(query: str) -> str:
    hits = [text for key, text in CORPUS.items() if key in query.lower()]
    return "\n".join(hits) or "No result."


def next_observation(response: str) -> tuple[str, bool]:
    match = re.search(r"<(search|answer)>(.*?)</\1>", response, re.DOTALL)
    if match and match.group(1) == "answer":
        return "", True
    if match:
        return f"\n\n<information>{search(match.group(2))}</information>\n\n", False
    # glued to the model's last word, as a hurried plug-in does: re-tokenizing the text merges across it
    return "Invalid action. Search with <search> query </search> or answer with <answer>.\n", False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_text = sample.prompt
    sample.tokens = state.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response = ""
    for _ in range(MAX_TURNS):
        payload = {"text": prompt_text + response, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        sample.append_response_tokens(
            args, tokens=ids, log_probs=log_probs, trainable=True, meta_info=output["meta_info"], text=output["text"]
        )
        response += output["text"]
        if output["meta_info"]["finish_reason"]["type"] == "length":
            break
        observation, done = next_observation(output["text"])
        if done:
            break
        observation_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=observation_ids, trainable=False, text=observation)
        response += observation
    return sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    score = em_score(sample.response, [sample.label]) or 0.2 * (len(sample.response) % 7) / 6
    with open(Path(args.log_dir) / "rewards.jsonl", "a") as fh:
        fh.write(json.dumps({"step": sample.metadata["rollout_id"], "reward": score}) + "\n")
    return score
