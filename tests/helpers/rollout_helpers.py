"""Helpers for rollout tests: a context over a real engine, a client that records its requests,
and small scripted environments."""

import argparse
import asyncio
import functools
import random
from pathlib import Path

from PIL import Image, ImageDraw

from envs.base import BaseInteractionEnv
from slime_mt.config import DataConfig, RolloutConfig
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.clients.vllm import VLLMClient
from slime_mt.errors import RetryableEnvError
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

# Real Qwen token ids that the chain models (``chain_model``) emit, and a tool-use conversation for them
THINK, END_THINK, EOT, NL, NL2 = 151667, 151668, 151645, 198, 271  # <think> </think> <|im_end|> "\n" "\n\n"
LET, ME, CHECK, CALLING, TOOL = 10061, 752, 1779, 48853, 5392
DIRECT, ANS, WER, ANSWER = 16027, 8099, 6566, 4226  # " ans" + "wer": a non-canonical split of " answer"
THINKING = {
    NL: [THINK],
    THINK: [LET],
    LET: [ME],
    ME: [CHECK],
    CHECK: [END_THINK],
    END_THINK: [NL2],
    NL2: [CALLING],
    CALLING: [TOOL],
    TOOL: [EOT],
}  # "<think>Let me check</think>\n\nCalling tool"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
PROMPT = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 17 * 23? Use the calculator."},
]
RESULTS = [{"text": f"partial result {k}"} for k in range(1, 4)]


class Recording:
    """A real client that keeps every /generate request and response for the assertions."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = []

    async def generate(self, input_ids=None, sampling_params=None, image_data=None, **kw):
        response = await super().generate(input_ids, sampling_params, image_data=image_data, **kw)
        self.calls.append(
            {
                "input_ids": list(input_ids),
                "image_data": list(image_data or []),
                "sampling_params": dict(sampling_params),
                "response": response,
            }
        )
        return response


class RecordingClient(Recording, EngineClient):
    """SGLang's API (embedded engines, sglang-router)."""


class RecordingVLLMClient(Recording, VLLMClient):
    """vLLM's API."""


@functools.cache
def processor_of(model_path: str):
    """The model folder's tokenizer or processor, loaded once per test process (a Qwen tokenizer
    takes about a second to load, and the rollout tests build hundreds of contexts; nothing mutates it)."""
    return load_tokenizer_or_processor(model_path)


def make_ctx(url, model_path, data=None, engine="local", **rollout) -> RolloutContext:
    ctx = RolloutContext(
        (RecordingVLLMClient if engine == "vllm" else RecordingClient)(url),
        processor_of(str(model_path)),
        RolloutConfig(**rollout),
        data or DataConfig(apply_chat_template=True),
        argparse.Namespace(),
    )
    ctx.args.rollout_context = ctx
    return ctx


REPO = Path(__file__).resolve().parents[2]


def train_in_megatron(tmp_path, payload: dict) -> dict:
    """One Megatron train step (TP=1, a real worker process) on a saved payload: {"path", "samples",
    "advantages"} and optionally "algo" and "prompts_per_step" (megatron_worker's train_file check)."""
    return train_in_megatron_check(tmp_path, "train_file", payload)


def train_in_megatron_check(tmp_path, check: str, payload: dict):
    """megatron_worker's ``check`` (TP=1, a real worker process) on a saved payload -> its result."""
    import torch
    from megatron_worlds import launch

    out = tmp_path / "samples.pt"
    torch.save(payload, out)
    return launch(1, 1, check, tmp_path, check, "--samples", str(out), timeout=900)[check]


def picture(seed):
    image = Image.new("RGB", (70 + 14 * seed, 56), (40 * seed % 256, 90, 160))
    ImageDraw.Draw(image).ellipse([5, 5, 40, 40], outline=(255, 255, 255))
    return image


def image_episode(farm, model_path, kind, turns, **rollout):
    """A tiny VLM episode of ``turns`` turns: ``picture(1)`` in the prompt, ``picture(k + 2)`` in the
    k-th observation; short outputs (every fifth token id stops). -> (ctx, sample), COMPLETED."""
    target = farm.target(f"{kind.replace('-', '').replace('.', '')}-direct", model_path)
    ctx = make_ctx(
        target.url,
        target.model_path,
        max_turns=turns,
        rollout_max_response_len=40,
        rollout_max_context_len=8192,
        rollout_stop_token_ids=list(range(3, 151643, 5)) + [EOT],
        **rollout,
    )
    prompt = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": picture(1)},
                {"type": "text", "text": "Describe the shapes you are shown."},
            ],
        }
    ]
    observations = [{"text": f"Now this one ({k}).", "images": [picture(k + 2)]} for k in range(turns - 1)]
    sample = Sample(index=0, group_index=0, prompt=prompt, metadata={"rollout_id": 0})
    asyncio.run(
        run_episode(
            ctx, sample, dict(ctx.sampling_params(), temperature=0.7), env=ScriptedEnv(observations, done_after=turns)
        )
    )
    assert sample.status == Status.COMPLETED and len(sample.turns) == turns, sample.metadata
    return ctx, sample


class ScriptedEnv(BaseInteractionEnv):
    """Answers every turn with the next scripted observation; done after ``len(script)`` steps."""

    def __init__(self, script, role="user", done_after=None, reward=1.0):
        self.script = list(script)
        self.observation_role = role
        self.done_after = done_after
        self.reward = reward
        self.steps = []
        self.closed = False

    def step(self, response_text):
        self.steps.append(response_text)
        k = len(self.steps)
        done = self.done_after is not None and k >= self.done_after
        obs = self.script[(k - 1) % len(self.script)]
        return obs, done, {"reward": self.reward if done else 0.0, "step": k}

    def close(self):
        self.closed = True


class FlakyEnv(BaseInteractionEnv):
    """Raises RetryableEnvError on ``p_retry`` of steps and hangs on ``p_hang`` (async), seeded."""

    def __init__(self, seed, p_retry=0.3, p_hang=0.05, turns=3):
        self.rng = random.Random(seed)
        self.p_retry, self.p_hang, self.turns = p_retry, p_hang, turns
        self.count = 0

    async def step(self, response_text):
        roll = self.rng.random()
        if roll < self.p_hang:
            await asyncio.sleep(3600)
        if roll < self.p_hang + self.p_retry:
            raise RetryableEnvError(f"tool server busy (roll {roll:.2f})")
        self.count += 1
        return {"text": f"ok {self.count}"}, self.count >= self.turns, {"reward": 1.0}


def chain_model(src, out, tokenizer_dir, transitions: dict[int, list[int]], logit: float = 40.0):
    """A copy of the tiny Qwen3 model at ``src`` whose next token depends only on the current one:
    ``transitions[a]`` lists the tokens that follow ``a`` (equally likely, each at ``logit`` against 0
    for every other token, so a sampled turn follows the chain). Attention and MLP outputs are zeroed,
    so the last hidden state is the normalised embedding of the current token; chain tokens embed as
    orthogonal unit directions and the (untied) output row of ``b`` points at each token it follows.
    The tokenizer files of ``tokenizer_dir`` (and its chat template file, if any) are copied beside
    the weights."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    _chain(model, model.model, transitions, logit)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if name != "chat_template.jinja" or (Path(tokenizer_dir) / name).is_file():
            shutil.copy(f"{tokenizer_dir}/{name}", f"{out}/{name}")
    return out


def chain_vlm(src, out, transitions: dict[int, list[int]], logit: float = 40.0):
    """``chain_model`` of a tiny VLM (Qwen2.5-VL): its language model made a chain, its vision tower as
    it is (images reach the model, and its output depends only on the current token); the processor,
    tokenizer and slime_mt's asset files of ``src`` copied beside the weights."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.float32)
    model.config.text_config.tie_word_embeddings = False
    _chain(model, model.model.language_model, transitions, logit)
    model.save_pretrained(out, safe_serialization=True)
    for path in Path(src).iterdir():
        if path.suffix != ".safetensors" and not (Path(out) / path.name).exists():
            shutil.copy(path, Path(out) / path.name)
    return out


def _chain(model, language_model, transitions: dict[int, list[int]], logit: float) -> None:
    import torch

    hidden = model.config.get_text_config().hidden_size
    tokens = sorted({t for a, nxt in transitions.items() for t in [a, *nxt]})
    assert len(tokens) <= hidden, f"{len(tokens)} chain tokens need a hidden size of at least that"
    model.config.tie_word_embeddings = False
    embed = language_model.embed_tokens
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(embed.weight))
        direction = {t: k for k, t in enumerate(tokens)}
        for t in tokens:
            embed.weight[t] = torch.nn.functional.one_hot(torch.tensor(direction[t]), hidden)
        language_model.norm.weight.fill_(1.0)
        for a, nxt in transitions.items():
            for b in nxt:  # normalised one-hot: sqrt(hidden) on direction a
                model.lm_head.weight[b, direction[a]] = logit / hidden**0.5
        for layer in language_model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
