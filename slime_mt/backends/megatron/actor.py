"""The policy in Megatron: forward/backward of RL losses on packed rows, optimizer steps, reference
model, HF weight export for the engine, checkpoints (``checkpoint.py``).

``train(samples, advantages, prompts_per_step)`` takes the GLOBAL batch (every rank has it) and runs,
per mini-batch of whole prompt groups (one optimizer step):

  reduction weights over the whole mini-batch -> this DP rank's groups (dealt round robin)
  -> micro-batches (packed rows within the token budget) -> forward, TP log-probs, loss, backward
  -> ``finalize_model_grads`` (DP all-reduce, and the TP all-reduce of parameters replicated across
  TP ranks that see only their shard of the activations: Qwen3's q/k norms) -> clip + Adam step
  -> LR schedule step.

Because the weights are normalised over the global mini-batch, the gradient and its norm are the
same at any DP size (DDP averages over DP ranks, so each rank's loss is scaled by the DP size).
Old log-probs are recomputed (for this rank's share) before the first step unless the data is
on-policy and there is a single optimizer step (then ratio = 1 exactly). Under ``--bf16`` the
parameters and activations are bf16, the optimizer keeps fp32 main parameters and fp32 gradients,
and log-softmax is computed in fp32. Every tensor lives on ``parallel.current_device()``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.algo.batching import RankShare, micro_batches_by_count, micro_batches_by_tokens, split_by_dp
from slime_mt.algo.losses import LossInputs, add_metric, m2po_cutoff, policy_loss, sft_loss
from slime_mt.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from slime_mt.backends.megatron.context_parallel import gather_owned
from slime_mt.backends.megatron.convert import (
    ExpertGather,
    ExpertLayout,
    TPGather,
    iter_hf_to_megatron,
    iter_megatron_to_hf,
    load_into,
    text_prefix,
)
from slime_mt.backends.megatron.families import (
    MoeOptions,
    Recompute,
    TextPolicy,
    build_gpt,
    decoder_spec,
    have_transformer_engine,
    padded_vocab,
    read_hf_config,
    stage_of,
)
from slime_mt.backends.megatron.logprobs import hidden_logprobs
from slime_mt.backends.megatron.moe import (
    count_routes,
    moe_layers,
    replay_counts,
    reset_router_metrics,
    router_metrics,
    scaled_aux_loss_coefficient,
    set_aux_loss_scale,
    sum_sequence_sharded_grads,
)
from slime_mt.backends.megatron.offload import offload, onload, state_storages
from slime_mt.backends.megatron.packing import PackedRow, cp_share, pack_row, pack_tree_row, sp_pad, tree_keys
from slime_mt.backends.megatron.parallel import ParallelInfo, PipelineSplit, current_device, layout_name
from slime_mt.backends.megatron.pipeline import every_stage, from_last_stage, run_pipeline
from slime_mt.backends.megatron.prefix_tree import PrefixTrie
from slime_mt.backends.megatron.vlm import build_vlm, check_deepstack_stage
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.errors import ModelConfigError
from slime_mt.routes import replay_targets
from slime_mt.safetensors_files import CheckpointReader
from slime_mt.timeline import maybe_span
from slime_mt.types import TrainingSample

LOGIT_CHUNK_BYTES = 64 * 1024 * 1024


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
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.hf_path, self.train_cfg, self.algo, self.info = str(hf_path), train, algo, info
        self.temperature, self.norm_max_len = temperature, norm_max_len
        self.device = current_device()
        self.dtype = torch.bfloat16 if train.bf16 else torch.float32
        self.te = train.transformer_impl == "transformer_engine" and have_transformer_engine()
        self.sequence_parallel = train.sequence_parallel and info.tp_size > 1  # Megatron's: off at TP=1
        self.hf_config = read_hf_config(hf_path)
        self.spec = decoder_spec(self.hf_config, f"{hf_path}/config.json")
        # the experts' placement is the parallel state's (the flags made it); the rest is the flags'
        self.moe = dataclasses.replace(
            MoeOptions.of(train), expert_parallel=info.ep_size, expert_tensor_parallel=info.etp_size
        )
        # this rank's experts (MoE): which block of experts, which slice of each
        self.experts = ExpertLayout(info.ep_rank, info.ep_size, info.etp_rank, info.etp_size)
        # the pipeline stages as the parallel state has them, the layers over them as the flags split them
        self.layer_split = dataclasses.replace(PipelineSplit.of(train), size=info.pp_size)
        if train.shared_prefix_training and (self.te or train.local_attention != "fused"):
            raise ModelConfigError(
                "--shared-prefix-training needs the fused local attention (--local-attention fused, and "
                "--transformer-impl local where Transformer Engine imports)"
            )
        if self.sequence_parallel and train.shared_prefix_training:
            raise ModelConfigError(
                "--sequence-parallel does not split prefix trees yet: leave out --shared-prefix-training"
            )
        if info.cp_size > 1 and self.te:
            raise ModelConfigError(
                f"--context-parallel-size {info.cp_size}: with Transformer Engine's layers not yet (its THD "
                "context parallelism splits every sequence); pass --transformer-impl local for the fused attention's"
            )
        if info.pp_size > 1:
            self._check_pipeline(train, info)
        needs_te = sorted({"layernorm", "moe_act"} & set(train.recompute_modules or []))
        if needs_te and not self.te:  # Megatron recomputes these through Transformer Engine's checkpoint
            raise ModelConfigError(f"--recompute-modules {' '.join(needs_te)}: needs Transformer Engine (a GPU)")
        reader = CheckpointReader(hf_path)
        self.prefix = text_prefix(reader.names())
        self.policy = self._build(reader)
        self.model = DistributedDataParallel(
            self.policy.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=train.use_distributed_optimizer
            ),
            self.policy,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                min_lr=train.min_lr,
                weight_decay=train.weight_decay,
                clip_grad=train.clip_grad,
                bf16=train.bf16,
                params_dtype=self.dtype,
                use_distributed_optimizer=train.use_distributed_optimizer,
                adam_beta1=0.9,
                adam_beta2=0.98,
                adam_eps=1e-8,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if train.lr_warmup_steps else train.lr,
            max_lr=train.lr,
            min_lr=train.min_lr,
            lr_warmup_steps=train.lr_warmup_steps,
            lr_decay_steps=max(total_steps, train.lr_warmup_steps + 1),
            lr_decay_style="cosine" if 0 < train.min_lr < train.lr else "constant",
            start_wd=train.weight_decay,
            end_wd=train.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )
        self.reference = self._build(reader, frozen=True) if algo.use_kl_loss and algo.kl_loss_coef > 0 else None
        # rows of fp32 logits [rows, V/tp] alive at once in the log-prob path: LOGIT_CHUNK_BYTES worth
        local_vocab = padded_vocab(self.spec.vocab_size, info.tp_size) // info.tp_size
        self.logit_chunk_rows = max(16, LOGIT_CHUNK_BYTES // (4 * local_vocab))
        self.step = 0
        self.timeline = None  # the rank's trace (slime_mt/timeline.py): train phases as spans
        # --save-debug-rollout-data: the step's log-probs of this rank's sequences (by index in the batch),
        # under the weights the step started from, for the dump's train-vs-rollout gap
        self.keep_log_probs = False
        self.kept_log_probs: dict[int, list[float]] = {}
        self.m2po_cutoff: float | None = None  # --m2po-threshold: this step's bound, the same on every rank
        self.proximal_version: int | None = None  # the version of the weights the step starts from

    def _check_pipeline(self, train: TrainConfig, info: ParallelInfo) -> None:
        """What pipeline parallelism does not run with yet, refused by name."""
        flag = f"--pipeline-model-parallel-size {info.pp_size}"
        refused = {
            "--shared-prefix-training": train.shared_prefix_training,
            f"--context-parallel-size {info.cp_size}": info.cp_size > 1,
            # a recomputed MoE layer's load-balancing loss takes the coefficient of the backward's moment,
            # which an idle micro-batch's does not share
            f"--moe-aux-loss-coef {train.moe_aux_loss_coef} and MoE layers recomputed": (
                self.spec.moe is not None and train.moe_aux_loss_coef > 0 and train.recomputes_moe
            ),
            # 1F1B runs the next row's forward before this row's backward: a recomputed MoE layer would
            # replay the next row's routes
            "--use-rollout-routing-replay and MoE layers recomputed": (
                train.use_rollout_routing_replay and train.recomputes_moe
            ),
        }
        for what, on in refused.items():
            if on:
                raise ModelConfigError(f"{flag} with {what}: not yet")
        reason = check_deepstack_stage(self.hf_config, self.spec.num_layers, self.layer_split)
        if reason:
            raise ModelConfigError(f"{flag}: {reason}")

    # ------------------------------------------------------------------ model

    def _build(self, reader: CheckpointReader, frozen: bool = False) -> torch.nn.Module:
        if self.spec.mrope_section is not None:
            model = build_vlm(
                self.hf_config,
                self.spec,
                reader,
                self.info.tp_size,
                self.info.tp_rank,
                self.dtype,
                self.device,
                self.te,
                freeze_vision=frozen or self.train_cfg.freeze_vision_tower,
                attention=self.train_cfg.local_attention,
                moe=self.moe,
                experts=self.experts,
                recompute=None if frozen else Recompute.of(self.train_cfg),
                sequence_parallel=self.sequence_parallel,
                pp=self.layer_split,
            )
            self.stage = stage_of(model.gpt)
        else:
            gpt = build_gpt(
                self.spec,
                self.info.tp_size,
                self.dtype,
                self.device,
                self.te,
                self.train_cfg.local_attention,
                self.moe,
                None if frozen else Recompute.of(self.train_cfg),  # a frozen model has no backward
                self.sequence_parallel,
                self.layer_split,
            )
            self.stage = stage_of(gpt)
            load_into(gpt, self.iter_megatron_tensors(reader))
            model = TextPolicy(gpt)
        if frozen:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model

    def iter_megatron_tensors(self, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's Megatron-named decoder tensors from an HF folder (its TP slices, its experts, its
        pipeline stage's layers)."""
        return iter_hf_to_megatron(
            reader, self.spec, self.info.tp_rank, self.info.tp_size, self.te, self.experts, self.stage
        )

    @property
    def _mrope(self):
        """M-RoPE position function of a VLM policy (None for text models)."""
        return getattr(self.policy, "mrope_positions", None)

    @property
    def _image_token_id(self) -> int | None:
        return getattr(self.policy, "image_token_id", None)

    @property
    def layout(self) -> str:
        """How a packed row isolates its sequences: THD with Transformer Engine, else segments for the
        fused attention or a dense mask for Megatron's."""
        return "thd" if self.te else ("segments" if self.train_cfg.local_attention == "fused" else "dense")

    @property
    def layout_name(self) -> str:
        """This rank's parallel layout, as the trace names it (``parallel.layout_name``)."""
        i = self.info
        return layout_name(i.tp_size, i.cp_size, i.ep_size, i.dp_size, self.sequence_parallel, i.pp_size)

    def pack(self, samples: list[TrainingSample], indices: list[int], replay: bool = True) -> PackedRow:
        """A packed row of ``samples[indices]`` on the trainer's device (a prefix tree with
        ``--shared-prefix-training``), with the engine's routes under ``--use-rollout-routing-replay``
        unless ``replay`` is False."""
        if self.train_cfg.shared_prefix_training:
            return pack_tree_row(samples, indices, self._mrope, self._image_token_id).to(self.device)
        row = pack_row(samples, indices, self._mrope, self.layout)
        if self.spec.moe is not None and self.train_cfg.use_rollout_routing_replay and replay:
            moe, top_k = sum(self.spec.moe.sparse_layers), self.spec.moe.topk
            row.routes = torch.cat(
                [replay_targets(samples[i].routed_experts, n, moe, top_k) for i, n in zip(indices, row.lengths)]
            )
        if self.info.cp_size > 1:  # this rank's share of the row
            tp = self.info.tp_size if self.sequence_parallel else 1
            row = cp_share(row, self.info.cp_size, self.info.cp_rank, self._cp_group(), tp)
        elif self.sequence_parallel:  # each TP rank a slice of the row
            row = sp_pad(row, self.info.tp_size)
        return row.to(self.device)

    def _cp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def _logprobs(self, module, row: PackedRow, with_entropy: bool, temperature: float):
        """(log-probs ``[T]``, entropy ``[T]`` or None) of the row's response tokens; the entropy
        carries a gradient only when the loss has an entropy term."""
        return self._score(module, row, self._hidden(module, row), with_entropy, temperature)

    def _hidden(self, module, row: PackedRow) -> torch.Tensor:
        """The row through ``module``'s decoder (this pipeline stage's layers) -> ``[L, 1, H]``."""
        extra = (
            {"pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw, "image_order": row.image_order}
            if self._mrope
            else {}
        )
        # R3: each MoE layer replays the engine's routes of the row (None: its own), until the next
        # forward: a backward that recomputes the layer replays them again
        before = sum(self.spec.moe.sparse_layers[: self.stage.layers.start]) if self.spec.moe else 0
        for k, layer in enumerate(moe_layers(module), start=before):  # k: the MoE layer's index in the decoder
            layer.replay_routes = None if row.routes is None else row.routes[:, k]
            layer.row_padding = row.padding  # context parallel: pad tokens route nowhere that counts
        return module.hidden(row.tokens, row.position_ids, row.attention_mask, row.packed_seq_params, **extra)

    def _score(self, module, row: PackedRow, hidden: torch.Tensor, with_entropy: bool, temperature: float):
        """(log-probs, entropy or None) of the row's response tokens from the last stage's ``hidden``."""
        rows = hidden[:, 0].index_select(0, row.logit_index)  # [T, H]
        lp, entropy = hidden_logprobs(
            rows,
            module.output_weight(),
            row.targets,
            self.spec.vocab_size,
            temperature,
            with_entropy,
            chunk=self.logit_chunk_rows,
            entropy_grad=self.algo.entropy_coef != 0,
        )
        if row.logit_owner is not None:  # context parallel: the whole row's, from every CP rank
            group = self._cp_group()
            lp = gather_owned(lp, row.logit_owner, group)
            entropy = None if entropy is None else gather_owned(entropy, row.logit_owner, group)
        return lp, entropy

    def _rows(self, samples: list[TrainingSample], indices: list[int]) -> list[list[int]]:
        budget = self.train_cfg.max_tokens_per_micro_batch
        if budget and self.train_cfg.shared_prefix_training:  # in order (a group's samples stay together), by tree size
            rows: list[list[int]] = []
            trie = PrefixTrie()
            for i in indices:
                seq = samples[i].prompt_ids + samples[i].response_ids
                keys = tree_keys(samples[i], self._image_token_id)
                if not rows or trie.num_nodes + trie.new_tokens(keys) > budget:
                    rows.append([])
                    trie = PrefixTrie()
                rows[-1].append(i)
                trie.add(seq, keys)
            return rows
        if budget:
            lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in indices]
            return [[indices[k] for k in row] for row in micro_batches_by_tokens(lengths, budget)]
        return [
            [indices[k] for k in row] for row in micro_batches_by_count(len(indices), self.train_cfg.micro_batch_size)
        ]

    def _aligned(self, rows: list[list[int]]) -> list[list[int] | None]:
        """``rows`` padded with None to the largest row count of any rank when experts are split over
        ranks: every MoE layer's token exchange is collective over the expert-parallel group, so every
        rank runs as many forward (and backward) passes as the busiest one."""
        if self.spec.moe is None or self.info.ep_size == 1:
            return list(rows)
        count = torch.tensor([len(rows)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return list(rows) + [None] * (int(count) - len(rows))

    def _idle_row(self) -> PackedRow:
        """One placeholder token pair, packed: a pass that trains nothing (``_idle_pass``)."""
        return self.pack([TrainingSample([0], [0], [0], [0.0], 0.0, "idle/0", -1, True)], [0])

    def _idle_pass(self, module, temperature: float, backward: bool) -> None:
        """A forward (and backward) pass of the idle row: its log-prob enters the graph times zero and
        the load-balancing loss is off for it."""
        row = self._idle_row()
        set_aux_loss_scale(self.spec.moe, 0.0)
        count_routes(module, False)
        try:
            lp, _ = self._logprobs(module, row, False, temperature)
            if backward:
                (lp.sum() * 0.0).backward()
        finally:
            count_routes(module, True)

    def _stage_hidden(self, module, row: PackedRow, idle: PackedRow | None) -> torch.Tensor:
        """``_hidden`` of a pipeline micro-batch; the ``idle`` row (expert parallelism: another rank of
        the expert group still has a row) counts in no router metric and has no load-balancing loss."""
        if row is not idle:
            return self._hidden(module, row)
        count_routes(module, False)
        try:
            with scaled_aux_loss_coefficient(module, 0.0):  # no load-balancing loss either
                return self._hidden(module, row)
        finally:
            count_routes(module, True)

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def compute_logprobs(
        self,
        samples: list[TrainingSample],
        indices: list[int] | None = None,
        reference: bool = False,
        replay: bool = True,
    ) -> list[torch.Tensor | None]:
        """Response log-probs ``[len(response)]`` of ``samples[indices]`` (all by default; None for the
        others), at the rollout temperature; nothing is trained. ``replay=False``: the routers choose
        their own experts even under ``--use-rollout-routing-replay``."""
        module = self.reference if reference else self.policy
        was_training = module.training
        module.eval()
        out: list[torch.Tensor | None] = [None] * len(samples)
        indices = list(range(len(samples))) if indices is None else indices
        if self.info.pp_size > 1:
            aligned = self._aligned(self._rows(samples, indices))
            idle = self._idle_row() if None in aligned else None
            rows = [idle if r is None else self.pack(samples, r, replay) for r in aligned]

            def score(row, hidden):  # forward only: no loss
                return hidden.new_zeros(()), self._score(module, row, hidden, False, self.temperature)[0]

            forward = functools.partial(self._stage_hidden, module, idle=idle)
            kept = run_pipeline(module, rows, forward, score, forward_only=True)
            for row, lp in zip(rows, from_last_stage([t.cpu() for t in kept])):
                if row is idle:
                    continue
                lp = lp.to(self.device)
                for k, i in enumerate(row.sample_index):
                    out[i] = lp[row.seq_ids == k]
            module.train(was_training)
            return out
        for row_indices in self._aligned(self._rows(samples, indices)):
            if row_indices is None:  # another expert-parallel rank still has a row
                self._idle_pass(module, self.temperature, backward=False)
                continue
            row = self.pack(samples, row_indices, replay)
            lp, _ = self._logprobs(module, row, False, self.temperature)
            for k, i in enumerate(row.sample_index):
                out[i] = lp[row.seq_ids == k]
        module.train(was_training)
        return out

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
        m2po = self.algo.use_decoupled_loss and self.algo.m2po_threshold is not None
        self.proximal_version = version
        need_old = (
            not self.train_cfg.sft
            and not self.algo.interpolates_proximal
            and (not on_policy or share.mini_batches > 1 or m2po)
        )
        old = ref = None
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
        if self.reference is not None:
            with maybe_span(self.timeline, "reference log-probs", "train", lane="train"):
                ref = self.compute_logprobs(share.samples, everything, reference=True)
        unreplayed = None
        if self.train_cfg.log_routing_replay_gap and self.spec.moe is not None:  # at the weights ``old`` has
            with maybe_span(self.timeline, "log-probs without routing replay", "train", lane="train"):
                unreplayed = self.compute_logprobs(share.samples, everything, replay=False)
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

    def accumulate_gradients(
        self,
        share: RankShare,
        m: int = 0,
        old: list | None = None,
        ref: list | None = None,
        unreplayed: list | None = None,
    ) -> dict[str, float]:
        """Forward/backward of mini-batch ``m`` of this rank's ``share`` into the (zeroed) gradient
        buffers, then ``finalize_model_grads``. ``old``, ``ref``, ``unreplayed`` (the routers' own
        routes, R3 off): log-probs by position in the share. -> metric sums over the global mini-batch."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        samples = share.samples
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        replay_counts(self.policy)  # count this mini-batch's routes only
        reset_router_metrics(self.policy)
        sums: dict[str, float] = collections.defaultdict(float)
        temperature = 1.0 if self.train_cfg.sft else self.temperature
        rows = self._aligned(self._rows(samples, share.of_mini_batch(m)))
        trained_rows = sum(r is not None for r in rows)  # this rank's, without the idle passes
        # a CP rank's load-balancing loss is its tokens' share of the row's (Megatron's global-batch form):
        # summed over CP as the policy loss is
        set_aux_loss_scale(self.spec.moe, self.info.cp_size / max(1, trained_rows))
        if self.info.pp_size > 1:  # the schedule runs the backward from each row's loss on the last stage
            idle = self._idle_row() if None in rows else None

            def on_last_stage(row, hidden):
                lp, entropy = self._score(self.policy, row, hidden, not self.train_cfg.sft, temperature)
                if row is idle:  # trains nothing
                    return lp.sum() * 0.0, None
                return self._row_loss(share, row, lp, entropy, old, ref, unreplayed, sums), None

            packed = [idle if r is None else self.pack(samples, r) for r in rows]
            forward = functools.partial(self._stage_hidden, self.policy, idle=idle)
            # the schedule sets the load-balancing loss's gradient scale to 1: the coefficient carries it
            with scaled_aux_loss_coefficient(self.policy, 1.0 / max(1, trained_rows)):
                run_pipeline(self.policy, packed, forward, on_last_stage, False)
            rows = []
        for row_indices in rows:
            if row_indices is None:  # another expert-parallel rank still has a row
                self._idle_pass(self.policy, temperature, backward=True)
                continue
            row = self.pack(samples, row_indices)
            lp, entropy = self._logprobs(self.policy, row, with_entropy=not self.train_cfg.sft, temperature=temperature)
            self._row_loss(share, row, lp, entropy, old, ref, unreplayed, sums).backward()
        finalize_model_grads([self.model])
        if self.spec.moe is None:
            return self._stages_merged(self._dp_sum(sums))
        if not self.sequence_parallel:  # under SP finalize_model_grads summed them
            sum_sequence_sharded_grads(self.policy, self._tp_group())
        totals = self._dp_sum(sums)
        totals.update(router_metrics(self.policy, trained_rows, self.device))
        totals = self._stages_merged(totals)
        if self.train_cfg.use_rollout_routing_replay:  # every rank routed its own tokens: sum over all
            counts = torch.tensor(replay_counts(self.policy), dtype=torch.float64, device=self.device)
            dist.all_reduce(counts)
            totals["routing_replay_routes"] = float(counts[0])
            totals["routing_replay_mismatch_frac"] = float(counts[1] / counts[0]) if counts[0] else 0.0
        return totals

    def _stages_merged(self, totals: dict[str, float]) -> dict[str, float]:
        """Under pipeline parallelism: the last stage's loss metrics, every stage's MoE layers' router
        metrics (the busiest expert over all of them), on every stage."""
        if self.info.pp_size == 1:
            return totals
        merged: dict[str, float] = {}
        for stage in every_stage(totals):
            for key, value in stage.items():
                if key == "moe/load_max_over_mean":
                    merged[key] = max(value, merged.get(key, value))
                elif key.startswith("moe/load_max_over_mean/") or key not in merged:
                    merged[key] = value
        return merged

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
            advantages=self._cat(
                [[share.advantages[i] * mask for mask in samples[i].loss_mask] for i in row.sample_index]
            ),
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
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        self.step += 1
        return {
            "train/grad_norm": float(grad_norm or 0.0),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/step_ok": float(bool(ok)),
        }

    # ------------------------------------------------------------------ offload (--offload)

    def device_bytes(self) -> int:
        """Bytes of the trainer's state on its device now (0 while offloaded)."""
        return sum(
            storage.nbytes() for storage, _ in state_storages((self.model, self.reference), self.optimizer, self.device)
        )

    def offload(self) -> None:
        """Free the device while colocated engines generate (``offload.py``); twice is once."""
        if getattr(self, "_offloaded", None) is None:
            self._offloaded = offload(
                state_storages((self.model, self.reference), self.optimizer, self.device), self.device
            )

    def onload(self) -> None:
        """The trainer's state back on its device, bit for bit (gradients zeroed)."""
        offloaded, self._offloaded = getattr(self, "_offloaded", None), None
        onload(offloaded or [])

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

    def _dp_sum(self, sums: dict[str, float]) -> dict[str, float]:
        if self.info.dp_size == 1:
            return dict(sums)
        from megatron.core import parallel_state

        keys = sorted(sums)
        gathered: list[dict] = [None] * self.info.dp_size  # keys can differ (a rank with no rows has none)
        dist.all_gather_object(gathered, {k: sums[k] for k in keys}, group=parallel_state.get_data_parallel_group())
        out: dict[str, float] = collections.defaultdict(float)
        for part in gathered:
            for k, v in part.items():
                add_metric(out, k, v)
        return dict(out)

    # ------------------------------------------------------------------ weights for the engine

    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def _tp_gather(self) -> TPGather:
        """Gathers to global rank 0 (the rank that pushes weights); DP replicas other than 0 take no part."""
        from megatron.core import parallel_state

        return TPGather(self.info.tp_size, self._tp_group(), parallel_state.get_tensor_model_parallel_src_rank())

    def _expert_gather(self) -> ExpertGather | None:
        """Gathers experts over ETP then EP to global rank 0 (None for dense models); expert
        data-parallel replicas other than the first take no part."""
        if self.spec.moe is None:
            return None
        from megatron.core import parallel_state

        etp_group = parallel_state.get_expert_tensor_parallel_group()
        etp_dst = dist.get_process_group_ranks(etp_group)[0] if self.info.etp_size > 1 else self.info.rank
        etp = TPGather(self.info.etp_size, etp_group, etp_dst)
        ep_group = parallel_state.get_expert_model_parallel_group() if self.info.ep_size > 1 else None
        return ExpertGather(self.experts, etp, ep_group, active=self.info.edp_rank == 0)

    def iter_hf_weights(
        self, tensors: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(HF name, full tensor on global rank 0 / None elsewhere), one tensor at a time. Collective
        over the TP group of DP rank 0 (and, for MoE, over the expert groups: other DP ranks lend their
        experts and yield None for them); other DP ranks yield nothing else. ``tensors``: megatron-named
        decoder tensors to export instead of the weights (gradients, optimizer states)."""
        experts = self._expert_gather()
        first = self.info.first_replica
        if not first and experts is None:
            return
        state = tensors if tensors is not None else self.policy.decoder_state_dict()
        mine = iter_megatron_to_hf(
            state, self.spec, self._tp_gather(), self.prefix, self.te, experts, dense=first, stage=self.stage
        )
        if self.info.pp_size > 1:  # each stage's gathered tensors to global rank 0, stage by stage
            yield from self._stages_to_rank0(mine)
        else:
            yield from mine
        if not first:
            return
        if tensors is None and hasattr(self.policy, "vision_state_dict"):
            here = self.info.rank == 0
            for name, t in self.policy.vision_state_dict().items():
                yield name, t.clone() if here else None

    def _stages_to_rank0(self, mine: Iterator[tuple[str, torch.Tensor | None]]):
        """Global rank 0 yields its own stage's tensors, then every later stage's, each sent by the
        rank its TP group gathered it to, one tensor at a time; the other ranks yield their stage's
        names (None), sending what they gathered."""
        from megatron.core import parallel_state

        if self.info.rank == 0:
            yield from mine
            for src in dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())[1:]:
                while True:
                    head: list = [None]
                    dist.recv_object_list(head, src=src)
                    if head[0] is None:  # the stage is done
                        break
                    name, shape, dtype = head[0]
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(tensor, src=src)
                    yield name, tensor
            return
        # the stage's first replica's TP rank 0 (other DP ranks lend their experts to it under EP)
        sender = self.info.tp_rank == 0 and self.info.pp_rank > 0 and self.info.first_replica
        for name, tensor in mine:
            if sender:
                dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0)
                dist.send(tensor.contiguous(), dst=0)
            yield name, None
        if sender:
            dist.send_object_list([None], dst=0)

    def export_hf(self) -> dict[str, torch.Tensor]:
        """Every HF-named tensor on global rank 0 ({} on other ranks); collective."""
        named = {name: t for name, t in self.iter_hf_weights()}
        return named if self.info.rank == 0 else {}

    # ------------------------------------------------------------------ checkpoints

    def save(self, root: str | Path, extra: dict) -> Path:
        return save_checkpoint(self, root, extra)

    def load(self, root: str | Path) -> dict:
        return load_checkpoint(self, root)


def _or_nan(log_probs: list[float] | None, length: int) -> list[float]:
    """Rollout log-probs, or NaN for tokens the engine never sampled as such (a re-tokenized history)."""
    return [float("nan")] * length if log_probs is None else log_probs
