"""One model on the parallel state, as slime's ``setup_model_and_optimizer(args, role)`` builds one.

``MegatronModel(hf_path, train, info, trainable=...)``: a family's decoder (and a VLM's vision tower) from
an HF folder over this rank's TP, PP, CP, EP and SP shares. Built ``trainable``: Megatron's DDP (fp32
gradient buffers), the (distributed) Adam optimizer with fp32 main parameters under ``--bf16``, the LR
schedule, activation recompute. Built frozen (``trainable=False``: a reference model, a teacher): eval
mode, no gradient, no optimizer. The caller decides which; there is one builder. ``head``: a module on
the last pipeline stage that trains with the decoder (a value head, read by ``scoring.Values``).

The model owns its gradient buffers and its optimizer step (``zero_grad``, ``finalize_grads``,
``optimizer_step``), its device memory (``device_bytes``, ``offload``, ``onload``) and its checkpoints
(``save``, ``load``: HF-named, so any layout resumes them, ``checkpoint.py``). What is computed with it
is ``scoring.py``'s; its weights for the engines are ``export.py``'s; what a role does with it is the
role's (``actor.py``: the policy's step). Every tensor lives on ``parallel.current_device()``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.algo.losses import add_metric
from slime_mt.backends.megatron.checkpoint import load_adapter, load_checkpoint, save_checkpoint
from slime_mt.backends.megatron.convert import ExpertLayout, iter_hf_to_megatron, load_into, text_prefix
from slime_mt.backends.megatron.families import (
    DecoderSpec,
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
from slime_mt.backends.megatron.logprobs import LOGIT_CHUNK_BYTES
from slime_mt.backends.megatron.lora import LoraOptions, add_adapters, freeze_all_but_adapters
from slime_mt.backends.megatron.moe import replay_counts, sum_sequence_sharded_grads
from slime_mt.backends.megatron.offload import offload, onload, state_storages
from slime_mt.backends.megatron.parallel import ParallelInfo, PipelineSplit, current_device, layout_name
from slime_mt.backends.megatron.pipeline import every_stage
from slime_mt.backends.megatron.vlm import build_vlm, check_deepstack_stage
from slime_mt.config import TrainConfig
from slime_mt.errors import ModelConfigError
from slime_mt.safetensors_files import CheckpointReader

# builds the head on the last pipeline stage: (decoder spec, parameter dtype, device) -> module
HeadBuilder = Callable[[DecoderSpec, torch.dtype, torch.device], torch.nn.Module]


class MegatronModel:
    def __init__(
        self,
        hf_path: str | Path,
        train: TrainConfig,
        info: ParallelInfo,
        *,
        trainable: bool,
        total_steps: int = 1000,
        head: HeadBuilder | None = None,
    ):
        self.hf_path, self.cfg, self.info, self.trainable = str(hf_path), train, info, trainable
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
        check_layout(self)
        reader = CheckpointReader(hf_path)
        self.prefix = text_prefix(reader.names())
        self.module = self._build(reader)
        if head is not None and self.stage.last:
            self.module.head = head(self.spec, self.dtype, self.device)
        self.lora = LoraOptions.of(train) if trainable else None  # --lora-rank: adapters, the base frozen
        self.adapters = self._adapters()
        self.ddp = self.optimizer = self.scheduler = None
        if trainable:
            self.ddp, self.optimizer, self.scheduler = _optimizer(self.module, train, self.dtype, total_steps)
            if self.lora is not None and train.lora_adapter_path:
                load_adapter(self, train.lora_adapter_path)  # --lora-adapter-path: the adapters' weights
        else:
            self.module.eval()
            for p in self.module.parameters():
                p.requires_grad_(False)
        # rows of fp32 logits [rows, V/tp] alive at once in the log-prob path (scoring.LogProbs)
        local_vocab = padded_vocab(self.spec.vocab_size, info.tp_size) // info.tp_size
        self.logit_chunk_rows = max(16, LOGIT_CHUNK_BYTES // (4 * local_vocab))
        self.step = 0  # optimizer steps taken (a trainable model's)
        self._offloaded: list | None = None

    def _build(self, reader: CheckpointReader) -> torch.nn.Module:
        """The decoder (and a VLM's vision tower) on this rank, its weights from ``reader``; a frozen
        model recomputes nothing (it has no backward) and keeps its vision tower frozen."""
        recompute = Recompute.of(self.cfg) if self.trainable else None
        if self.spec.mrope_section is not None:
            module = build_vlm(
                self.hf_config,
                self.spec,
                reader,
                self.info.tp_size,
                self.info.tp_rank,
                self.dtype,
                self.device,
                self.te,
                freeze_vision=not self.trainable or self.cfg.freeze_vision_tower,
                attention=self.cfg.local_attention,
                moe=self.moe,
                experts=self.experts,
                recompute=recompute,
                sequence_parallel=self.sequence_parallel,
                pp=self.layer_split,
            )
            self.stage = stage_of(module.gpt)
            return module
        gpt = build_gpt(
            self.spec,
            self.info.tp_size,
            self.dtype,
            self.device,
            self.te,
            self.cfg.local_attention,
            self.moe,
            recompute,
            self.sequence_parallel,
            self.layer_split,
        )
        self.stage = stage_of(gpt)
        load_into(gpt, self.iter_megatron_tensors(reader))
        return TextPolicy(gpt, self.spec.pad_token_id)

    def _adapters(self) -> dict:
        """LoRA adapters beside the layers ``--target-modules`` names (``--lora-rank`` > 0), everything
        else frozen: {decoder module name: adapter}; {} without LoRA."""
        if self.lora is None:
            return {}
        tp = (self.info.tp_rank, self.info.tp_size)
        adapters = add_adapters(self.module.gpt, self.lora, tp, self.sequence_parallel, self.stage.layers.start)
        freeze_all_but_adapters(self.module)
        return adapters

    def iter_megatron_tensors(self, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's Megatron-named decoder tensors from an HF folder (its TP slices, its experts, its
        pipeline stage's layers)."""
        return iter_hf_to_megatron(
            reader, self.spec, self.info.tp_rank, self.info.tp_size, self.te, self.experts, self.stage
        )

    @property
    def mrope(self):
        """M-RoPE position function of a VLM (None for text models)."""
        return getattr(self.module, "mrope_positions", None)

    @property
    def image_token_id(self) -> int | None:
        return getattr(self.module, "image_token_id", None)

    @property
    def layout(self) -> str:
        """How a packed row isolates its sequences: THD with Transformer Engine, else segments for the
        fused attention or a dense mask for Megatron's."""
        return "thd" if self.te else ("segments" if self.cfg.local_attention == "fused" else "dense")

    @property
    def layout_name(self) -> str:
        """This rank's parallel layout, as the trace names it (``parallel.layout_name``)."""
        i = self.info
        return layout_name(i.tp_size, i.cp_size, i.ep_size, i.dp_size, self.sequence_parallel, i.pp_size)

    def tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def cp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    # ------------------------------------------------------------------ training

    def zero_grad(self) -> None:
        """Zeroed gradient buffers, for a mini-batch's passes to accumulate into."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finalize_grads(self) -> None:
        """``finalize_model_grads`` (the DP x CP all-reduce, the tied embedding's two copies under PP, the
        TP all-reduce of replicated parameters that saw only their rank's activations: Qwen3's q/k norms,
        and under SP the norms), and for MoE without SP the TP sum of what each rank's tokens gave the
        router and experts (``moe.sum_sequence_sharded_grads``)."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads([self.ddp])
        if self.spec.moe is not None and not self.sequence_parallel:  # under SP finalize_model_grads summed them
            sum_sequence_sharded_grads(self.module, self.tp_group())

    def optimizer_step(self) -> dict[str, float]:
        """Clip, Adam step and LR schedule step on the finalized gradients -> grad_norm, lr, step_ok."""
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        self.step += 1
        return {
            "grad_norm": float(grad_norm or 0.0),
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_ok": float(bool(ok)),
        }

    def sum_over_dp(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of this rank's passes summed over the DP ranks (``algo.losses.add_metric``'s rules);
        a rank that had no rows has no keys."""
        if self.info.dp_size == 1:
            return dict(sums)
        from megatron.core import parallel_state

        keys = sorted(sums)
        gathered: list[dict] = [None] * self.info.dp_size
        dist.all_gather_object(gathered, {k: sums[k] for k in keys}, group=parallel_state.get_data_parallel_group())
        out: dict[str, float] = collections.defaultdict(float)
        for part in gathered:
            for k, v in part.items():
                add_metric(out, k, v)
        return dict(out)

    def merged_over_stages(self, totals: dict[str, float]) -> dict[str, float]:
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

    def replay_totals(self) -> dict[str, float]:
        """R3: the routes every rank's routers replayed since the last count, and the share where their
        own choice differed (collective over every rank)."""
        counts = torch.tensor(replay_counts(self.module), dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        return {
            "routing_replay_routes": float(counts[0]),
            "routing_replay_mismatch_frac": float(counts[1] / counts[0]) if counts[0] else 0.0,
        }

    # ------------------------------------------------------------------ memory (--offload)

    def _storages(self):
        return state_storages((self.ddp or self.module,), self.optimizer, self.device)

    def device_bytes(self) -> int:
        """Bytes of the model's state on its device now (0 while offloaded)."""
        return sum(storage.nbytes() for storage, _ in self._storages())

    def offload(self) -> None:
        """Free the device while colocated engines generate (``offload.py``); twice is once."""
        if self._offloaded is None:
            self._offloaded = offload(self._storages(), self.device)

    def onload(self) -> None:
        """The model's state back on its device, bit for bit (gradients zeroed)."""
        offloaded, self._offloaded = self._offloaded, None
        onload(offloaded or [])

    # ------------------------------------------------------------------ checkpoints

    def save(self, root: str | Path, extra: dict) -> Path:
        return save_checkpoint(self, root, extra)

    def load(self, root: str | Path) -> dict:
        return load_checkpoint(self, root)


def _optimizer(module: torch.nn.Module, train: TrainConfig, dtype: torch.dtype, total_steps: int):
    """(Megatron's DDP around ``module``, its Adam optimizer, the LR schedule) of a trainable model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp = DistributedDataParallel(
        module.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=train.use_distributed_optimizer
        ),
        module,
    )
    optimizer = get_megatron_optimizer(optimizer_config(train, dtype), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, **lr_schedule(train, total_steps))
    return ddp, optimizer, scheduler


def optimizer_config(train: TrainConfig, dtype: torch.dtype):
    """Megatron's ``OptimizerConfig``: Adam with decoupled weight decay (--optimizer adam, the only one),
    --adam-beta1 and --adam-beta2, the gradient clip, fp32 main weights under bf16."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=train.optimizer,
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        clip_grad=train.clip_grad,
        bf16=train.bf16,
        params_dtype=dtype,
        use_distributed_optimizer=train.use_distributed_optimizer,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=1e-8,
    )


def lr_schedule(train: TrainConfig, total_steps: int) -> dict:
    """Megatron's ``OptimizerParamScheduler`` settings: a linear warm-up from 0 over --lr-warmup-steps,
    then --lr-decay-style (slime's flag; none: cosine when 0 < --min-lr < --lr, else constant) down to
    --min-lr over the run's optimizer steps; the weight decay constant."""
    style = train.lr_decay_style or ("cosine" if 0 < train.min_lr < train.lr else "constant")
    return {
        "init_lr": 0.0 if train.lr_warmup_steps else train.lr,
        "max_lr": train.lr,
        "min_lr": train.min_lr,
        "lr_warmup_steps": train.lr_warmup_steps,
        "lr_decay_steps": max(total_steps, train.lr_warmup_steps + 1),
        "lr_decay_style": style,
        "start_wd": train.weight_decay,
        "end_wd": train.weight_decay,
        "wd_incr_steps": max(total_steps, 1),
        "wd_incr_style": "constant",
    }


def check_layout(model: MegatronModel) -> None:
    """What the model's layout and flags do not run together, refused by name before anything is built."""
    train, info = model.cfg, model.info
    if train.shared_prefix_training and (model.te or train.local_attention != "fused"):
        raise ModelConfigError(
            "--shared-prefix-training needs the fused local attention (--local-attention fused, and "
            "--transformer-impl local where Transformer Engine imports)"
        )
    if model.sequence_parallel and train.shared_prefix_training:
        raise ModelConfigError(
            "--sequence-parallel does not split prefix trees yet: leave out --shared-prefix-training"
        )
    if info.cp_size > 1 and model.te:
        raise ModelConfigError(
            f"--context-parallel-size {info.cp_size}: with Transformer Engine's layers not yet (its THD "
            "context parallelism splits every sequence); pass --transformer-impl local for the fused attention's"
        )
    if info.pp_size > 1:
        _check_pipeline(model)
    needs_te = sorted({"layernorm", "moe_act"} & set(train.recompute_modules or []))
    if needs_te and not model.te:  # Megatron recomputes these through Transformer Engine's checkpoint
        raise ModelConfigError(f"--recompute-modules {' '.join(needs_te)}: needs Transformer Engine (a GPU)")


def _check_pipeline(model: MegatronModel) -> None:
    """What pipeline parallelism does not run with yet, refused by name."""
    train, info = model.cfg, model.info
    flag = f"--pipeline-model-parallel-size {info.pp_size}"
    refused = {
        "--shared-prefix-training": train.shared_prefix_training,
        f"--context-parallel-size {info.cp_size}": info.cp_size > 1,
        # a recomputed MoE layer's load-balancing loss takes the coefficient of the backward's moment,
        # which an idle micro-batch's does not share
        f"--moe-aux-loss-coef {train.moe_aux_loss_coef} and MoE layers recomputed": (
            model.spec.moe is not None and train.moe_aux_loss_coef > 0 and train.recomputes_moe
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
    reason = check_deepstack_stage(model.hf_config, model.spec.num_layers, model.layer_split)
    if reason:
        raise ModelConfigError(f"{flag}: {reason}")
