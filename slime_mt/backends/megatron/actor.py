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
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.algo.batching import RankShare, micro_batches_by_count, micro_batches_by_tokens, split_by_dp
from slime_mt.algo.losses import LossInputs, policy_loss, sft_loss
from slime_mt.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from slime_mt.backends.megatron.convert import (
    CheckpointReader,
    TPGather,
    iter_hf_to_megatron,
    iter_megatron_to_hf,
    load_into,
    text_prefix,
)
from slime_mt.backends.megatron.logprobs import hidden_logprobs
from slime_mt.backends.megatron.models import (
    TextPolicy,
    build_gpt,
    decoder_spec,
    have_transformer_engine,
    padded_vocab,
    read_hf_config,
)
from slime_mt.backends.megatron.packing import PackedRow, pack_row, pack_tree_row, tree_keys
from slime_mt.backends.megatron.parallel import ParallelInfo, current_device
from slime_mt.backends.megatron.prefix_tree import PrefixTrie
from slime_mt.backends.megatron.vlm import build_vlm
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.errors import ModelConfigError
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
        self.te = have_transformer_engine()
        self.hf_config = read_hf_config(hf_path)
        self.spec = decoder_spec(self.hf_config, f"{hf_path}/config.json")
        if train.shared_prefix_training and (self.te or train.local_attention != "fused"):
            raise ModelConfigError(
                "--shared-prefix-training needs the fused local attention (--local-attention fused, "
                "no Transformer Engine)"
            )
        reader = CheckpointReader(hf_path)
        self.prefix = text_prefix(reader.names())
        self.policy = self._build(reader)
        self.model = DistributedDataParallel(
            self.policy.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
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
            )
        else:
            gpt = build_gpt(
                self.spec, self.info.tp_size, self.dtype, self.device, self.te, self.train_cfg.local_attention
            )
            load_into(gpt, iter_hf_to_megatron(reader, self.spec, self.info.tp_rank, self.info.tp_size, self.te))
            model = TextPolicy(gpt)
        if frozen:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model

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

    def pack(self, samples: list[TrainingSample], indices: list[int]) -> PackedRow:
        """A packed row of ``samples[indices]`` on the trainer's device (a prefix tree with
        ``--shared-prefix-training``)."""
        if self.train_cfg.shared_prefix_training:
            return pack_tree_row(samples, indices, self._mrope, self._image_token_id).to(self.device)
        return pack_row(samples, indices, self._mrope, self.layout).to(self.device)

    def _logprobs(self, module, row: PackedRow, with_entropy: bool, temperature: float):
        """(log-probs ``[T]``, entropy ``[T]`` or None) of the row's response tokens; the entropy
        carries a gradient only when the loss has an entropy term."""
        extra = (
            {"pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw, "image_order": row.image_order}
            if self._mrope
            else {}
        )
        hidden = module.hidden(row.tokens, row.position_ids, row.attention_mask, row.packed_seq_params, **extra)
        rows = hidden[:, 0].index_select(0, row.logit_index)  # [T, H]
        return hidden_logprobs(
            rows,
            module.output_weight(),
            row.targets,
            self.spec.vocab_size,
            temperature,
            with_entropy,
            chunk=self.logit_chunk_rows,
            entropy_grad=self.algo.entropy_coef != 0,
        )

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

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def compute_logprobs(
        self, samples: list[TrainingSample], indices: list[int] | None = None, reference: bool = False
    ) -> list[torch.Tensor | None]:
        """Response log-probs ``[len(response)]`` of ``samples[indices]`` (all by default; None for the
        others), at the rollout temperature; nothing is trained."""
        module = self.reference if reference else self.policy
        was_training = module.training
        module.eval()
        out: list[torch.Tensor | None] = [None] * len(samples)
        indices = list(range(len(samples))) if indices is None else indices
        for row_indices in self._rows(samples, indices):
            row = self.pack(samples, row_indices)
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

    def train(self, share: RankShare, on_policy: bool = True) -> dict[str, float]:
        """One pass over this rank's ``share`` of the step, one optimizer step per mini-batch (all DP
        ranks together)."""
        started = time.perf_counter()
        need_old = not self.train_cfg.sft and (not on_policy or share.mini_batches > 1)
        old = ref = None
        self.kept_log_probs = {}
        everything = sorted(range(len(share.samples)), key=lambda k: share.indices[k])  # in batch order
        if need_old:
            with maybe_span(self.timeline, "old log-probs", "train", lane="train"):
                old = self.compute_logprobs(share.samples, everything)
            if self.keep_log_probs:
                self.kept_log_probs = {share.indices[k]: old[k].tolist() for k in everything}
        if self.reference is not None:
            with maybe_span(self.timeline, "reference log-probs", "train", lane="train"):
                ref = self.compute_logprobs(share.samples, everything, reference=True)
        totals: dict[str, float] = collections.defaultdict(float)
        for m in range(share.mini_batches):
            with maybe_span(self.timeline, "forward-backward", "train", lane="train", mini_batch=m):
                sums = self.accumulate_gradients(share, m, old, ref)
            metrics = {f"train/{k}": v for k, v in sums.items()}
            with maybe_span(self.timeline, "optimizer step", "train", lane="train", mini_batch=m):
                metrics.update(self.apply_gradients())
            for k, v in metrics.items():
                totals[k] += v / share.mini_batches
        totals["train/seconds"] = time.perf_counter() - started
        totals["train/optimizer_steps"] = share.mini_batches
        return dict(totals)

    def accumulate_gradients(
        self, share: RankShare, m: int = 0, old: list | None = None, ref: list | None = None
    ) -> dict[str, float]:
        """Forward/backward of mini-batch ``m`` of this rank's ``share`` into the (zeroed) gradient
        buffers, then ``finalize_model_grads``. ``old``, ``ref``: log-probs by position in the share.
        -> metric sums over the global mini-batch."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        samples = share.samples
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, float] = collections.defaultdict(float)
        temperature = 1.0 if self.train_cfg.sft else self.temperature
        for row_indices in self._rows(samples, share.of_mini_batch(m)):
            row = self.pack(samples, row_indices)
            lp, entropy = self._logprobs(self.policy, row, with_entropy=not self.train_cfg.sft, temperature=temperature)
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
            )
            loss, metrics = sft_loss(inputs) if self.train_cfg.sft else policy_loss(inputs, self.algo)
            (loss * self.info.dp_size).backward()  # DDP averages over DP ranks; the weights are global
            metrics["loss"] = float(loss.detach())
            metrics["tokens"] = sum(len(samples[i].response_ids) for i in row.sample_index)
            if self.train_cfg.shared_prefix_training:
                metrics["tokens_before_sharing"] = sum(row.lengths)
                metrics["tokens_after_sharing"] = row.num_real_tokens
            for k, v in metrics.items():
                sums[k] += v
        finalize_model_grads([self.model])
        return self._dp_sum(sums)

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

    def _device_storages(self) -> list[tuple[torch.UntypedStorage, bool]]:
        """Every storage on the device that holds the trainer's state, once: parameters (and their fp32
        main copies), gradient buffers, optimizer state, the reference model -> (storage, whether its
        content must survive an offload; gradients need not, every step zeroes them first)."""
        tensors: list[tuple[torch.Tensor, bool]] = []
        for module in (self.model, self.reference):
            for param in module.parameters() if module is not None else []:
                tensors.append((param, True))
                for attr, keep in (("main_param", True), ("main_grad", False)):
                    if isinstance(getattr(param, attr, None), torch.Tensor):
                        tensors.append((getattr(param, attr), keep))
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(optimizer, "optimizer", optimizer)
            tensors += [(param, True) for group in inner.param_groups for param in group["params"]]
            tensors += [(v, True) for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
        found: dict[int, list] = {}  # by the storage's address: views of one buffer share it
        for tensor, keep in tensors:
            storage = tensor.untyped_storage()
            if tensor.device.type == self.device.type and storage.nbytes() > 0:
                entry = found.setdefault(storage.data_ptr(), [storage, False])
                entry[1] = entry[1] or keep
        return [(storage, keep) for storage, keep in found.values()]

    def device_bytes(self) -> int:
        """Bytes of the trainer's state on its device now (0 while offloaded)."""
        return sum(storage.nbytes() for storage, _ in self._device_storages())

    def offload(self) -> None:
        """Free the device while colocated engines generate: every storage of parameters, gradients and
        optimizer state is copied to (pinned) host memory, gradients are not, and its device memory is
        released in place, so every view of it (DDP's buffers, ``main_grad``) stays valid for ``onload``."""
        if getattr(self, "_offloaded", None) is not None:
            return
        pin = self.device.type == "cuda"
        offloaded = []
        for storage, keep in self._device_storages():
            backup = None
            if keep:
                backup = torch.UntypedStorage(storage.nbytes(), device="cpu")
                backup.copy_(storage)
                backup = backup.pin_memory() if pin else backup
            offloaded.append((storage, storage.nbytes(), backup))
            storage.resize_(0)
        self._offloaded = offloaded
        if pin:
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """The trainer's state back on its device, bit for bit (gradients zeroed)."""
        offloaded, self._offloaded = getattr(self, "_offloaded", None), None
        for storage, nbytes, backup in offloaded or []:
            storage.resize_(nbytes)
            if backup is None:
                storage.fill_(0)
            else:
                storage.copy_(backup)

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
                out[k] += v
        return dict(out)

    # ------------------------------------------------------------------ weights for the engine

    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def _tp_gather(self) -> TPGather:
        """Gathers to global rank 0 (the rank that pushes weights); DP replicas other than 0 take no part."""
        from megatron.core import parallel_state

        return TPGather(self.info.tp_size, self._tp_group(), parallel_state.get_tensor_model_parallel_src_rank())

    def iter_hf_weights(
        self, tensors: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(HF name, full tensor on global rank 0 / None elsewhere), one tensor at a time. Collective
        over the TP group of DP rank 0; other DP ranks yield nothing. ``tensors``: megatron-named
        decoder tensors to export instead of the weights (gradients, optimizer states)."""
        if self.info.dp_rank != 0:
            return
        state = tensors if tensors is not None else self.policy.decoder_state_dict()
        yield from iter_megatron_to_hf(state, self.spec, self._tp_gather(), self.prefix, self.te)
        if tensors is None and hasattr(self.policy, "vision_state_dict"):
            here = self.info.rank == 0
            for name, t in self.policy.vision_state_dict().items():
                yield name, t.clone() if here else None

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
