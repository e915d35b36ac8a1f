"""The policy in Megatron: forward/backward of RL losses on packed rows, optimizer steps, reference
model, checkpoints, HF weight export for the engine.

``train(samples, advantages)`` runs, per mini-batch of whole prompt groups (one optimizer step):
reduction weights computed once over the mini-batch -> micro-batches (packed rows within the token
budget) -> forward, TP log-probs, loss, backward -> grad sync, clipping and Adam step (megatron's
DDP and optimizer) -> LR schedule step. Old log-probs are recomputed before the first step unless
the data is on-policy and there is a single optimizer step (then ratio = 1 exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.algo.batching import micro_batches_by_count, micro_batches_by_tokens, mini_batches_by_groups, \
    reduction_weights
from slime_mt.algo.losses import LossInputs, policy_loss, sft_loss
from slime_mt.backends.megatron.convert import hf_to_megatron, load_hf_state, load_into, megatron_to_hf, text_prefix
from slime_mt.backends.megatron.logprobs import token_logprobs
from slime_mt.backends.megatron.models import build_gpt, decoder_spec, read_hf_config
from slime_mt.backends.megatron.packing import PackedRow, pack_row
from slime_mt.backends.megatron.parallel import ParallelInfo
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be loaded; names the folder and what is missing."""


class MegatronActor:
    def __init__(self, hf_path: str, train: TrainConfig, algo: AlgoConfig, info: ParallelInfo,
                 temperature: float = 1.0, norm_max_len: int | None = None, total_steps: int = 1000):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.hf_path, self.train_cfg, self.algo, self.info = str(hf_path), train, algo, info
        self.temperature, self.norm_max_len = temperature, norm_max_len
        self.hf_config = read_hf_config(hf_path)
        self.spec = decoder_spec(self.hf_config, f"{hf_path}/config.json")
        hf_state = load_hf_state(hf_path)
        self.prefix = text_prefix(hf_state)
        self.policy = self._build(hf_state)
        self.model = DistributedDataParallel(
            self.policy.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
            self.policy)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
                            clip_grad=train.clip_grad, bf16=train.bf16, params_dtype=torch.float32,
                            adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8), [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if train.lr_warmup_steps else train.lr, max_lr=train.lr, min_lr=train.min_lr,
            lr_warmup_steps=train.lr_warmup_steps, lr_decay_steps=max(total_steps, train.lr_warmup_steps + 1),
            lr_decay_style="cosine" if 0 < train.min_lr < train.lr else "constant",
            start_wd=train.weight_decay, end_wd=train.weight_decay, wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant")
        self.reference = self._build(hf_state, frozen=True) if algo.use_kl_loss and algo.kl_loss_coef > 0 else None
        self.step = 0

    # ------------------------------------------------------------------ model

    def _build(self, hf_state: dict, frozen: bool = False) -> torch.nn.Module:
        if self.spec.mrope_section is not None:
            from slime_mt.backends.megatron.vlm import build_vlm

            model = build_vlm(self.hf_config, self.spec, hf_state, self.info.tp_size, self.info.tp_rank,
                              freeze_vision=frozen or self.train_cfg.freeze_vision_tower)
        else:
            model = build_gpt(self.spec, self.info.tp_size)
            load_into(model, hf_to_megatron(hf_state, self.spec, self.info.tp_rank, self.info.tp_size))
        if frozen:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model

    @property
    def _mrope(self):
        """M-RoPE position function of a VLM policy (None for text models)."""
        return getattr(self.policy, "mrope_positions", None)

    def _forward(self, module, row: PackedRow, with_entropy: bool):
        if self._mrope is not None:
            logits = module(row.tokens, row.position_ids, row.attention_mask,
                            pixel_values=row.pixel_values, image_grid_thw=row.image_grid_thw)
        else:
            logits = module(row.tokens, row.position_ids, row.attention_mask)
        logits = logits[0].index_select(0, row.logit_index)  # [T, V/tp]
        return token_logprobs(logits, row.targets, self.spec.vocab_size, self.temperature, with_entropy)

    def _rows(self, samples: list[TrainingSample], indices: list[int]) -> list[list[int]]:
        budget = self.train_cfg.max_tokens_per_micro_batch
        if budget:
            lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in indices]
            return [[indices[k] for k in row] for row in micro_batches_by_tokens(lengths, budget)]
        return [[indices[k] for k in row] for row in micro_batches_by_count(len(indices), self.train_cfg.micro_batch_size)]

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainingSample], reference: bool = False,
                         with_entropy: bool = False) -> list[torch.Tensor]:
        """Per-sample response log-probs ``[len(response)]`` (and nothing is trained)."""
        module = self.reference if reference else self.model
        module.eval()
        out: list[torch.Tensor | None] = [None] * len(samples)
        for row_indices in self._rows(samples, list(range(len(samples)))):
            row = pack_row(samples, row_indices, self._mrope)
            lp, _ = self._forward(module, row, with_entropy)
            for k, i in enumerate(row.sample_index):
                out[i] = lp[row.seq_ids == k]
        module.train()
        return out

    # ------------------------------------------------------------------ training

    def train(self, samples: list[TrainingSample], advantages: list[float], prompts_per_step: int,
              on_policy: bool = True) -> dict[str, float]:
        """One pass over ``samples`` (this DP rank's share), one optimizer step per mini-batch."""
        started = time.perf_counter()
        mini_batches = mini_batches_by_groups(samples, prompts_per_step)
        need_old = not self.train_cfg.sft and (not on_policy or len(mini_batches) > 1)
        old = self.compute_logprobs(samples) if need_old else None
        ref = self.compute_logprobs(samples, reference=True) if self.reference is not None else None
        totals: dict[str, float] = {}
        for mb in mini_batches:
            metrics = self._optimizer_step(samples, mb, advantages, old, ref)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / len(mini_batches)
        totals["train/seconds"] = time.perf_counter() - started
        totals["train/optimizer_steps"] = len(mini_batches)
        return totals

    def _optimizer_step(self, samples, mb, advantages, old, ref) -> dict[str, float]:
        batch = [samples[i] for i in mb]
        weights = reduction_weights(batch, self.algo.loss_reduction, self.norm_max_len)
        weight_of = dict(zip(mb, weights))
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, float] = {}
        tokens = 0
        for row_indices in self._rows(samples, mb):
            row = pack_row(samples, row_indices, self._mrope)
            lp, entropy = self._forward(self.model, row, with_entropy=True)
            cat = lambda xs: torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in xs])  # noqa: E731
            old_lp = cat([old[i] for i in row.sample_index]) if old is not None else lp.detach()
            inputs = LossInputs(
                log_probs=lp, old_log_probs=old_lp,
                rollout_log_probs=cat([samples[i].rollout_log_probs for i in row.sample_index]),
                advantages=cat([[advantages[i] * m for m in samples[i].loss_mask] for i in row.sample_index]),
                weights=cat([weight_of[i] for i in row.sample_index]) * self.info.dp_size,
                seq_ids=row.seq_ids, entropy=entropy,
                ref_log_probs=cat([ref[i] for i in row.sample_index]) if ref is not None else None)
            loss, metrics = sft_loss(inputs) if self.train_cfg.sft else policy_loss(inputs, self.algo)
            loss.backward()
            metrics["loss"] = float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            tokens += int(sum(len(samples[i].response_ids) for i in row.sample_index))
        self.model.finish_grad_sync()
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        self.step += 1
        out = {f"train/{k}": v / self.info.dp_size for k, v in sums.items()}
        out.update({"train/grad_norm": float(grad_norm or 0.0), "train/lr": self.optimizer.param_groups[0]["lr"],
                    "train/step_ok": float(bool(ok)), "train/tokens": tokens})
        return out

    # ------------------------------------------------------------------ weights for the engine

    def export_hf(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (collective over the TP group; every rank gets them)."""
        state = self.policy.decoder_state_dict() if hasattr(self.policy, "decoder_state_dict") else \
            self.policy.state_dict()
        tp_group = self._tp_group()
        out = megatron_to_hf(state, self.spec, self.info.tp_size, tp_group, prefix=self.prefix)
        if hasattr(self.policy, "vision_state_dict"):
            out.update(self.policy.vision_state_dict())
        return out

    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    # ------------------------------------------------------------------ checkpoints

    def save(self, root: str | Path, extra: dict) -> Path:
        """``root/iter_{step:07d}`` with one file per rank (model, optimizer, scheduler, RNG) and
        ``extra.json``; written to a temp folder and renamed, then ``latest`` is updated atomically."""
        root = Path(root)
        name = f"iter_{self.step:07d}"
        tmp = root / f".tmp_{name}"
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        from megatron.core.tensor_parallel import random as mp_random

        state = {
            "model": {k: v for k, v in self.policy.state_dict().items() if isinstance(v, torch.Tensor)},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "tracker": mp_random.get_cuda_rng_tracker().get_states()},
            "step": self.step,
        }
        torch.save(state, tmp / f"rank_{self.info.rank:03d}.pt")
        dist.barrier()
        if self.info.is_main:
            (tmp / "extra.json").write_text(json.dumps(extra))
            final = root / name
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            latest_tmp = root / ".latest.tmp"
            latest_tmp.write_text(name)
            os.replace(latest_tmp, root / "latest")
        dist.barrier()
        return root / name

    def load(self, root: str | Path) -> dict:
        """Restore from ``root/latest`` (or an ``iter_*`` folder) -> the saved ``extra`` dict."""
        root = Path(root)
        folder = root if root.name.startswith("iter_") else root / _read_latest(root)
        file = folder / f"rank_{self.info.rank:03d}.pt"
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder} has no {file.name} (saved with another world size?)")
        state = torch.load(file, weights_only=True)
        from megatron.core.tensor_parallel import random as mp_random

        params = dict(self.policy.state_dict())
        with torch.no_grad():
            for k, v in state["model"].items():
                params[k].copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        mp_random.get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.step = int(state["step"])
        return json.loads((folder / "extra.json").read_text())


def _read_latest(root: Path) -> str:
    latest = root / "latest"
    if not latest.is_file():
        raise CheckpointError(f"--load {root}: no 'latest' file (no completed checkpoint there)")
    name = latest.read_text().strip()
    if not (root / name).is_dir():
        raise CheckpointError(f"--load {root}: 'latest' names {name}, which does not exist")
    return name
