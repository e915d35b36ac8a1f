"""Megatron checks run in their own processes (one process per TP rank, launched by the tests with
``torchrun`` or plain python for TP=1). Each check writes its numbers to ``--out`` as JSON / .pt;
the pytest side asserts on them. One launch runs many checks: importing megatron + transformers
costs ~10 s per process, so tests share launches.

    python megatron_worker.py --tp 1 --checks families,train --out DIR
"""

import argparse
import json
from pathlib import Path

import torch

from slime_mt.assets import smollm2_dir, tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.convert import load_hf_state, megatron_to_hf
from slime_mt.backends.megatron.packing import pack_row
from slime_mt.backends.megatron.parallel import init_parallel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample


def images():
    from PIL import Image, ImageDraw

    first = Image.new("RGB", (96, 64), (200, 30, 30))
    ImageDraw.Draw(first).line([(0, 0), (90, 60)], fill=(255, 255, 255), width=3)
    return [first, Image.new("RGB", (64, 112), (20, 90, 200))]


def sequences(path: Path, kind: str) -> list[TrainingSample]:
    """Two sequences per model: a text chat and (VLMs) a prompt with two images."""
    from slime_mt.processing import load_tokenizer_or_processor

    processor = load_tokenizer_or_processor(path)
    tokenizer = getattr(processor, "tokenizer", processor)
    out = []
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 times 7? Think briefly."}],
                                         tokenize=False, add_generation_prompt=True) + "12 times 7 is 84."
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    out.append(TrainingSample(ids[:-8], ids[-8:], [1] * 8, [-1.0] * 8, 1.0, "0/0", 0, True))
    if kind.endswith("-vl"):
        text = processor.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Compare with"}, {"type": "image"}]}], add_generation_prompt=True)
        inputs = processor(text=text + "The first is red.", images=images())
        ids = inputs["input_ids"][0].tolist()
        mm = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        out.append(TrainingSample(ids[:-5], ids[-5:], [1] * 5, [-1.0] * 5, 0.0, "0/1", 0, True,
                                  multimodal_train_inputs=mm))
    return out


def hf_logits(path: Path, sample: TrainingSample) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    if sample.multimodal_train_inputs:
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
        extra = dict(sample.multimodal_train_inputs, mm_token_type_ids=(ids == model.config.image_token_id).long())
    else:
        cls = AutoModelForImageTextToText if "vl" in path.name else AutoModelForCausalLM
        model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        extra = {}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]


def check_families(args, info, out):
    """Megatron logits vs transformers, and Megatron -> HF export equal to the checkpoint."""
    paths = {"smollm2": smollm2_dir(), **{k: tiny_model_dir(k) for k in ("qwen2", "qwen3", "qwen2.5-vl", "qwen3-vl")}}
    result = {}
    for kind, path in paths.items():
        actor = MegatronActor(str(path), TrainConfig(lr=1e-5), AlgoConfig(), info)
        diffs = []
        for sample in sequences(path, kind):
            row = pack_row([sample], [0], actor.policy.mrope_positions if hasattr(actor.policy, "mrope_positions") else None)
            with torch.no_grad():
                if hasattr(actor.policy, "mrope_positions"):
                    logits = actor.policy(row.tokens, row.position_ids, row.attention_mask,
                                          pixel_values=row.pixel_values, image_grid_thw=row.image_grid_thw)[0]
                else:
                    logits = actor.policy(row.tokens, row.position_ids, row.attention_mask)[0]
            diffs.append(float((logits[:, :actor.spec.vocab_size] - hf_logits(path, sample)).abs().max()))
        exported = actor.export_hf()
        source = load_hf_state(path)
        mismatched = [k for k in source if k not in exported or not torch.equal(source[k], exported[k])]
        extra = sorted(set(exported) - set(source))
        result[kind] = {"logit_max_abs_diff": diffs, "export_mismatched": mismatched, "export_extra": extra}
    out["families"] = result


def tp_batch(path) -> list[TrainingSample]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        prompt = torch.randint(100, 150000, (6 + i,), generator=g).tolist()
        response = torch.randint(100, 150000, (5,), generator=g).tolist()
        mask = [1, 1, 0, 1, 1]
        samples.append(TrainingSample(prompt, response, mask, [-11.9] * 5, float(i % 2), f"{i // 2}/{i}", i // 2, True))
    return samples


def check_tp(args, info, out):
    """Log-probs, entropies, loss and gradients (gathered, HF layout) and weights after one Adam step,
    saved so the test can compare TP=1 with TP=2."""
    from megatron.core import parallel_state

    for kind in ("qwen2", "qwen2.5-vl"):
        path = tiny_model_dir(kind)
        algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01, use_tis=True, tis_clip=2.0)
        # lr 1e-5 (RL scale): Adam turns near-zero gradients into lr-sized steps, so fp32 reduction-order
        # noise in them shows up in the weights in proportion to lr
        actor = MegatronActor(str(path), TrainConfig(lr=1e-5, clip_grad=1.0, micro_batch_size=2), algo, info,
                              temperature=0.8)
        samples = tp_batch(path)
        if kind.endswith("-vl"):
            samples = samples[:2] + [s for s in sequences(path, kind) if s.multimodal_train_inputs]
            samples[-1].group_id, samples[-1].trajectory_id = 1, "1/9"
        lp = actor.compute_logprobs(samples, with_entropy=True)
        advantages = [1.0, -1.0, 0.5, -0.5][: len(samples)]
        # gradients of one step: run the loss by hand to keep the grads before the optimizer applies them
        from slime_mt.algo.batching import reduction_weights
        from slime_mt.algo.losses import LossInputs, policy_loss

        weights = reduction_weights(samples, "token_mean")
        actor.model.zero_grad_buffer()
        loss_total, entropies = 0.0, []
        for row_indices in actor._rows(samples, list(range(len(samples)))):
            row = pack_row(samples, row_indices, actor.policy.mrope_positions if hasattr(actor.policy, "mrope_positions") else None)
            logp, entropy = actor._forward(actor.model, row, with_entropy=True)
            entropies.extend(entropy.tolist())
            cat = lambda xs: torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in xs])  # noqa: E731
            x = LossInputs(logp, logp.detach() + 0.01, cat([samples[i].rollout_log_probs for i in row.sample_index]),
                           cat([[advantages[i] * m for m in samples[i].loss_mask] for i in row.sample_index]),
                           cat([weights[i] for i in row.sample_index]), row.seq_ids, entropy=entropy)
            loss, _ = policy_loss(x, algo)
            loss.backward()
            loss_total += float(loss.detach())
        actor.model.finish_grad_sync()
        grads = {n: p.main_grad.clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
        hf_grads = megatron_to_hf(grads_as_state(actor, grads), actor.spec, info.tp_size,
                                  parallel_state.get_tensor_model_parallel_group(), prefix=actor.prefix)
        actor.optimizer.step()
        weights_after = actor.export_hf()
        if info.rank == 0:
            torch.save({"logprobs": [x.tolist() for x in lp], "entropy": entropies, "loss": loss_total,
                        "grads": hf_grads, "weights": weights_after}, Path(args.out) / f"tp{info.tp_size}_{kind}.pt")
    out["tp"] = "saved"


def grads_as_state(actor, grads):
    """Gradients laid out like the decoder state dict (the VLM's decoder params are under gpt.)."""
    prefix = "gpt." if hasattr(actor.policy, "gpt") else ""
    return {k[len(prefix):]: v for k, v in grads.items() if k.startswith(prefix)}


def check_engine_fidelity(args, info, out):
    """Log-probs the embedded engine sampled vs Megatron's recomputation of the same tokens."""
    import asyncio

    from slime_mt.engine.client import EngineClient
    from slime_mt.engine.server import LocalEngine
    from slime_mt.processing import load_tokenizer_or_processor

    result = {}
    for kind, path in (("smollm2", smollm2_dir()), ("qwen2.5-vl", tiny_model_dir("qwen2.5-vl"))):
        processor = load_tokenizer_or_processor(path)
        tokenizer = getattr(processor, "tokenizer", processor)
        prompts, image_data, mm = [], [], []
        for q in ("Name three fruits.", "What is the capital of Italy?"):
            if kind.endswith("-vl"):
                from slime_mt.engine.images import encode_image
                from slime_mt.engine.protocol import collapse_image_pads

                text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                      {"type": "text", "text": q}]}], add_generation_prompt=True)
                inputs = processor(text=text, images=images()[:1])
                prompts.append(inputs["input_ids"][0].tolist())
                image_data.append([encode_image(images()[0])])
                mm.append({"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]})
            else:
                prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                             add_generation_prompt=True))
                prompts[-1] = tokenizer(prompts[-1], add_special_tokens=False)["input_ids"]
                image_data.append(None)
                mm.append(None)
        with LocalEngine(path, seed=5) as engine:
            async def go():
                async with EngineClient(engine.url) as client:
                    reqs = []
                    for ids, imgs in zip(prompts, image_data):
                        engine_ids = collapse_image_pads(ids, processor.image_token_id)[0] if imgs else ids
                        reqs.append(client.generate(engine_ids, {"max_new_tokens": 24, "temperature": 0.8,
                                                                 "ignore_eos": True}, image_data=imgs))
                    return await asyncio.gather(*reqs)

            responses = asyncio.run(go())
        actor = MegatronActor(str(path), TrainConfig(), AlgoConfig(), info, temperature=0.8)
        samples = [TrainingSample(p, r["output_ids"], [1] * len(r["output_ids"]),
                                  [x[0] for x in r["meta_info"]["output_token_logprobs"]], 0.0, f"0/{i}", 0, True,
                                  multimodal_train_inputs=m)
                   for i, (p, r, m) in enumerate(zip(prompts, responses, mm))]
        recomputed = actor.compute_logprobs(samples)
        diffs = torch.cat([(lp - torch.tensor(s.rollout_log_probs)).abs() for lp, s in zip(recomputed, samples)])
        result[kind] = {"mean_abs_diff": float(diffs.mean()), "max_abs_diff": float(diffs.max())}
    out["engine_fidelity"] = result


def train_steps(actor, steps, start=0):
    from slime_mt.algo.advantages import compute_advantages

    for step in range(start, steps):
        samples = tp_batch(None)
        for s in samples:
            s.reward = float((step + s.group_id) % 2)
        actor.train(samples, compute_advantages(samples, "grpo"), prompts_per_step=1, on_policy=False)


def check_checkpoint(args, info, out):
    """4 steps straight vs 2 steps + save + resume + 2 steps: bitwise-equal weights; a save that dies
    midway leaves the previous checkpoint loadable."""
    path = str(tiny_model_dir("qwen2"))
    cfg = TrainConfig(lr=1e-3, micro_batch_size=2)
    straight = MegatronActor(path, cfg, AlgoConfig(), info)
    torch.manual_seed(0)
    train_steps(straight, 4)
    reference = {k: v.clone() for k, v in straight.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    del straight
    save_dir = Path(args.out) / "ckpt"
    first = MegatronActor(path, cfg, AlgoConfig(), info)
    torch.manual_seed(0)
    train_steps(first, 2)
    first.save(save_dir, {"data_cursor": 2})
    del first
    resumed = MegatronActor(path, cfg, AlgoConfig(), info)
    extra = resumed.load(save_dir)
    train_steps(resumed, 4, start=2)
    state = {k: v for k, v in resumed.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    bitwise = all(torch.equal(reference[k], state[k]) for k in reference)
    # a save that dies after writing part of its temp folder: latest still names iter 2 and loads
    original_save = torch.save

    def dying_save(obj, f, *a, **kw):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt("killed while saving")

    torch.save = dying_save
    try:
        resumed.save(save_dir, {"data_cursor": 4})
    except KeyboardInterrupt:
        pass
    finally:
        torch.save = original_save
    again = MegatronActor(path, cfg, AlgoConfig(), info)
    again_extra = again.load(save_dir)
    out["checkpoint"] = {"bitwise_equal": bitwise, "extra": extra, "after_killed_save": again_extra,
                         "latest": (save_dir / "latest").read_text(), "step": again.step}


CHECKS = {"families": check_families, "tp": check_tp, "engine_fidelity": check_engine_fidelity,
          "checkpoint": check_checkpoint}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--checks", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = init_parallel(args.tp, seed=1234)
    out = {}
    for name in args.checks.split(","):
        CHECKS[name](args, info, out)
    if info.rank == 0:
        (Path(args.out) / f"results_tp{args.tp}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
