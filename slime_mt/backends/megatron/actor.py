"""The policy's training step (slime's ``train_actor``): old and reference log-probs, the RL loss of each
packed row, M2PO's cutoff, the optimizer steps and their metrics, on one trainable ``MegatronModel`` (the
policy) and a frozen one (the reference, under ``--use-kl-loss``; a LoRA run's reference is its own base,
the policy with its adapters off, not a second copy).

``train(share)`` takes this data-parallel rank's ``RankShare`` of the step's batch (the rollout role deals
a whole batch into one share per DP rank: ``splitter``; ``share_of`` does it here) and runs, per
mini-batch of whole prompt groups (one optimizer step):

  this rank's samples of the mini-batch -> packed rows -> forward, TP log-probs, loss, backward
  (``scoring.forward_backward``) -> ``finalize_grads`` (the DP all-reduce, and the TP all-reduce of
  parameters replicated across TP ranks that see only their shard of the activations: Qwen3's q/k
  norms) -> clip + Adam step -> LR schedule step.

Because the reduction weights are normalised over the global mini-batch (``split_by_dp``), the gradient
and its norm are the same at any DP size (DDP averages over DP ranks, so each rank's loss is scaled by
the DP size). Old log-probs are recomputed (for this rank's share) before the first step unless the data
is on-policy and there is a single optimizer step (then ratio = 1 exactly). Log-softmax is computed in
fp32 (``scoring.LogProbs``). A sample's advantages are per token where a train-side estimator set them
(``RankShare.token_advantages``), else its group estimator's scalar on every trained token.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from slime_mt.algo.batching import RankShare, split_by_dp
from slime_mt.algo.losses import LossInputs, add_metric, m2po_cutoff, policy_loss, sft_loss
from slime_mt.backends.megatron import export, scoring
from slime_mt.backends.megatron.lora import adapters_off
from slime_mt.backends.megatron.model import MegatronModel
from slime_mt.backends.megatron.moe import router_metrics
from slime_mt.backends.megatron.parallel import ParallelInfo
from slime_mt.backends.megatron.peft import adapter_config, iter_adapter_tensors
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.config.training import reference_copy
from slime_mt.engine.weights.adapters import AdapterStream
from slime_mt.timeline import maybe_span
from slime_mt.types import TrainingSample


class MegatronActor:
    def __init__(
        self,
        hf_path: str,
        train: TrainConfig,
        algo: AlgoConfig,
        info: ParallelInfo,
        temperature: float = 1.0,
        norm_max_len: int | None = None,
        total_steps: int = 1000,
    ):
        self.train_cfg, self.algo, self.info = train, algo, info
        self.temperature, self.norm_max_len = temperature, norm_max_len
        self.policy = MegatronModel(hf_path, train, info, trainable=True, total_steps=total_steps)
        # the KL reference: a frozen copy of the starting weights, or a LoRA run's own base (compute_logprobs)
        self.reference = MegatronModel(hf_path, train, info, trainable=False) if reference_copy(train, algo) else None
        self.spec, self.device = self.policy.spec, self.policy.device
        self.timeline = None  # the rank's trace (slime_mt/timeline.py): train phases as spans
        # --save-debug-rollout-data: the step's log-probs of this rank's sequences (by index in the batch),
        # under the weights the step started from, for the dump's train-vs-rollout gap
        self.keep_log_probs = False
        self.kept_log_probs: dict[int, list[float]] = {}
        self.m2po_cutoff: float | None = None  # --m2po-threshold: this step's bound, the same on every rank
        self.proximal_version: int | None = None  # the version of the weights the step starts from

    @property
    def step(self) -> int:
        """Optimizer steps the policy has taken."""
        return self.policy.step

    @property
    def layout_name(self) -> str:
        return self.policy.layout_name

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(
        self,
        samples: list[TrainingSample],
        indices: list[int] | None = None,
        reference: bool = False,
        replay: bool = True,
    ) -> list[torch.Tensor | None]:
        """Response log-probs ``[len(response)]`` of ``samples[indices]`` (all by default; None for the
        others) under the policy (or the reference model), at the rollout temperature; nothing is trained.
        ``replay=False``: the routers choose their own experts even under ``--use-rollout-routing-replay``."""
        if reference and self.reference is None:  # a LoRA run's reference: its own base, the adapters off
            with adapters_off(self.policy.adapters):
                return self.compute_logprobs(samples, indices, replay=replay)
        model = self.reference if reference else self.policy
        scored = scoring.score(model, samples, indices, scoring.LogProbs(self.temperature), replay)
        return [None if out is None else out[0] for out in scored]

    # ------------------------------------------------------------------ training

    def splitter(self) -> Callable[[list[TrainingSample], list[float], int], list[RankShare]]:
        """``split_by_dp`` with this actor's DP size, loss reduction and normalising length: a whole
        batch -> every DP rank's share (a plain function: it goes to the rollout role, maybe a Ray actor)."""
        return functools.partial(
            split_by_dp, dp_size=self.info.dp_size, loss_reduction=self.algo.loss_reduction, max_len=self.norm_max_len
        )

    def split(self, samples: list[TrainingSample], advantages: list[float], prompts_per_step: int) -> list[RankShare]:
        """A whole batch split into every DP rank's share, as the trainer sends it."""
        return self.splitter()(samples, advantages, prompts_per_step)

    def share_of(self, samples: list[TrainingSample], advantages: list[float], prompts_per_step: int) -> RankShare:
        """This rank's share of a whole batch, as the trainer sends it."""
        return self.split(samples, advantages, prompts_per_step)[self.info.dp_rank]

    def train(self, share: RankShare, on_policy: bool = True, version: int | None = None) -> dict[str, float]:
        """One pass over this rank's ``share`` of the step, one optimizer step per mini-batch (all DP
        ranks together); ``version``: that of the weights the step starts from (the engines' name for
        them), which ``--prox-logp-method loglinear`` interpolates by."""
        started = time.perf_counter()
        self.proximal_version = version
        old, ref, unreplayed = self._before_training(share, on_policy)
        totals: dict[str, float] = collections.defaultdict(float)
        for m in range(share.mini_batches):
            with maybe_span(self.timeline, "forward-backward", "train", lane="train", mini_batch=m):
                sums = self.accumulate_gradients(share, m, old, ref, unreplayed)
            metrics = {f"train/{k}": v for k, v in sums.items()}
            with maybe_span(self.timeline, "optimizer step", "train", lane="train", mini_batch=m):
                metrics.update(self.apply_gradients())
            for k, v in metrics.items():
                add_metric(totals, k, v, divisor=share.mini_batches)
        totals["train/seconds"] = time.perf_counter() - started
        totals["train/optimizer_steps"] = share.mini_batches
        return dict(totals)

    def _before_training(self, share: RankShare, on_policy: bool) -> tuple[list | None, list | None, list | None]:
        """The log-probs the step's loss reads beside its own, at the weights the step starts from, by
        position in the share: old (the proximal policy: off-policy data, several mini-batches or M2PO),
        the reference model's, and the routers' own routes' (``--log-routing-replay-gap``); M2PO's cutoff."""
        m2po = self.algo.use_decoupled_loss and self.algo.m2po_threshold is not None
        need_old = (
            not self.train_cfg.sft
            and not self.algo.interpolates_proximal
            and (not on_policy or share.mini_batches > 1 or m2po)
        )
        old = ref = unreplayed = None
        self.kept_log_probs = {}
        self.m2po_cutoff = None
        everything = sorted(range(len(share.samples)), key=lambda k: share.indices[k])  # in batch order
        if need_old:
            with maybe_span(self.timeline, "old log-probs", "train", lane="train"):
                old = self.compute_logprobs(share.samples, everything)
            if self.keep_log_probs:
                self.kept_log_probs = {share.indices[k]: old[k].tolist() for k in everything}
            if m2po:
                self.m2po_cutoff = self._m2po_cutoff(share, old)
        if self.algo.kl_term:
            with maybe_span(self.timeline, "reference log-probs", "train", lane="train"):
                ref = self.compute_logprobs(share.samples, everything, reference=True)
        if self.train_cfg.log_routing_replay_gap and self.spec.moe is not None:  # at the weights ``old`` has
            with maybe_span(self.timeline, "log-probs without routing replay", "train", lane="train"):
                unreplayed = self.compute_logprobs(share.samples, everything, replay=False)
        return old, ref, unreplayed

    def accumulate_gradients(
        self,
        share: RankShare,
        m: int = 0,
        old: list | None = None,
        ref: list | None = None,
        unreplayed: list | None = None,
    ) -> dict[str, float]:
        """Forward/backward of mini-batch ``m`` of this rank's ``share`` into the (zeroed) gradient
        buffers, then ``finalize_grads``. ``old``, ``ref``, ``unreplayed`` (the routers' own routes, R3
        off): log-probs by position in the share. -> metric sums over the global mini-batch."""
        policy = self.policy
        policy.zero_grad()
        sums: dict[str, float] = collections.defaultdict(float)
        sft = self.train_cfg.sft
        post = scoring.LogProbs(
            1.0 if sft else self.temperature, entropy=not sft, entropy_grad=self.algo.entropy_coef != 0
        )

        def loss(row, outputs):
            return self._row_loss(share, row, *outputs, old, ref, unreplayed, sums)

        trained_rows = scoring.forward_backward(policy, share.samples, share.of_mini_batch(m), post, loss)
        policy.finalize_grads()
        totals = policy.sum_over_dp(sums)
        if self.spec.moe is None:
            return policy.merged_over_stages(totals)
        totals.update(router_metrics(policy.module, trained_rows, self.device))
        totals = policy.merged_over_stages(totals)
        if self.train_cfg.use_rollout_routing_replay:  # every rank routed its own tokens: sum over all
            totals.update(policy.replay_totals())
        return totals

    def _row_loss(self, share, row, lp, entropy, old, ref, unreplayed, sums) -> torch.Tensor:
        """The loss of one packed row of ``share`` (scaled for DDP's average), its metrics added to
        ``sums``."""
        samples = share.samples
        if self.keep_log_probs and not old and not self.train_cfg.sft:  # one mini-batch: the step's own
            for k, i in enumerate(row.sample_index):
                self.kept_log_probs[share.indices[i]] = lp.detach()[row.seq_ids == k].tolist()
        inputs = LossInputs(
            log_probs=lp,
            old_log_probs=self._cat([old[i] for i in row.sample_index]) if old else lp.detach(),
            rollout_log_probs=self._cat(
                [_or_nan(samples[i].rollout_log_probs, len(samples[i].response_ids)) for i in row.sample_index]
            ),
            advantages=self._cat([share.token_advantages(i) for i in row.sample_index]),
            weights=self._cat([share.weights[i] for i in row.sample_index]),
            seq_ids=row.seq_ids,
            entropy=entropy,
            ref_log_probs=self._cat([ref[i] for i in row.sample_index]) if ref else None,
            m2po_cutoff=self.m2po_cutoff,
            token_versions=self._versions(samples, row.sample_index) if self.algo.interpolates_proximal else None,
            proximal_version=self.proximal_version,
        )
        loss, metrics = sft_loss(inputs) if self.train_cfg.sft else policy_loss(inputs, self.algo)
        sampled = ~torch.isnan(inputs.rollout_log_probs)
        if unreplayed and bool(sampled.any()):  # the gap R3 closes: train_rollout_logprob_abs_diff's, unreplayed
            own = self._cat([unreplayed[i] for i in row.sample_index])
            gap = (own - inputs.rollout_log_probs).abs() * inputs.weights
            metrics["train_rollout_logprob_abs_diff_without_replay"] = float(gap[sampled].sum())
        metrics["loss"] = float(loss.detach())
        metrics["tokens"] = sum(len(samples[i].response_ids) for i in row.sample_index)
        if self.train_cfg.shared_prefix_training:
            metrics["tokens_before_sharing"] = sum(row.lengths)
            metrics["tokens_after_sharing"] = row.num_real_tokens
        for k, v in metrics.items():
            add_metric(sums, k, v)
        # DDP averages over DP x CP ranks; the weights are global, and each CP rank's gradient is
        # its tokens' share of the row's
        return loss * self.info.dp_size * self.info.cp_size

    def _m2po_cutoff(self, share: RankShare, old: list) -> float | None:
        """M2PO's bound for this step (``losses.m2po_cutoff``) over every DP rank's trained tokens that
        the weight cap keeps: (log pi_prox / pi_behav)^2 of each."""
        from megatron.core import parallel_state

        values = []
        for k, sample in enumerate(share.samples):
            if sample.rollout_log_probs is None:  # the loss refuses it if it has trained tokens
                continue
            log_w = old[k].to(torch.float64) - torch.as_tensor(
                sample.rollout_log_probs, dtype=torch.float64, device=old[k].device
            )
            live = torch.as_tensor(sample.loss_mask, device=old[k].device) > 0
            live &= torch.exp(log_w) <= self.algo.behav_imp_weight_cap
            values.append(log_w[live].square())
        values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64, device=self.device)
        group = parallel_state.get_data_parallel_group() if self.info.dp_size > 1 else None
        return m2po_cutoff(values, self.algo.m2po_threshold, group)

    def apply_gradients(self) -> dict[str, float]:
        """Clip, Adam step and LR schedule step on the finalized gradients."""
        return {f"train/{k}": v for k, v in self.policy.optimizer_step().items()}

    def _versions(self, samples, indices) -> torch.Tensor | None:
        """The weight version of each packed response token (-1: none), or None where one sample has none
        recorded."""
        if any(not samples[i].token_versions for i in indices):
            return None
        return torch.cat(
            [torch.as_tensor(samples[i].token_versions, dtype=torch.long, device=self.device) for i in indices]
        )

    def _cat(self, values) -> torch.Tensor:
        """Per-sample lists or tensors -> one float32 tensor on the trainer's device."""
        return torch.cat([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in values])

    # ------------------------------------------------------------------ the device (--offload)

    def _models(self) -> list[MegatronModel]:
        return [m for m in (self.policy, self.reference) if m is not None]

    def device_bytes(self) -> int:
        """Bytes of the trainer's state on its device now (0 while offloaded)."""
        return sum(m.device_bytes() for m in self._models())

    def offload(self) -> None:
        """Free the device while colocated engines generate (``offload.py``); twice is once."""
        for m in self._models():
            m.offload()

    def onload(self) -> None:
        """The trainer's state back on its device, bit for bit (gradients zeroed)."""
        for m in self._models():
            m.onload()

    # ------------------------------------------------------------------ weights and checkpoints

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The policy's HF weights, one tensor at a time (``export.iter_hf_weights``; collective)."""
        return export.iter_hf_weights(self.policy)

    def iter_adapter_weights(self) -> AdapterStream:
        """The policy's LoRA adapters, PEFT-named, one tensor at a time, with their ``adapter_config.json``
        (what engines that serve the adapter take at an update; collective)."""
        return AdapterStream(iter_adapter_tensors(self.policy), adapter_config(self.policy))

    def export_hf(self) -> dict[str, torch.Tensor]:
        """Every HF-named tensor of the policy on global rank 0 ({} on other ranks); collective."""
        return export.export_hf(self.policy)

    def save(self, root: str | Path, extra: dict) -> Path:
        return self.policy.save(root, extra)

    def load(self, root: str | Path) -> dict:
        return self.policy.load(root)


def _or_nan(log_probs: list[float] | None, length: int) -> list[float]:
    """Rollout log-probs, or NaN for tokens the engine never sampled as such (a re-tokenized history)."""
    return [float("nan")] * length if log_probs is None else log_probs
