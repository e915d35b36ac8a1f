"""A VLM multi-turn generate function written against slime's API, in the style of slime's
geo3k_vlm_multi_turn example: the environment module from ``--rollout-interaction-env-path``, the
processor from ``GenerateState``, the token ids (image pads expanded, as the processor gives them) sent
with every image so far, each observation encoded with the chat template and trimmed of a dummy
conversation, the processor's tensors of every turn merged at the end."""

import importlib.util
import json
from pathlib import Path

import torch
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine
from slime.utils.types import Sample

DUMMY_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
]


def load_env_module(path: str):
    spec = importlib.util.spec_from_file_location(f"rollout_env_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode_observation(state, message: dict, tools) -> tuple[list[int], list, dict | None]:
    dummy = state.tokenizer.apply_chat_template(DUMMY_MESSAGES, tools=tools, tokenize=False)
    full = state.tokenizer.apply_chat_template(
        DUMMY_MESSAGES + [message], tools=tools, tokenize=False, add_generation_prompt=True
    )
    trim = len(state.tokenizer.encode(dummy, add_special_tokens=False))
    images = [part["image"] for part in message["content"] if part.get("type") == "image"]
    output = state.processor(text=full, **build_processor_kwargs({"images": images}))
    train_inputs = {k: v for k, v in output.items() if k not in ("input_ids", "attention_mask")}
    return list(output["input_ids"][0])[trim:], images, train_inputs


def merge_train_inputs(chunks: list[dict]) -> dict | None:
    merged = {}
    for key in ("pixel_values", "image_grid_thw"):
        values = [c[key] for c in chunks if c and isinstance(c.get(key), torch.Tensor)]
        if values:
            merged[key] = torch.cat(values, dim=0)
    return merged or None


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    env = load_env_module(args.rollout_interaction_env_path).build_env(sample=sample, args=args)
    output = state.processor(text=sample.prompt, **build_processor_kwargs(sample.multimodal_inputs))
    chunks = [{k: v for k, v in output.items() if k not in ("input_ids", "attention_mask")}]
    images = list(sample.multimodal_inputs["images"])
    sample.tokens = list(output["input_ids"][0])
    params = dict(sampling_params)
    env.reset()
    try:
        for _ in range(args.max_turns):
            room = args.rollout_max_context_len - len(sample.tokens)
            if room <= 0:
                sample.status = Sample.Status.TRUNCATED
                break
            params["max_new_tokens"] = min(sampling_params["max_new_tokens"], room)
            payload = {
                "input_ids": sample.tokens,
                "image_data": [encode_image_for_rollout_engine(image) for image in images],
                "sampling_params": params,
                "return_logprob": True,
            }
            output = await post(url, payload)
            meta = output["meta_info"]
            sample.append_response_tokens(
                args,
                tokens=[item[1] for item in meta["output_token_logprobs"]],
                log_probs=[item[0] for item in meta["output_token_logprobs"]],
                trainable=True,
                meta_info=meta,
                text=output["text"],
            )
            if meta["finish_reason"]["type"] in ("length", "abort"):
                break
            observation, done, _ = env.step(output["text"])
            if done:
                break
            ids, new_images, train_inputs = encode_observation(
                state, env.format_observation(observation), sample.metadata.get("tools")
            )
            sample.append_response_tokens(args, tokens=ids, trainable=False)
            images += new_images
            chunks.append(train_inputs)
    finally:
        env.close()
    sample.multimodal_inputs = {"images": images}
    sample.multimodal_train_inputs = merge_train_inputs(chunks)
    with open(Path(args.log_dir) / "returned.jsonl", "a") as fh:
        row = {"step": sample.metadata["rollout_id"], "images": len(images), "tokens": len(sample.tokens)}
        fh.write(json.dumps(row) + "\n")
    return sample
