"""The RL loop (``slime-mt train``): it knows roles, not ranks, and reads top to bottom like slime's
``train.py``: generate -> train -> update weights -> log -> checkpoint.

  roles/rollout.RolloutRole  engines, data, rollout function or fully-async manager, metrics
  roles/batches              its next batch, one source per mode (sync, --async, --fully-async)
  roles/train.TrainRole      every trainer rank: train on its share, export the weights (collective)
  roles/link                 each rank's end of the rollout role: the rank that hosts it, or a peer

The launchers (``launch/ranks.py`` for one process and torchrun, ``launch/ray`` for ``--ray``) give
every process its roles and run ``run`` in each; every rank runs the same loop on its own ends.
Per step:

  rollout -> finalize (--sample-format, --merge-step-wise) -> advantages -> split by DP rank
  -> Megatron train step(s) (each rank on its share) -> HF weights to the engines
  (weight_version = the step) -> metrics
  -> checkpoint every --save-interval and at the end.

``--async`` (slime's ``train_async``): the rollout of step k+1 runs (engine thread + rollout loop)
while step k trains, and finishes before the new weights go to the engines, so every token it
generates is exactly one version behind the step that trains it; TIS (--use-tis) corrects for it.

``--fully-async``: the rollout role's ``RolloutManager`` generates groups without stopping; each step
takes the next finished groups within ``--max-staleness`` and the new weights reach the engines in
the middle of generation through the client's ``UpdateGate`` (pause, abort, update, continue; turns
resume with ``--partial-rollout``). A checkpoint requeues the groups not yet trained.

Every mode records each trained token's version gap (``rollout/version_gap_tokens/<gap>``) and the
trained group indices (``trained_groups`` in metrics.jsonl). Ctrl-C finishes the current step, saves,
and stops the engines.

Weights reach the engines through the client's ``UpdateGate`` in every mode: nothing generates while
they change, whatever a rollout function left running.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

from slime_mt.backends.megatron.checkpoint import read_latest
from slime_mt.backends.megatron.peft import write_merged
from slime_mt.config import Config
from slime_mt.config.training import adapter_updates
from slime_mt.engine.weights.adapters import ADAPTER_CONFIG
from slime_mt.errors import ConfigError, RolloutFailedError
from slime_mt.roles.steps import StepTimes
from slime_mt.roles.train import TrainRole
from slime_mt.run_dir import run_dir_of
from slime_mt.stop import StopRequest, on_stop_signals


def run(cfg: Config, trainer: TrainRole, rollout, stop_requested: threading.Event) -> int:
    """The RL loop on this process's roles (``rollout``: its end of the rollout role, ``roles/link``)
    -> the steps done when it stopped (``num_rollout`` unless a stop request ended it early).
    ``stop_requested`` (Ctrl-C, the Ray driver's) acts after the step it arrives in: the step finishes,
    saves and stops, on every rank."""
    r, checkpoint = cfg.rollout, cfg.checkpoint
    colocated, offload = cfg.cluster.colocate, cfg.cluster.offload
    start = 0
    if checkpoint.load:
        start, data_state = trainer.load(checkpoint.load)
        rollout.resume(start, data_state)
    started_elsewhere = cfg.engine.engine_url and not cfg.cluster.ray and not cfg.debug.train_only
    if checkpoint.load or cfg.train.lora_adapter_path or adapter_updates(cfg) or started_elsewhere:
        # the engines serve the run's starting weights as its starting version: a resumed run's
        # checkpoint, a LoRA run's adapter (the engines serve it by name), and for engines the run did
        # not start, whatever an earlier run left there (under --ray the run started them, from
        # --hf-checkpoint)
        trainer.export_weights(rollout.push_weights, start)
    rollout.begin(start)
    if offload:
        trainer.offload()  # the engines generate first

    def save_if_due(step: int, stopping: bool) -> None:
        last = step + 1 == r.num_rollout or stopping
        if checkpoint.save and (last or (checkpoint.save_interval and (step + 1) % checkpoint.save_interval == 0)):
            trainer.save(checkpoint.save, step + 1, rollout.data_state())

    colocate_metrics: dict[str, float] = {}
    for step in range(start, r.num_rollout):
        t0 = time.perf_counter()
        share = rollout.next_share(step)  # generate: this rank's share of the step's batch
        if offload:
            trainer.onload()  # the engines released their memory for the step
        train_metrics, train_started, train_finished = trainer.train(step, share)
        rollout.trained(step, trainer.kept_log_probs(), keep=bool(cfg.debug.save_debug_rollout_data))
        drained_seconds = rollout.drain()
        sync_seconds = trainer.export_weights(rollout.push_weights, step + 1)  # update weights
        stopping = rollout.stop_after(stop_requested.is_set())  # every rank stops after the same step
        if colocated:  # slime's order: the checkpoint, the trainer off the device, the engines' KV cache
            save_if_due(step, stopping)
            if offload:
                colocate_metrics["colocate/trainer_bytes_while_generating"] = trainer.offload()
            rollout.wake_engines()
        rollout.weights_changed(step + 1)
        step_seconds = time.perf_counter() - t0
        times = StepTimes(
            step_seconds, train_metrics, train_started, train_finished, sync_seconds, drained_seconds, colocate_metrics
        )
        rollout.log_step(step, times, trainer.trace())
        if not colocated:
            save_if_due(step, stopping)
        if stopping:
            return step + 1
    return max(start, r.num_rollout)


def rollout_only(cfg: Config, run_dir: Path | None = None, stop: StopRequest | None = None) -> int:
    """``--debug-rollout-only``: every step's rollout, prepared as for training (finalized, advantages,
    metrics, dumps, turn records, trace) and never trained; no Megatron model is built and the
    engines keep their starting weights. Ctrl-C or SIGTERM (``stop``) stops it after the step -> the
    steps done."""
    from slime_mt.roles.rollout import RolloutRole  # the train loop's processes need not import it

    run_dir = run_dir or run_dir_of(cfg)
    stop = stop or StopRequest()
    side = RolloutRole.start(cfg, run_dir, sends_weights=False)
    try:
        side.begin(0, split=None)
        with on_stop_signals(lambda signum, frame: stop.request(signum)):
            for step in range(cfg.rollout.num_rollout):
                t0 = time.perf_counter()
                batch = side.collect(step, side.batches)
                if isinstance(batch, RolloutFailedError):
                    raise batch
                metrics = {
                    **batch.rollout_metrics,
                    **batch.merge_metrics,
                    **batch.metrics,
                    "time/rollout_seconds": batch.rollout_seconds,
                    "time/rollout_started": batch.rollout_started,
                    "time/step_seconds": time.perf_counter() - t0,
                }
                side.write_step(step, batch, metrics)
                if stop.is_set():
                    return step + 1
        return cfg.rollout.num_rollout
    finally:
        side.close()


def eval_only(cfg: Config, run_dir: Path | None = None) -> int:
    """``slime-mt eval``: the held-out datasets on the weights of ``--load`` (a checkpoint: the one its
    ``latest`` names, or an ``iter_*`` folder) or else of ``--hf-checkpoint``, with the training run's
    settings and no trainer; the evaluation goes to ``RUN_DIR/eval.jsonl`` as the run logs one (its
    ``step``: the checkpoint's steps trained, 0 for an HF folder) -> that step count. The same seeds as
    the run's evaluation after that many steps: the same figures, where the engine is deterministic."""
    from slime_mt.roles.rollout import RolloutRole  # the train loop's processes need not import it

    steps_trained, served, adapter = 0, cfg.train.hf_checkpoint, cfg.train.lora_adapter_path
    if cfg.checkpoint.load:
        folder = read_latest(Path(cfg.checkpoint.load))
        steps_trained = int(json.loads((folder / "trainer_state.json").read_text())["step"])
        served, adapter = str(folder), folder if (folder / ADAPTER_CONFIG).is_file() else None
    if not cfg.evaluation.eval_prompt_data and not cfg.evaluation.eval_config:
        raise ConfigError("slime-mt eval needs held-out datasets: --eval-config or --eval-prompt-data")
    if adapter:  # a LoRA run's checkpoint (or --lora-adapter-path): its adapters folded into --hf-checkpoint
        merged = (run_dir or run_dir_of(cfg)) / f"merged_{Path(adapter).name}"
        served = str(write_merged(cfg.train.hf_checkpoint, adapter, merged))
    # the engines serve these weights as they are (merged: no adapter to load by name)
    no_lora = dict(lora_rank=0, target_modules=None, exclude_modules=None, lora_adapter_path=None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, hf_checkpoint=served, **no_lora))
    side = RolloutRole.start(cfg, run_dir or run_dir_of(cfg), sends_weights=False, version=steps_trained)
    try:
        side.evaluate(steps_trained)
    finally:
        side.close()
    return steps_trained
