"""Images through the gateway: a session on the tiny Qwen2.5-VL with an image in the first and the
third call."""

import base64
import io

import pytest
import torch
from gateway_helpers import engine_harness, openai
from PIL import Image

from slime_mt.assets import IMAGE_PAD_ID
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.rollout.finalize import finalize


def _data_uri(color: tuple[int, int, int], size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _user(text: str, image: str | None = None) -> dict:
    parts = [{"type": "text", "text": text}]
    if image is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {"role": "user", "content": parts}


@pytest.fixture(scope="module")
def vl_harness(tiny_paths):
    with engine_harness(tiny_paths["qwen2.5-vl"], ["--rollout-max-response-len", "8"], max_batch_size=8) as harness:
        yield harness


def test_images_in_the_first_and_third_call(vl_harness, tiny_paths, monkeypatch):
    sent = []
    generate = vl_harness.ctx.client.generate

    async def spy(input_ids=None, sampling_params=None, image_data=None, **kwargs):
        sent.append((list(input_ids), list(image_data or [])))
        return await generate(input_ids, sampling_params, image_data=image_data, **kwargs)

    monkeypatch.setattr(vl_harness.ctx.client, "generate", spy)
    first, second = _data_uri((200, 30, 30), (64, 56)), _data_uri((20, 180, 40), (56, 84))
    session, base_url = vl_harness.open()
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [_user("What is drawn?", first)]
    for user in (_user("And the colour?"), _user("And this one?", second)):
        answer = client.chat.completions.create(model="m", messages=messages, temperature=0.0)
        messages += [answer.choices[0].message.model_dump(exclude_none=True), user]
    client.chat.completions.create(model="m", messages=messages, temperature=0.0)
    vl_harness.close(session)

    assert [ids.count(IMAGE_PAD_ID) for ids, _ in sent] == [1, 1, 2]  # one pad per image to the engine
    assert [len(images) for _, images in sent] == [1, 1, 2]
    sample = session.sample
    sample.validate()
    assert [t.image_indices for t in sample.turns] == [[0], [0], [0, 1]]
    assert [t.context_ids for t in sample.turns] == [None, None, None]  # one sequence, images included
    processor = load_tokenizer_or_processor(str(tiny_paths["qwen2.5-vl"]))
    expected = processor(
        text="<|vision_start|><|image_pad|><|vision_end|>" * 2,
        images=[Image.open(io.BytesIO(base64.b64decode(u.split(",")[1]))).convert("RGB") for u in (first, second)],
    )
    sample.reward = 0.0
    steps, _ = finalize([sample], "step_wise", merge=False)
    rows = int(expected["image_grid_thw"][0].prod())
    assert torch.equal(steps[0].multimodal_train_inputs["image_grid_thw"], expected["image_grid_thw"][:1])
    assert torch.equal(steps[0].multimodal_train_inputs["pixel_values"], expected["pixel_values"][:rows])
    assert torch.equal(steps[2].multimodal_train_inputs["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(steps[2].multimodal_train_inputs["pixel_values"], expected["pixel_values"])
    for step in steps:  # pads in the training context: expanded, one run per image
        assert step.prompt_ids.count(IMAGE_PAD_ID) == int(
            step.multimodal_train_inputs["image_grid_thw"].prod(dim=-1).sum() // 4
        )
