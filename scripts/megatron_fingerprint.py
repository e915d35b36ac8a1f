"""The Megatron backend's fingerprint: what a refactor of ``backends/megatron`` must leave bit for bit.

On three fixed worlds it records the log-probs of a batch before and after two train steps, the train
metrics of each step and the HF weights exported after them (one SHA-256 per tensor), through the
actor's public API (``MegatronActor``, ``share_of``, ``train``, ``compute_logprobs``, ``export_hf``):

  tp2pp2_dense     Qwen3, TP=2 x PP=2 (4 ranks), sequence parallel, a KL term against the frozen reference
  ep2_moe_r3       Qwen3-MoE, EP=2 (2 ranks), the engine's routes replayed (R3), the load-balancing loss
  cp2_vlm_distopt  Qwen2.5-VL, CP=2 (2 ranks), the distributed optimizer, an image sample in the batch

The second step takes two mini-batches, so the old log-probs are recomputed. Run it before a change and
after it, on the same machine:

    python scripts/megatron_fingerprint.py --out before.json
    python scripts/megatron_fingerprint.py --out after.json --compare before.json   # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (kind, ranks, init_parallel sizes, TrainConfig fields, AlgoConfig fields)
WORLDS = {
    "tp2pp2_dense": (
        "qwen3",
        4,
        dict(tp_size=2, pp_size=2),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True),
        dict(use_kl_loss=True, kl_loss_coef=0.05),
    ),
    "ep2_moe_r3": (
        "qwen3-moe",
        2,
        dict(tp_size=1, ep_size=2),
        dict(expert_model_parallel_size=2, use_rollout_routing_replay=True, moe_aux_loss_coef=0.01),
        {},
    ),
    "cp2_vlm_distopt": (
        "qwen2.5-vl",
        2,
        dict(tp_size=1, cp_size=2),
        dict(context_parallel_size=2, use_distributed_optimizer=True),
        {},
    ),
}
ALGO = dict(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01, use_tis=True, tis_clip=2.0)
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
TIMES = ("train/seconds",)  # metrics that are clocks, not numbers of the model


def _digest(tensor) -> str:
    import torch

    data = tensor.detach().to("cpu").contiguous()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _batch(path: Path, kind: str) -> list:
    """Four random-token sequences of two prompt groups; for a VLM the last is a prompt with an image."""
    import torch

    from slime_mt.types import TrainingSample

    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        prompt = torch.randint(100, vocab - 100, (6 + 3 * i,), generator=g).tolist()
        response = torch.randint(100, vocab - 100, (5,), generator=g).tolist()
        samples.append(
            TrainingSample(prompt, response, [1, 1, 0, 1, 1], [-11.9] * 5, float(i % 2), f"{i // 2}/{i}", i // 2, True)
        )
    if kind.endswith("-vl"):
        samples[3] = _image_sample(path)
    return samples


def _image_sample(path: Path):
    from PIL import Image, ImageDraw

    from slime_mt.processing import load_tokenizer_or_processor
    from slime_mt.types import TrainingSample

    image = Image.new("RGB", (96, 64), (200, 30, 30))
    ImageDraw.Draw(image).line([(0, 0), (90, 60)], fill=(255, 255, 255), width=3)
    processor = load_tokenizer_or_processor(path)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is drawn?"}]}],
        add_generation_prompt=True,
    )
    inputs = processor(text=text + "A white line on red.", images=[image])
    ids = inputs["input_ids"][0].tolist()
    mm = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
    return TrainingSample(ids[:-5], ids[-5:], [1] * 5, [-11.9] * 5, 0.0, "1/3", 1, True, multimodal_train_inputs=mm)


def _with_routes(path: Path, samples: list) -> list:
    """``samples`` with random engine routes for every token but the last (R3)."""
    import torch

    from slime_mt.routes import RouteLayout

    layout = RouteLayout.of(json.loads((path / "config.json").read_text()))
    g = torch.Generator().manual_seed(3)
    out = []
    for s in samples:
        rows = (len(s.prompt_ids) + len(s.response_ids) - 1) * len(layout.moe_layers)
        picks = torch.stack([torch.randperm(layout.num_experts, generator=g)[: layout.top_k] for _ in range(rows)])
        routes = picks.reshape(-1, len(layout.moe_layers), layout.top_k).to(layout.dtype)
        out.append(dataclasses.replace(s, routed_experts=routes))
    return out


def _rank(name: str, out: Path) -> None:
    """One rank of world ``name``: two steps, log-probs before and after, the weights after."""
    import torch

    from slime_mt.assets import tiny_model_dir
    from slime_mt.backends.megatron.actor import MegatronActor
    from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel
    from slime_mt.config import AlgoConfig, TrainConfig

    kind, _, sizes, train_fields, algo_fields = WORLDS[name]
    path = tiny_model_dir(kind)
    info = init_parallel(seed=1234, **sizes)
    train = TrainConfig(lr=1e-5, clip_grad=1.0, micro_batch_size=2, **train_fields)
    actor = MegatronActor(str(path), train, AlgoConfig(**ALGO, **algo_fields), info, temperature=0.8)
    samples = _batch(path, kind)
    if train.use_rollout_routing_replay:
        samples = _with_routes(path, samples)
    before = actor.compute_logprobs(samples)
    metrics = [
        actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=True, version=0),
        actor.train(actor.share_of(samples, ADVANTAGES, 1), on_policy=False, version=1),
    ]
    after = actor.compute_logprobs(samples)
    weights = actor.export_hf()
    if info.rank == 0:
        record = {
            "logprobs_before": [_digest(lp) for lp in before],
            "logprobs_after": [_digest(lp) for lp in after],
            "metrics": [{k: float(v).hex() for k, v in sorted(m.items()) if k not in TIMES} for m in metrics],
            "weights": {n: _digest(t) for n, t in sorted(weights.items())},
        }
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    torch.distributed.barrier()
    destroy_parallel()


def _launch(name: str, out: Path) -> dict:
    ranks = WORLDS[name][1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [__file__, "--world", name, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"world {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / f"{name}.json").read_text())


def _differences(now: dict, then: dict) -> list[str]:
    found = []
    for world in sorted(set(now) | set(then)):
        a, b = now.get(world, {}), then.get(world, {})
        for key in ("logprobs_before", "logprobs_after", "metrics"):
            if a.get(key) != b.get(key):
                found.append(f"{world}: {key} differ")
        wa, wb = a.get("weights", {}), b.get("weights", {})
        changed = sorted(n for n in set(wa) | set(wb) if wa.get(n) != wb.get(n))
        if changed:
            found.append(f"{world}: {len(changed)} exported tensors differ, e.g. {changed[:3]}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("megatron_fingerprint.json"), help="where to write it")
    parser.add_argument("--compare", type=Path, help="an earlier fingerprint: exit 1 where they differ")
    parser.add_argument("--worlds", nargs="+", default=list(WORLDS), choices=list(WORLDS))
    parser.add_argument("--world", help=argparse.SUPPRESS)  # a rank of one world (the launch)
    args = parser.parse_args()
    if args.world:
        _rank(args.world, args.out)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = {name: _launch(name, Path(tmp)) for name in args.worlds}
    args.out.write_text(json.dumps(found, indent=1))
    for name, record in found.items():
        whole = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
        print(f"{name:16s} {len(record['weights'])} tensors, fingerprint {whole}")
    if args.compare is None:
        return 0
    differences = _differences(found, json.loads(args.compare.read_text()))
    for line in differences:
        print(f"DIFFERENT: {line}")
    print("bit for bit the same" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
