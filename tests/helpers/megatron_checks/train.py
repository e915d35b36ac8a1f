"""Training steps: the policy's loss and gradients against transformers', SFT's loss, activation recompute
against none, the load-balancing loss, a step on samples a test saved, and a second trainable model (a
toy value head) training beside the policy through the train role's seam."""

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_worlds import MOE_FAMILIES

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    hf_logits,
    hf_model,
    is_main,
    layout_tag,
    matrix_batch,
    random_routes,
)
from slime_mt.algo.batching import reduction_weights
from slime_mt.algo.losses import LossInputs, policy_loss
from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron import export, scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.model import MegatronModel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.roles.train import TrainRole
from slime_mt.safetensors_files import load_hf_state


def hf_step(path: Path, samples: list) -> dict:
    """transformers on ``samples`` with ADVANTAGES: the same loss (policy_loss on the same inputs), its
    log-probs and entropies, its gradients (checkpoint names) and their norm (the frozen vision tower
    excluded, as in the actor)."""
    model = hf_model(path)
    model.train()
    if hasattr(model.model, "visual"):
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    weights = reduction_weights(samples, "token_mean")
    lps, ents = [], []
    for s in samples:
        logits = hf_logits(model, s).float()[len(s.prompt_ids) - 1 : -1] / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    lp = torch.cat(lps)
    cat = lambda xs: torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in xs])  # noqa: E731
    inputs = LossInputs(
        lp,
        lp.detach(),
        cat([s.rollout_log_probs for s in samples]),
        cat([[a * m for m in s.loss_mask] for a, s in zip(ADVANTAGES, samples)]),
        cat(weights),
        torch.cat([torch.full((len(s.response_ids),), k) for k, s in enumerate(samples)]),
        entropy=torch.cat(ents),
    )
    loss, _ = policy_loss(inputs, ALGO)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {
        "logprobs": [x.tolist() for x in lps],
        "entropy": [x.tolist() for x in ents],
        "loss": float(loss.detach()),
        "grads": _checkpoint_names(grads, path),
        "grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))),
    }


def check_hf_reference(args, info, out):
    """transformers' step on the matrix batch of each family (``hf_step``), for the TP matrix."""
    for kind in LAUNCH.families:
        path = tiny_model_dir(kind)
        torch.save(hf_step(path, matrix_batch(path, kind)), Path(args.out) / f"matrix_hf_{kind}.pt")
    out["hf_reference"] = "saved"


def check_pad_token(args, info, out):
    """Issue 67 item 3: a config's pad_token_id is transformers' padding_idx: the tiny Qwen3 with a
    pad_token_id that stands in the batch's prompts and responses -> Megatron's gradients, grad norm and
    the pad row's embedding gradient against transformers' on the same step; and the pad row's gradient
    with the lookups trained (the former behaviour) for the difference the test is about."""
    folder = Path(args.out) / "qwen3-pad"
    if info.rank == 0:
        shutil.copytree(tiny_model_dir("qwen3"), folder, dirs_exist_ok=True)
    dist.barrier()
    samples = matrix_batch(folder, "qwen3")
    pad = samples[0].prompt_ids[2]
    for s in samples:  # the pad token in every prompt and in a trained response token
        s.prompt_ids[1] = pad
        s.response_ids[0] = pad
    config = json.loads((folder / "config.json").read_text())
    runs = {}
    for padded in (True, False):
        if info.rank == 0:
            (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": pad if padded else None}))
        dist.barrier()
        actor = MegatronActor(
            str(folder), TrainConfig(lr=1e-5, micro_batch_size=2), ALGO, info, temperature=TEMPERATURE
        )
        actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
        decoder = {n[len("gpt.") :]: p for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")}
        grads = dict(export.iter_hf_weights(actor.policy, tensors={n: p.main_grad for n, p in decoder.items()}))
        runs[padded] = {"grads": grads, "grad_norm": actor.apply_gradients()["train/grad_norm"]}
    if info.rank == 0:
        (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": pad}))
        hf = hf_step(folder, samples)
        embed = "model.embed_tokens.weight"
        out["pad_token"] = {
            "pad": pad,
            "rel": {
                n: float((g - hf["grads"][n]).norm() / hf["grads"][n].norm()) for n, g in runs[True]["grads"].items()
            },
            "grad_norm": [runs[True]["grad_norm"], hf["grad_norm"], runs[False]["grad_norm"]],
            "pad_row": float((runs[True]["grads"][embed][pad] - hf["grads"][embed][pad]).abs().max()),
            "pad_row_trained": float((runs[False]["grads"][embed][pad] - hf["grads"][embed][pad]).abs().max()),
            "pad_row_scale": float(hf["grads"][embed][pad].abs().max()),
        }


def _checkpoint_names(named: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """transformers' module names -> the checkpoint's names (VLMs keep ``model.language_model.``), and
    its in-memory fused experts (``[E, 2I, H]``, ``[E, H, I]``) -> the checkpoint's expert layout
    (per-expert tensors, or the published fused ``[E, H, 2I]``, ``[E, I, H]``)."""
    names = set(load_hf_state(path))
    out = {}
    for name, t in list(named.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mlp, which = name.rsplit("experts.", 1)
            mlp = next(
                m
                for m in (mlp, mlp.replace("model.language_model.", "model.", 1))
                if f"{m}experts.0.down_proj.weight" in names or f"{m}experts.{which}" in names
            )
            if f"{mlp}experts.{which}" in names:  # fused in the checkpoint: the published layout
                out[f"{mlp}experts.{which}"] = t.transpose(1, 2)
            else:
                for e, expert in enumerate(t.unbind(0)):
                    if which == "down_proj":
                        out[f"{mlp}experts.{e}.down_proj.weight"] = expert
                    else:
                        gate, up = expert.chunk(2, dim=0)
                        out[f"{mlp}experts.{e}.gate_proj.weight"] = gate
                        out[f"{mlp}experts.{e}.up_proj.weight"] = up
            continue
        candidates = [
            name,
            name.replace("model.language_model.", "model.", 1),
            name.replace("model.", "model.language_model.", 1),
        ]
        out[next((c for c in candidates if c in names), name)] = t
    return out


def check_sft(args, info, out):
    """The SFT loss is the NLL at temperature 1, whatever the rollout temperature."""
    path = tiny_model_dir("qwen2")
    samples = matrix_batch(path, "qwen2")
    actor = MegatronActor(str(path), TrainConfig(lr=1e-5, sft=True), AlgoConfig(), info, temperature=0.5)
    loss = actor.accumulate_gradients(actor.share_of(samples, [0.0] * len(samples), len(samples)))["loss"]
    model = hf_model(path)
    weights = reduction_weights(samples, "token_mean")
    expected = {}
    for temperature in (1.0, 0.5):
        total = 0.0
        for s, w in zip(samples, weights):
            with torch.no_grad():
                logp = torch.log_softmax(hf_logits(model, s)[len(s.prompt_ids) - 1 : -1] / temperature, -1)
            total -= float((logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0] * torch.tensor(w)).sum())
        expected[temperature] = total
    out["sft"] = {"loss": loss, "nll_t1": expected[1.0], "nll_t05": expected[0.5]}


# activation recompute cases (Megatron's flags), each against none: whole layers by chunk and by block,
# the core attention (Megatron's selective default), the dense MLP, and the MoE layer (MoE families)
RECOMPUTE_CASES = {
    "none": {},
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
}

RECOMPUTE_KINDS = ("qwen3", "qwen2.5-vl", "qwen3-moe", "qwen3-vl-moe")  # a text and a VLM of each kind


def check_recompute(args, info, out):
    """Per family this launch runs (a text and a VLM of each kind): one step of every recompute case
    against none, on fresh actors -> the largest differences of log-probs, entropies, loss, gradients
    and grad norm, whether the step's metrics match, and the bytes each forward kept for its backward
    (fewer with recompute). MoE replays random routes (R3): the recomputed layers must replay them
    too, or the gradients move."""
    from slime_mt.backends.megatron.families import have_transformer_engine
    from slime_mt.backends.megatron.recompute import in_backward
    from slime_mt.errors import ModelConfigError

    results = {}
    for kind in [k for k in RECOMPUTE_KINDS if k in (MOE_FAMILIES if info.ep_size > 1 else LAUNCH.families)]:
        path, moe = tiny_model_dir(kind), kind in MOE_FAMILIES
        samples = matrix_batch(path, kind)
        samples = random_routes(path, samples) if moe else samples
        runs = {}
        for case, flags in RECOMPUTE_CASES.items():
            if case == "selective_moe" and not moe:
                continue
            train = TrainConfig(
                lr=1e-5,
                micro_batch_size=2,
                use_rollout_routing_replay=moe,
                sequence_parallel=LAUNCH.sequence_parallel,
                **flags,
            )
            actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
            with torch.no_grad():
                rows = [
                    scoring.row_outputs(
                        actor.policy,
                        scoring.pack(actor.policy, samples, [i]),
                        scoring.LogProbs(TEMPERATURE, entropy=True),
                    )
                    for i in range(4)
                ]
            kept = [0]

            def pack(t, kept=kept):
                kept[0] += 0 if in_backward() else t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
            grads = {n: p.main_grad.clone() for n, p in actor.policy.module.named_parameters() if p.requires_grad}
            runs[case] = {
                "lp": torch.cat([lp for lp, _ in rows]),
                "ent": torch.cat([ent for _, ent in rows]),
                "sums": sums,
                "grads": grads,
                "grad_norm": actor.apply_gradients()["train/grad_norm"],
                "kept_bytes": kept[0],
            }
        base = runs["none"]
        results[kind] = {
            case: {
                "logprobs": float((r["lp"] - base["lp"]).abs().max()),
                "entropy": float((r["ent"] - base["ent"]).abs().max()),
                "loss": abs(r["sums"]["loss"] - base["sums"]["loss"]),
                "grads": max(float((g - base["grads"][n]).abs().max()) for n, g in r["grads"].items()),
                "grad_norm": abs(r["grad_norm"] - base["grad_norm"]),
                "metrics_equal": r["sums"] == base["sums"],
                "kept_bytes": r["kept_bytes"],
                "replayed_routes": r["sums"].get("routing_replay_routes", 0.0),
            }
            for case, r in runs.items()
        }
    out["recompute"] = results
    if not have_transformer_engine():  # what Megatron recomputes through Transformer Engine only
        try:
            MegatronActor(
                str(path), TrainConfig(recompute_granularity="selective", recompute_modules=["layernorm"]), ALGO, info
            )
        except ModelConfigError as e:
            out["recompute_refused"] = str(e)


def check_aux_loss(args, info, out):
    """The load-balancing loss on (coefficient 0.01), the Qwen3-MoE batch: this layout's gradients (HF
    layout) and router metrics, which every layout must give alike (a TP or CP rank's loss is its
    tokens' share of the row's) -> ``aux_TAG.pt``."""
    path = tiny_model_dir("qwen3-moe")
    samples = matrix_batch(path, "qwen3-moe")
    train = TrainConfig(lr=1e-5, micro_batch_size=2, moe_aux_loss_coef=0.01, sequence_parallel=LAUNCH.sequence_parallel)
    actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
    sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
    decoder = {n[len("gpt.") :]: p for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")}
    grads = dict(export.iter_hf_weights(actor.policy, tensors={n: p.main_grad for n, p in decoder.items()}))
    if is_main(info):
        metrics = {k: v for k, v in sums.items() if k.startswith("moe/")}
        torch.save({"grads": grads, "metrics": metrics}, Path(args.out) / f"aux_{layout_tag(info)}.pt")
    out["aux_loss"] = "saved"


def check_train_file(args, info, out):
    """One train step on samples a test saved (``--samples``: {"path", "samples", "advantages"}, and
    optionally "algo" (AlgoConfig fields over ALGO's) and "prompts_per_step" (default: all groups))."""
    saved = torch.load(args.samples, weights_only=False)
    samples = saved["samples"]
    algo = dataclasses.replace(ALGO, **saved.get("algo", {}))
    actor = MegatronActor(saved["path"], TrainConfig(lr=1e-4, micro_batch_size=2), algo, info)
    prompts_per_step = saved.get("prompts_per_step", len({s.group_id for s in samples}))
    metrics = actor.train(actor.share_of(samples, saved["advantages"], prompts_per_step))
    out["train_file"] = {
        "sequences": len(samples),
        "grad_norm": metrics["train/grad_norm"],
        "optimizer_steps": metrics["train/optimizer_steps"],
        "metrics": sorted(metrics),
        "finite": all(torch.isfinite(torch.tensor(v)) for v in metrics.values()),
    }


def _value_head(spec, dtype, device) -> torch.nn.Module:
    """A linear value head on the last hidden states, zeroed (the same on every rank that holds it)."""
    head = torch.nn.Linear(spec.hidden_size, 1, dtype=dtype, device=device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


class ToyValueHead:
    """An estimator of the train role (``roles/train.Estimator``) with a model of its own: the policy's
    family with a value head (``MegatronModel(head=...)``, scored with ``scoring.Values``), trained in
    the policy's step to each token's return (its sample's reward) by squared error under the share's
    reduction weights; its advantages are return - value, per token. A toy (PPO's critic is its own role,
    with GAE over the turns): it shows that such a role is a new file on ``MegatronModel`` and
    ``scoring``, with no line of the actor."""

    def __init__(self, path, info, sequence_parallel: bool):
        train = TrainConfig(lr=1e-3, clip_grad=1.0, micro_batch_size=2, sequence_parallel=sequence_parallel)
        self.model = MegatronModel(str(path), train, info, trainable=True, head=_value_head)
        self.given: list[list[list[float]]] = []  # the per-token advantages of each step

    def advantages(self, share):
        values = scoring.score(self.model, share.samples, None, scoring.Values())
        given = [[s.reward - float(v) for v in out[0]] for s, out in zip(share.samples, values)]
        self.given.append(given)
        return dataclasses.replace(share, advantages=given)

    def train(self, share) -> dict[str, float]:
        model, sums = self.model, {"value_loss": 0.0}
        device = model.device

        def loss(row, outputs):
            returns = torch.cat(
                [torch.full((len(share.samples[i].response_ids),), share.samples[i].reward) for i in row.sample_index]
            )
            weights = torch.cat([torch.tensor(share.weights[i]) for i in row.sample_index])
            value_loss = ((outputs[0] - returns.to(device)).square() * weights.to(device)).sum()
            sums["value_loss"] += float(value_loss.detach())
            return value_loss * model.info.dp_size * model.info.cp_size  # DDP averages over DP x CP

        model.zero_grad()
        scoring.forward_backward(model, share.samples, list(range(len(share.samples))), scoring.Values(), loss)
        model.finalize_grads()
        totals = model.sum_over_dp(sums)
        step = model.optimizer_step()
        return {"critic/value_loss": totals["value_loss"], "critic/grad_norm": step["grad_norm"]}


def check_value_head(args, info, out):
    """The seam of a role beside the policy: the policy and a toy value head (a second trainable model on
    the same ranks) in the train role, three steps on the matrix batch of Qwen3 with every scalar
    advantage 0 (the policy without an entropy term: its gradient comes only from the advantages the
    estimator sets) -> each step's value loss and grad norms, the advantages set, the policy's and the
    head's weights moved."""
    path = tiny_model_dir("qwen3")
    samples = matrix_batch(path, "qwen3")
    train = TrainConfig(lr=1e-5, clip_grad=1.0, micro_batch_size=2, sequence_parallel=LAUNCH.sequence_parallel)
    algo = dataclasses.replace(ALGO, entropy_coef=0.0)
    actor = MegatronActor(str(path), train, algo, info, temperature=TEMPERATURE)
    critic = ToyValueHead(path, info, LAUNCH.sequence_parallel)
    role = TrainRole(actor, on_policy=False, estimators=[critic])
    before = actor.export_hf()
    head = getattr(critic.model.module, "head", None)
    steps = [role.train(step, actor.share_of(samples, [0.0] * len(samples), 2))[0] for step in range(3)]
    after = actor.export_hf()
    out["value_head"] = {
        "value_loss": [m["critic/value_loss"] for m in steps],
        "critic_grad_norm": [m["critic/grad_norm"] for m in steps],
        "policy_grad_norm": [m["train/grad_norm"] for m in steps],
        "advantage_lengths": [[len(a) for a in given] for given in critic.given],
        "response_lengths": [len(s.response_ids) for s in actor.share_of(samples, [0.0] * 4, 2).samples],
        "advantages_vary": all(len(set(a)) > 1 for given in critic.given[1:] for a in given),
        "policy_moved": sum(not torch.equal(before[n], after[n]) for n in before) if is_main(info) else None,
        "head_weight_norm": None if head is None else float(head.weight.detach().norm()),
        "head_trainable": None if head is None else all(p.requires_grad for p in head.parameters()),
    }


CHECKS = {
    "value_head": check_value_head,
    "pad_token": check_pad_token,
    "hf_reference": check_hf_reference,
    "sft": check_sft,
    "recompute": check_recompute,
    "aux_loss": check_aux_loss,
    "train_file": check_train_file,
}
