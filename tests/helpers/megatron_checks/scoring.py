"""``scoring``: packed rows against one sequence at a time (the fused attention against Megatron's, prefix
trees against flat rows), the chunked log-probs against plain autograd, a 16k-token micro-batch on CUDA,
the engine's log-probs against the trainer's, and the routes a router replays (R3)."""

import json
from pathlib import Path

import torch

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    compare,
    images,
    matrix_batch,
    step_outputs,
)
from slime_mt.assets import smollm2_dir, tiny_model_dir
from slime_mt.backends.megatron import scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.model import MegatronModel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample


def check_attention(args, info, out):
    """Per family: the fused core attention vs Megatron's DotProductAttention on one packed row of the
    matrix batch (every sequence in it): log-probs, entropies, loss and this rank's gradient shards
    (largest differences over the TP ranks), and the layout each packs with."""
    result = {}
    for kind in LAUNCH.families:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        got = {
            attention: step_outputs(
                path,
                TrainConfig(lr=1e-5, micro_batch_size=len(samples), local_attention=attention),
                samples,
                ADVANTAGES,
                info,
            )
            for attention in ("fused", "megatron")
        }
        result[kind] = {
            **compare(got["fused"], got["megatron"], info),
            "sequences": len(samples),
            "fused_packs_segments": got["fused"]["segments"],
            "reference_packs_segments": got["megatron"]["segments"],
        }
    out["attention"] = result


def tree_batches(vocab: int) -> dict[str, list[TrainingSample]]:
    """(a) a GRPO group: 8 responses to one 40-token prompt; (b) step-wise strip_thinking steps: step k's
    prompt is the prompt and the earlier answers and observations (their thinking stripped), its
    response this turn's thinking and answer."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(40)
    group = [
        TrainingSample(prompt, r, [1] * 12, [-11.9] * 12, float(i % 3), f"0/{i}", 0, True)
        for i, r in enumerate(ids(12) for _ in range(8))
    ]
    steps, history = [], list(prompt)
    for k in range(4):
        thinking, answer, observation = ids(10), ids(4), ids(6)
        steps.append(
            TrainingSample(list(history), thinking + answer, [1] * 14, [-11.9] * 14, float(k == 3), "1/0", 1, k == 3)
        )
        history += answer + observation
    return {"grpo": group, "strip_thinking": steps}


def vlm_tree_batches(path: Path) -> dict[str, list[TrainingSample]]:
    """(a) two GRPO groups of 4 responses, to one prompt with image A and to the same text with image B;
    (b) three step-wise steps whose history grows by an image each turn (B, then A again) and whose
    thinking is stripped: the images they share are computed once, A's second showing included."""
    from slime_mt.processing import load_tokenizer_or_processor

    processor = load_tokenizer_or_processor(path)
    vocab = json.loads((Path(path) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    g = torch.Generator().manual_seed(4)
    ids = lambda n: torch.randint(100, min(vocab, 150000) - 100, (n,), generator=g).tolist()  # noqa: E731
    a, b = images()
    pad = "<|vision_start|><|image_pad|><|vision_end|>"

    def piece(text, image):
        inputs = processor(text=text, images=[image])
        return inputs["input_ids"][0].tolist(), inputs["pixel_values"], inputs["image_grid_thw"]

    def sample(prompt, parts, response, tid, group):
        mm = {"pixel_values": torch.cat([p[1] for p in parts]), "image_grid_thw": torch.cat([p[2] for p in parts])}
        return TrainingSample(
            list(prompt),
            response,
            [1] * len(response),
            [-11.9] * len(response),
            float(group),
            tid,
            group,
            True,
            multimodal_train_inputs=mm,
        )

    question = f"<|im_start|>user\n{pad}What is drawn?<|im_end|>\n<|im_start|>assistant\n"
    observation = f"<|im_end|>\n<|im_start|>user\n{pad}And now?<|im_end|>\n<|im_start|>assistant\n"
    prompt_a, prompt_b = piece(question, a), piece(question, b)
    group = [sample(p[0], [p], ids(6), f"{k}/{i}", k) for k, p in enumerate((prompt_a, prompt_b)) for i in range(4)]
    steps, history, parts = [], list(prompt_a[0]), [prompt_a]
    for image in (b, a, None):
        thinking, answer = ids(5), ids(3)
        steps.append(sample(history, list(parts), thinking + answer, "2/0", 2))
        if image is not None:
            obs = piece(observation, image)
            history += answer + obs[0]
            parts.append(obs)
    return {"vlm_grpo": group, "vlm_steps": steps}


def check_tree(args, info, out):
    """Per family and batch: prefix-tree packing vs the flat row: log-probs, entropies, loss and
    gradients, the tokens each forwards and the images each runs through the vision tower."""
    result = {}
    for kind in LAUNCH.families:
        path = tiny_model_dir(kind)
        vocab = json.loads((Path(path) / "config.json").read_text()).get("vocab_size", 151936)
        batches = vlm_tree_batches(path) if "-vl" in kind else tree_batches(vocab)
        for name, samples in batches.items():
            advantages = [0.5 - i / len(samples) for i in range(len(samples))]
            got = {
                tree: step_outputs(
                    path,
                    TrainConfig(lr=1e-5, micro_batch_size=len(samples), shared_prefix_training=tree),
                    samples,
                    advantages,
                    info,
                )
                for tree in (True, False)
            }
            result[f"{kind}/{name}"] = {
                **compare(got[True], got[False], info),
                "flat_tokens": got[False]["row_tokens"],
                "tree_tokens": got[True]["row_tokens"],
                "sums_before": got[True]["sums"]["tokens_before_sharing"],
                "sums_after": got[True]["sums"]["tokens_after_sharing"],
                "flat_images": got[False]["images"],
                "tree_images": got[True]["images"],
            }
    out["tree"] = result
    if "qwen3" not in LAUNCH.families:
        return
    # a token budget counts tree tokens: 40 + 12 k <= 100 puts five responses in a row (flat: one)
    group = tree_batches(1000)["grpo"]
    budget = {
        tree: scoring.micro_batches(
            MegatronModel(
                tiny_model_dir("qwen3"),
                TrainConfig(shared_prefix_training=tree, max_tokens_per_micro_batch=100),
                info,
                trainable=False,
            ),
            group,
            list(range(8)),
        )
        for tree in (True, False)
    }
    out["tree_rows"] = {"tree": [len(r) for r in budget[True]], "flat": [len(r) for r in budget[False]]}
    from slime_mt.errors import ModelConfigError

    refused = {}
    for kind, train in (("qwen3", TrainConfig(shared_prefix_training=True, local_attention="megatron")),):
        try:
            MegatronActor(str(tiny_model_dir(kind)), train, ALGO, info)
            refused[kind] = ""
        except ModelConfigError as e:
            refused[kind] = str(e)
    out["tree_refused"] = refused


def check_logprob_chunks(args, info, out):
    """Chunked log-probs and entropy (one autograd function per chunk, analytic backward) equal plain
    autograd through Megatron's output layer on the gathered logits, in values and in the gradients
    of the hidden rows and of the output weight; autograd never keeps a logits-sized tensor; a
    metric-only entropy has no graph and leaves the gradients as without it."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from slime_mt.backends.megatron.logprobs import hidden_logprobs

    actor = MegatronActor(str(tiny_model_dir("qwen2")), TrainConfig(), AlgoConfig(), info)
    weight, vocab = actor.policy.module.output_weight(), actor.spec.vocab_size
    g = torch.Generator().manual_seed(5)
    rows = 160  # chunks of 64, 64 and 32 rows
    hidden = torch.randn(rows, actor.spec.hidden_size, generator=g).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    scale = torch.rand(rows, generator=g)  # d loss / d log p per token

    def gradients(run):
        hidden.grad = None
        actor.policy.ddp.zero_grad_buffer()  # the DDP hook moves the weight's gradient into main_grad
        lp, ent = run()
        loss = (lp * scale).sum() + (0.1 * ent.sum() if ent is not None and ent.requires_grad else 0.0)
        loss.backward()
        return (
            lp.detach().double(),
            None if ent is None else ent.detach().double(),
            hidden.grad.clone(),
            weight.main_grad.clone(),
        )

    def reference():
        logits = gather_from_tensor_model_parallel_region(actor.policy.module.output_logits(hidden))[:, :vocab] / 0.7
        log_p = torch.log_softmax(logits.double(), dim=-1)  # float64: the reference's own rounding is not measured
        return log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)

    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr():  # the parameter itself costs nothing
            saved.append(t.numel())
        return t

    want = gradients(reference)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64))
    metric = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64, entropy_grad=False))
    with_metric_ent = hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64, entropy_grad=False)[1]
    none = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, False, chunk=64))
    # a padded vocabulary (the last 1000 rows of the weight are padding; at TP=2 in rank 1's slice)
    vocab -= 1000
    targets.clamp_(max=vocab - 1)
    padded = (
        gradients(reference),
        gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64)),
    )
    local_vocab = weight.shape[0]
    out[f"logprob_chunks_tp{info.tp_size}"] = {
        **{
            f"{name}{suffix}": float((b[k] - a[k]).abs().max())
            for suffix, (a, b) in (("", (want, got)), ("_padded", padded))
            for k, name in enumerate(("logprob_diff", "entropy_diff", "hidden_grad_diff", "weight_grad_diff"))
        },
        "weight_grad_max": float(want[3].abs().max()),
        "largest_saved": max(saved),
        "chunk_logits": 64 * local_vocab,
        "all_logits": rows * local_vocab,
        "metric_entropy_diff": float((metric[1] - want[1]).abs().max()),
        "metric_entropy_requires_grad": bool(with_metric_ent.requires_grad),
        "metric_grad_diff": max(float((metric[k] - none[k]).abs().max()) for k in (2, 3)),
        "no_entropy_is_none": none[1] is None,
    }


def check_long_micro_batch(args, info, out):
    """On CUDA without Transformer Engine, bf16: one micro-batch of 16,384 tokens (two GRPO groups of 8
    responses of 512 tokens to a 512-token prompt) trains through the fused attention, as a flat
    packed row and as a prefix tree (flex_attention); Megatron's own attention is tried on the same
    micro-batch. Per variant: the row's tokens, loss, gradient norm, seconds and peak GPU memory."""
    import gc
    import time

    path = smollm2_dir()
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(5)
    samples = []
    for group in range(2):
        prompt = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
        for i in range(8):
            response = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
            samples.append(
                TrainingSample(prompt, response, [1] * 512, [-10.0] * 512, float(i % 2), f"{group}/{i}", group, True)
            )
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    variants = {
        "fused": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384),
        "tree": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384, shared_prefix_training=True),
        "megatron": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384, local_attention="megatron"),
    }
    result = {}
    for name, train in variants.items():
        actor = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
            rows = scoring.micro_batches(actor.policy, samples, list(range(len(samples))))
            row = scoring.pack(actor.policy, samples, rows[0])
            started = time.perf_counter()
            metrics = actor.train(actor.share_of(samples, advantages, 2))
            torch.cuda.synchronize()
            result[name] = {
                "rows": len(rows),
                "row_tokens": row.num_real_tokens,
                "layout": type(row.attention_mask).__name__,
                "loss": metrics["train/loss"],
                "grad_norm": metrics["train/grad_norm"],
                "seconds": time.perf_counter() - started,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        except torch.cuda.OutOfMemoryError as e:
            result[name] = {"oom": str(e).splitlines()[0], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        del actor
    out["long_micro_batch"] = result


def check_engine_fidelity(args, info, out):
    """Log-probs the embedded engine sampled vs Megatron's recomputation of the same tokens."""
    import asyncio

    from slime_mt.engine.clients.sglang import EngineClient
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.engine.images import encode_image
    from slime_mt.engine.protocol import collapse_image_pads
    from slime_mt.processing import load_tokenizer_or_processor

    result = {}
    for kind, path in (("smollm2", smollm2_dir()), ("qwen2.5-vl", tiny_model_dir("qwen2.5-vl"))):
        processor = load_tokenizer_or_processor(path)
        tokenizer = getattr(processor, "tokenizer", processor)
        prompts, image_data, mm = [], [], []
        for q in ("Name three fruits.", "What is the capital of Italy?"):
            if kind.endswith("-vl"):
                text = processor.apply_chat_template(
                    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                    add_generation_prompt=True,
                )
                inputs = processor(text=text, images=images()[:1])
                prompts.append(inputs["input_ids"][0].tolist())
                image_data.append([encode_image(images()[0])])
                mm.append({"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]})
            else:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
                image_data.append(None)
                mm.append(None)
        with LocalEngine(path, seed=5) as engine:

            async def go(prompts, image_data, processor):
                async with EngineClient(engine.url) as client:
                    reqs = []
                    for ids, imgs in zip(prompts, image_data):
                        engine_ids = collapse_image_pads(ids, processor.image_token_id)[0] if imgs else ids
                        reqs.append(
                            client.generate(
                                engine_ids,
                                {"max_new_tokens": 24, "temperature": 0.8, "ignore_eos": True},
                                image_data=imgs,
                            )
                        )
                    return await asyncio.gather(*reqs)

            responses = asyncio.run(go(prompts, image_data, processor))
        actor = MegatronActor(str(path), TrainConfig(), AlgoConfig(), info, temperature=0.8)
        samples = [
            TrainingSample(
                p,
                r["output_ids"],
                [1] * len(r["output_ids"]),
                [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                0.0,
                f"0/{i}",
                0,
                True,
                multimodal_train_inputs=m,
            )
            for i, (p, r, m) in enumerate(zip(prompts, responses, mm))
        ]
        recomputed = actor.compute_logprobs(samples)
        diffs = torch.cat([(lp.cpu() - torch.tensor(s.rollout_log_probs)).abs() for lp, s in zip(recomputed, samples)])
        result[kind] = {"mean_abs_diff": float(diffs.mean()), "max_abs_diff": float(diffs.max())}
    out["engine_fidelity"] = result


def _replayed(actor, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's log-probs and the experts every MoE layer's router used ``[tokens, moe_layers, k]``."""
    from slime_mt.backends.megatron.moe import moe_layers

    layers = moe_layers(actor.policy.module)
    for layer in layers:
        layer.router.router_replay.chosen = []
    with torch.no_grad():
        lp, _ = scoring.row_outputs(
            actor.policy, scoring.pack(actor.policy, [sample], [0]), scoring.LogProbs(TEMPERATURE)
        )
    chosen = torch.stack([torch.cat(layer.router.router_replay.chosen) for layer in layers], 1)
    for layer in layers:
        layer.router.router_replay.chosen = None
    return lp, chosen


def check_replay_file(args, info, out):
    """R3 on samples a test saved (``--samples``: {"path", "samples"} with the engine's routes): for
    each, the experts the trainer's routers used against the engine's rows, the routes where its own
    router differs, and the same with random routes (the replay takes them, and the log-probs move)."""
    import dataclasses as dc

    saved = torch.load(args.samples, weights_only=False)
    actor = MegatronActor(saved["path"], TrainConfig(use_rollout_routing_replay=True), ALGO, info, TEMPERATURE)
    g = torch.Generator().manual_seed(0)
    results = []
    for sample in saved["samples"]:
        routes = sample.routed_experts
        lp, chosen = _replayed(actor, sample)
        rows = len(routes)
        picked = chosen[:rows].sort(-1).values
        engine = routes.long().sort(-1).values
        e, k = actor.spec.moe.num_experts, actor.spec.moe.topk
        shuffled = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows * routes.shape[1])])
        shuffled = shuffled.reshape(routes.shape).to(routes.dtype)
        random_lp, random_chosen = _replayed(actor, dc.replace(sample, routed_experts=shuffled))
        _, own = _replayed(actor, dc.replace(sample, routed_experts=None))
        results.append(
            {
                "tokens": len(sample.tokens),
                "rows": rows,
                "rows_equal": int((picked == engine).all(-1).all(-1).sum()),
                "own_differs": int((own[:rows].sort(-1).values != engine).any(-1).sum()),
                "random_taken": bool(
                    torch.equal(random_chosen[:rows].sort(-1).values, shuffled.long().sort(-1).values)
                ),
                "random_logprob_shift": float((random_lp - lp).abs().max()),
            }
        )
    out["replay_file"] = results


def check_replay_gap(args, info, out):
    """bf16 on both sides, samples a bf16 engine generated with their routes (``--samples``): the
    train-vs-rollout log-prob gap on the generated tokens with the engine's routes replayed and with the
    trainer routing itself, and the (token, layer) routes where its router differs from the engine's."""
    import dataclasses as dc

    saved = torch.load(args.samples, weights_only=False)
    train = TrainConfig(bf16=True, use_rollout_routing_replay=True, log_routing_replay_gap=True)
    actor = MegatronActor(saved["path"], train, ALGO, info, saved.get("temperature", TEMPERATURE))
    gaps = {"replay": [], "own": []}
    differs = routes = 0
    for sample in saved["samples"]:
        rollout = torch.tensor(sample.rollout_log_probs)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        replayed, _ = _replayed(actor, sample)
        own_lp, own = _replayed(actor, dc.replace(sample, routed_experts=None))
        gaps["replay"].append((replayed.float().cpu() - rollout)[mask].abs())
        gaps["own"].append((own_lp.float().cpu() - rollout)[mask].abs())
        rows = len(sample.routed_experts)
        engine = sample.routed_experts.long().sort(-1).values
        differs += int((own[:rows].sort(-1).values != engine).any(-1).sum())
        routes += engine.shape[0] * engine.shape[1]
    out["replay_gap"] = {
        **{f"{k}_max": float(torch.cat(v).max()) for k, v in gaps.items()},
        **{f"{k}_mean": float(torch.cat(v).mean()) for k, v in gaps.items()},
        "routes": routes,
        "own_router_differs": differs,
    }
    # a training step logs both gaps (token-mean weights: the mean gaps) and the routes that differ
    samples = saved["samples"]
    step = actor.train(actor.share_of(samples, [1.0, -1.0] * (len(samples) // 2), len(samples)))
    out["replay_gap"]["step"] = {k: v for k, v in step.items() if "rollout_logprob" in k or "routing_replay" in k}


CHECKS = {
    "attention": check_attention,
    "tree": check_tree,
    "logprob_chunks": check_logprob_chunks,
    "long_micro_batch": check_long_micro_batch,
    "engine_fidelity": check_engine_fidelity,
    "replay_file": check_replay_file,
    "replay_gap": check_replay_gap,
}
