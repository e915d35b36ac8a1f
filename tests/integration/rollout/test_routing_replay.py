"""Rollout routing replay (R3) end to end for a multi-turn VLM trajectory (integration tier, ~15 s: a
Qwen3-VL-MoE engine, a 3-turn episode with an image per turn, one Megatron process), and in bf16 with
near-tied routers (~15 s), where a training step logs the gap with and without replay. The engine's
routes ride with the tokens through every turn (observation tokens too, from the next turn's prefill)
and into concat, step-wise and merged samples and a dump; the trainer's routers then use exactly those
experts for every token and layer, and replaying other routes moves the log-probs."""

import asyncio
import json
import shutil

import httpx
import torch
from rollout_helpers import EOT, ScriptedEnv, make_ctx, picture, train_in_megatron_check
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.inspection.dumps import load_dump, samples_of, save_dump, train_batch_of
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.routes import RouteLayout
from slime_mt.types import Sample, Status, TrainBatch, TrainingSample

TURNS = 3


def _episode(engine, path, layout):
    ctx = make_ctx(
        engine.url,
        path,
        max_turns=TURNS,
        rollout_max_response_len=24,
        rollout_max_context_len=8192,
        rollout_stop_token_ids=list(range(3, 151643, 5)) + [EOT],
    )
    ctx.route_layout = layout
    prompt = [
        {
            "role": "user",
            "content": [{"type": "image", "image": picture(1)}, {"type": "text", "text": "Describe the shapes."}],
        }
    ]
    observations = [{"text": f"Now this one ({k}).", "images": [picture(k + 2)]} for k in range(TURNS - 1)]
    sample = Sample(index=0, group_index=0, prompt=prompt, metadata={"rollout_id": 0})
    env = ScriptedEnv(observations, done_after=TURNS)
    asyncio.run(run_episode(ctx, sample, dict(ctx.sampling_params(), temperature=0.7), env=env))
    assert sample.status == Status.COMPLETED and len(sample.turns) == TURNS, sample.metadata
    return sample


def _reference(path, layout: RouteLayout, sample: Sample) -> torch.Tensor:
    """transformers' routing of the whole trajectory in one forward pass (every image in place)."""
    model = AutoModelForImageTextToText.from_pretrained(str(path), experts_implementation="eager").eval()
    ids = torch.tensor([sample.tokens[:-1]])
    mm = sample.multimodal_train_inputs
    with torch.no_grad():
        out = model(
            input_ids=ids,
            pixel_values=mm["pixel_values"],
            image_grid_thw=mm["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).long(),
            output_router_logits=True,
        )
    logits = [lg for lg in out.router_logits if lg is not None]
    return torch.stack([lg.topk(layout.top_k, dim=-1).indices for lg in logits], 1).sort(-1).values


def test_a_multi_turn_vlm_trajectory_replays_the_engines_routes_for_every_token_and_layer(tiny_paths, tmp_path):
    path = tiny_paths["qwen3-vl-moe"]
    layout = RouteLayout.of(json.loads((path / "config.json").read_text()))
    with LocalEngine(path) as engine:
        sample = _episode(engine, path, layout)
    routes = sample.routed_experts
    # every processed token has its row (the observations' from the next turn's prefill): all but the last
    assert routes.dtype == torch.uint8 and routes.shape == (len(sample.tokens) - 1, 1, 2)
    assert torch.equal(routes.long().sort(-1).values, _reference(path, layout, sample))
    concat, _ = finalize([sample], "concat", merge=False)
    # a dump keeps them, in the trajectory and in what it trained
    dump = save_dump(tmp_path / "dump.pt", 0, [[sample]], TrainBatch(concat, [1.0], {}, {}, 0.0, 0.0, {}, [0], ""), {})
    loaded = load_dump(dump)
    again, trained_again = samples_of(loaded)[0], train_batch_of(loaded).samples[0]
    assert torch.equal(again.routed_experts, routes) and again.routed_experts.dtype == torch.uint8
    assert torch.equal(trained_again.routed_experts, routes)
    steps, _ = finalize([sample], "step_wise", merge=False)
    merged, _ = finalize([sample], "step_wise", merge=True)
    assert len(steps) == TURNS and len(merged) == 1
    for trained in concat + steps + merged:
        n = len(trained.tokens)
        assert torch.equal(trained.routed_experts, routes[:n]), n
    # the trainer's routers use the engine's experts for every routed token and layer
    results = train_in_megatron_check(tmp_path, "replay_file", {"path": str(path), "samples": concat + steps})
    for trained, r in zip(concat + steps, results):
        assert r["rows"] == len(trained.routed_experts) and r["rows_equal"] == r["rows"], r
        assert r["random_taken"] and r["random_logprob_shift"] > 1e-4, r
    assert results[0]["own_differs"] == 0  # fp32 on both sides: the router agrees without replay


def _near_tied(source, out, spread: float = 0.01):
    """``source`` with every router's experts nearly tied: each row one shared vector plus ``spread``
    of its size in noise, so bf16 rounding decides between experts."""
    shutil.copytree(source, out)
    state = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith("mlp.gate.weight")]:
        shared = 0.05 * torch.randn(state[name].shape[1], generator=g)
        state[name] = shared[None] + spread * 0.05 * torch.randn(state[name].shape, generator=g)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_bf16_near_tied_routers_replay_shrinks_the_train_rollout_gap(tiny_paths, tmp_path):
    """A bf16 engine (transformers: router in bf16) and a bf16 trainer (Megatron: router in fp32) route
    near-tied tokens differently; replaying the engine's routes brings training's log-probs back to
    the rollout's. Figures of one run (docs/performance.md): max gap 0.0295 -> 0.0025, mean 0.0037 -> 0.0005."""
    path = _near_tied(tiny_paths["qwen3-moe"], tmp_path / "near_tied")
    layout = RouteLayout.of(json.loads((path / "config.json").read_text()))
    g = torch.Generator().manual_seed(0)
    samples = []
    with LocalEngine(path, dtype=torch.bfloat16) as engine:
        for i in range(4):
            prompt = torch.randint(100, 150000, (12 + 3 * i,), generator=g).tolist()
            sampling = {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": i}
            body = {
                "input_ids": prompt,
                "return_logprob": True,
                "return_routed_experts": True,
                "sampling_params": sampling,
            }
            r = httpx.post(f"{engine.url}/generate", json=body, timeout=120).json()
            logprobs = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
            routes = layout.decode(r["meta_info"]["routed_experts"])
            ids = r["output_ids"]
            samples.append(
                TrainingSample(prompt, ids, [1] * len(ids), logprobs, 0.0, f"0/{i}", 0, True, routed_experts=routes)
            )
    payload = {"path": str(path), "samples": samples, "temperature": 0.8}
    r = train_in_megatron_check(tmp_path, "replay_gap", payload)
    print("bf16 near-tied routers, train-vs-rollout log-prob gap:", r)
    assert r["own_router_differs"] > 0.05 * r["routes"], r  # the routers do disagree
    assert r["replay_max"] < 0.5 * r["own_max"] and r["replay_mean"] < 0.5 * r["own_mean"], r
    # the step's metrics (--log-routing-replay-gap): both gaps as measured above, and the routes that differ
    step = r["step"]
    assert abs(step["train/train_rollout_logprob_abs_diff"] - r["replay_mean"]) < 1e-4, r
    assert abs(step["train/train_rollout_logprob_abs_diff_without_replay"] - r["own_mean"]) < 1e-4, r
    assert step["train/routing_replay_mismatch_frac"] == r["own_router_differs"] / r["routes"], r
