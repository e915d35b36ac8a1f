"""A rollout function and a single-turn generate function written against slime's API: the rollout
draws prompt groups from the data source, runs them through ``generate_and_rm_group`` (the run's
generate function, then its reward), and returns ``RolloutFnTrainOutput`` with metrics of its own; the
generate function sends token ids, as slime's default one does."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.http_utils import post
from slime.utils.types import Sample


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)

    async def run_all():
        return await asyncio.gather(
            *(generate_and_rm_group(args, g, state.sampling_params.copy(), evaluation=evaluation) for g in groups)
        )

    groups = run(run_all())
    lengths = [s.response_length for g in groups for s in g]
    return RolloutFnTrainOutput(samples=groups, metrics={"custom/response_length_max": max(lengths)})


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params["max_new_tokens"] -= sample.response_length
    if not sample.tokens:
        sample.tokens = prompt_ids
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    logprobs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in logprobs],
        log_probs=[item[0] for item in logprobs],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample
