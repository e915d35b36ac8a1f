"""The RL loop (``slime-mt train``), written out step by step.

Launched with ``torchrun`` (one process per TP rank) or as one process. Rank 0 owns the engines, the
data and the rollout; every rank owns its Megatron shard. Per step:

  rollout (rank 0) -> finalize (--sample-format, --merge-step-wise) -> advantages -> broadcast
  -> Megatron train step(s) (each DP rank takes its prompt groups) -> HF weights to the engine
  (weight_version = the step) -> metrics
  -> checkpoint every --save-interval and at the end.

``--async`` (slime's ``train_async``): the rollout of step k+1 runs (engine thread + rollout loop)
while step k trains, and finishes before the new weights go to the engines, so every token it
generates is exactly one version behind the step that trains it; TIS (--use-tis) corrects for it.

``--fully-async``: rank 0's ``RolloutManager`` generates groups without stopping; each step takes
the next finished groups within ``--max-staleness`` and the new weights reach the engines in the
middle of generation through the client's ``UpdateGate`` (pause, abort, update, continue; turns
resume with ``--partial-rollout``). A checkpoint requeues the groups not yet trained.

Every mode records each trained token's version gap (``rollout/version_gap_tokens/<gap>``) and the
trained group indices (``trained_groups`` in metrics.jsonl). Ctrl-C finishes the current step, saves,
and stops the engines.

Weights reach the engines through the client's ``UpdateGate`` in every mode: nothing generates while
they change, whatever a rollout function left running.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import signal
import statistics
import time
from pathlib import Path

import torch.distributed as dist

from slime_mt.algo.advantages import compute_advantages
from slime_mt.config import Config, ConfigError
from slime_mt.data import PromptDataset
from slime_mt.engine.client import UpdateGate
from slime_mt.engine.weight_sync import WeightFolders
from slime_mt.rollout.failures import RolloutFailedError, StepReport
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.group_rollout import rollout_output
from slime_mt.rollout.manager import RolloutManager
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.rollout.staleness import drop_metrics, mask_stale, staleness_metrics
from slime_mt.run_dir import ERRORS_FILE, run_dir_of
from slime_mt.types import Status

logger = logging.getLogger(__name__)


class TrainSetupError(RuntimeError):
    """Something the run needs is missing or broken; raised before anything is written."""


@dataclasses.dataclass
class RolloutSide:
    """What rank 0 owns: engines, rollout context, data, rollout function, metrics."""

    engines: object
    ctx: object
    data: PromptDataset
    eval_data: PromptDataset | None
    rollout_fn: object
    metrics: object
    weight_folders: WeightFolders | None  # engines outside this process load weights from these
    errors_path: Path  # RUN_DIR/errors.jsonl: every failed sample with its traceback
    data_state_before_prefetch: dict | None = None
    failed_steps: int = 0  # consecutive steps in which every sample failed


def preflight(cfg: Config) -> None:
    """Check every input before anything is launched or written; one clear error per problem."""
    from slime_mt.backends.megatron.models import check_tp, decoder_spec, read_hf_config
    from slime_mt.data import load_rows

    t = cfg.train
    if not t.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required: the Hugging Face model folder to train")
    if not Path(t.hf_checkpoint).is_dir():
        raise TrainSetupError(f"--hf-checkpoint {t.hf_checkpoint}: model folder not found")
    check_tp(
        decoder_spec(read_hf_config(t.hf_checkpoint), f"{t.hf_checkpoint}/config.json"), t.tensor_model_parallel_size
    )
    if not cfg.data.prompt_data:
        raise ConfigError("--prompt-data is required: a .jsonl or .parquet file of prompts")
    load_rows(cfg.data.prompt_data, cfg.data)
    if cfg.data.eval_prompt_data:
        load_rows(cfg.data.eval_prompt_data, cfg.data)
    check_plugins(cfg)
    for url in cfg.engine.engine_url or []:
        from slime_mt.engine.server import wait_healthy

        try:
            wait_healthy(url, timeout=10.0)
        except TimeoutError as e:
            raise TrainSetupError(f"--engine-url {url} does not answer: {e}") from None
    if cfg.checkpoint.load and not (Path(cfg.checkpoint.load) / "latest").is_file():
        raise TrainSetupError(f"--load {cfg.checkpoint.load}: no checkpoint there (no 'latest' file)")


def check_plugins(cfg: Config):
    """Import every plug-in the run names and check it against its contract -> the env module (None
    without ``--rollout-interaction-env-path``)."""
    from slime_mt.plugins import load_function, load_module
    from slime_mt.rollout.group_rollout import _expected_rollout, load_plugins

    r = cfg.rollout
    if r.slime_compat:
        from slime_mt.compat import install

        install()
    load_function(r.rollout_function_path, _expected_rollout, "--rollout-function-path")
    load_plugins(r)
    if r.context_policy_path:
        load_function(r.context_policy_path, what="--context-policy-path")
    if not r.rollout_interaction_env_path:
        return None
    module = load_module(r.rollout_interaction_env_path)
    if not callable(getattr(module, "build_env", None)):
        raise TrainSetupError(
            f"--rollout-interaction-env-path {r.rollout_interaction_env_path}: "
            "the module defines no build_env(sample=None, args=None, **kw)"
        )
    return module


def dry_run(cfg: Config) -> list[str]:
    """What ``--dry-run`` checks beyond the settings: every plug-in imports and fits its contract, the
    first prompt row reads, and one environment is built from it (reset, then closed) -> report lines."""
    import asyncio
    import inspect

    from slime_mt.data import load_rows

    module = check_plugins(cfg)
    lines = ["plug-ins: imported and checked"]
    path = cfg.data.prompt_data
    if not path or not Path(path).is_file():
        return lines + [f"--prompt-data {path}: not there yet; no row read, no environment built"]
    rows = load_rows(path, cfg.data, limit=1)
    lines.append(f"--prompt-data {path}: row 0 read")
    if module is None:
        return lines
    sample = PromptDataset(rows, 1).get_samples(1)[0][0]

    async def build_reset_close():
        env = module.build_env(sample=sample, args=cfg.to_args())
        for method in ("reset", "close"):
            result = getattr(env, method)()
            if inspect.isawaitable(result):
                await result
        return env

    try:
        env = asyncio.run(build_reset_close())
    except Exception as e:
        raise TrainSetupError(
            f"--rollout-interaction-env-path {cfg.rollout.rollout_interaction_env_path}: building the "
            f"environment of row 0 raised {type(e).__name__}: {e}"
        ) from e
    return lines + [f"environment of row 0: {type(env).__name__} built, reset and closed"]


def _setup_rollout(cfg: Config, run_dir: Path) -> RolloutSide:
    from slime_mt.engine.launch import start_engines
    from slime_mt.metrics import MetricsLogger
    from slime_mt.plugins import load_function
    from slime_mt.rollout.context import RolloutContext

    data = PromptDataset.from_config(cfg.data.prompt_data, cfg.data, cfg.rollout.n_samples_per_prompt)
    eval_data = None
    if cfg.data.eval_prompt_data:
        eval_data = PromptDataset.from_config(
            cfg.data.eval_prompt_data, cfg.data, cfg.rollout.n_samples_per_eval_prompt
        )
    engines = start_engines(
        cfg.engine,
        cfg.train.hf_checkpoint,
        run_dir / "logs",
        seed=cfg.train.seed,
        tp_size=cfg.train.tensor_model_parallel_size,
    )
    ctx = RolloutContext.create(cfg, cfg.train.hf_checkpoint, engines.url, engines.worker_urls)
    ctx.client.gate = UpdateGate()
    if cfg.rollout.slime_compat:
        from slime_mt.compat import SlimeCompat

        compat = SlimeCompat.activate(ctx)
        for dataset in (data, eval_data):
            if dataset is not None:
                compat.adopt_dataset(dataset, cfg.data.apply_chat_template)
    rollout_fn = load_function(cfg.rollout.rollout_function_path, what="--rollout-function-path")
    metrics = MetricsLogger(run_dir, use_wandb=cfg.checkpoint.use_wandb, wandb_project=cfg.checkpoint.wandb_project)
    folders = None if engines.local_engines else WeightFolders(run_dir / "weights", cfg.engine.keep_weight_versions)
    return RolloutSide(engines, ctx, data, eval_data, rollout_fn, metrics, folders, run_dir / ERRORS_FILE)


def _prepare(cfg: Config, groups) -> tuple[list, list[float], dict]:
    samples = [s for g in groups for s in g]
    train_samples, merge_metrics = finalize(
        samples, cfg.rollout.sample_format, cfg.rollout.merge_step_wise, cfg.rollout.mask_truncated
    )
    a = cfg.algo
    advantages = compute_advantages(
        train_samples, a.advantage_estimator, a.normalize_advantages_std, a.normalize_advantages
    )
    return train_samples, advantages, merge_metrics


def _sync_weights(actor, side: RolloutSide | None, version: int) -> None:
    """New weights to every engine as ``version`` (collective: every rank streams its shards to global
    rank 0, which pushes them): in-process for embedded engines, a safetensors folder otherwise (the
    folders no engine needs are deleted once every engine has acknowledged this one). The client's
    update gate pauses and empties the engines only around the update itself."""
    stream = actor.iter_hf_weights()
    if side is None:
        for _ in stream:
            pass
        return
    engines = side.engines
    if engines.local_engines:
        named = dict(stream)
        with _gate_closed(side):
            for engine in engines.local_engines:
                engine.update_weights_from_tensors(named, weight_version=str(version))
        return
    folder = side.weight_folders.write(version, stream)
    with _gate_closed(side):
        side.ctx.run_sync(side.ctx.client.update_weights_from_disk(str(folder), weight_version=str(version)))
    side.weight_folders.acknowledged(version)


@contextlib.contextmanager
def _gate_closed(side: RolloutSide):
    """No request inside an engine for the duration (a no-op without an update gate)."""
    client = side.ctx.client
    if client.gate is None:
        yield
        return
    side.ctx.run_sync(client.gate.close(client))
    try:
        yield
    finally:
        side.ctx.run_sync(client.gate.open(client))


def _version_metrics(groups, version: int) -> dict[str, float]:
    """Weight versions the samples were generated with, and the gap to the version being trained."""
    versions = [int(v) for g in groups for s in g for v in s.weight_versions if str(v).isdigit()]
    if not versions:
        return {"rollout/weight_version_gap": 0.0}
    return {
        "rollout/weight_version_gap": float(version - min(versions)),
        "rollout/sample_weight_version_min": float(min(versions)),
        "rollout/sample_weight_version_max": float(max(versions)),
    }


def _broadcast(obj, info):
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_failures(
    side: RolloutSide, step: int, groups, max_failed_steps: int
) -> tuple[StepReport, RolloutFailedError | None]:
    """Log the step's failed and truncated samples and keep the failures -> (the report, the error that
    stops the run when every sample failed ``max_failed_steps`` steps in a row, else None)."""
    report = StepReport(step, groups)
    report.log(side.errors_path)
    side.failed_steps = side.failed_steps + 1 if report.all_failed else 0
    if side.failed_steps < max_failed_steps:
        return report, None
    first = next(s for g in groups for s in g)
    return report, RolloutFailedError(
        f"step {step}: every sample failed ({report.line()}), {side.failed_steps} step(s) in a row "
        f"(--max-failed-steps {max_failed_steps}); nothing to train on. First: sample {first.index}: "
        f"{first.metadata.get('error', '')}. Every failure with its traceback: {side.errors_path}"
    )


def train(cfg: Config, run_dir: Path | None = None) -> None:
    """The RL loop; ``run_dir``: the run folder (default: ``run_dir_of(cfg)``)."""
    from slime_mt.backends.megatron.actor import MegatronActor
    from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel

    info = init_parallel(cfg.train.tensor_model_parallel_size, cfg.train.seed)
    run_dir = run_dir or run_dir_of(cfg)
    r = cfg.rollout
    prompts_per_step = cfg.train.global_batch_size // r.n_samples_per_prompt
    steps_per_rollout = max(r.rollout_batch_size // prompts_per_step, 1)
    actor = MegatronActor(
        cfg.train.hf_checkpoint,
        cfg.train,
        cfg.algo,
        info,
        temperature=r.rollout_temperature,
        norm_max_len=r.rollout_max_context_len,
        total_steps=r.num_rollout * steps_per_rollout,
    )
    side = _setup_rollout(cfg, run_dir) if info.is_main else None
    start = 0
    manager = None
    stop = {"requested": False}

    def request_stop(signum, frame):
        stop["requested"] = True
        logger.warning("interrupt: finishing this step, saving, stopping engines")

    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        if cfg.checkpoint.load:
            extra = actor.load(cfg.checkpoint.load)
            start = int(extra["rollout_step"])
            if side is not None:
                side.data.load_state_dict(extra["data"])
                side.metrics.truncate_after(start)
        if side is not None:
            side.ctx.start_version = start
        if cfg.checkpoint.load or cfg.engine.engine_url:
            # the engines serve the run's starting weights as its starting version: a resumed run's
            # checkpoint, and for engines the run did not start, whatever an earlier run left there
            _sync_weights(actor, side, start)
        pool = (
            concurrent.futures.ThreadPoolExecutor(1, "slime-mt-async-rollout")
            if cfg.rollout.async_mode and side
            else None
        )
        if side is not None and r.fully_async:
            manager = RolloutManager(side.ctx, side.data, version=start)
            manager.start()
        pending = None
        rollout_done = None  # --async: when the last prefetched rollout finished (perf_counter)
        for step in range(start, r.num_rollout):
            t0 = time.perf_counter()
            payload = None
            if side is not None:
                extra: dict[str, float] = {}
                if manager is not None:
                    batch = side.ctx.run_sync(manager.take(step))
                    groups, rollout_seconds = batch.groups, batch.trainer_wait_seconds
                    rollout_started = time.time() - rollout_seconds
                    extra = _batch_metrics(batch)
                elif pending is not None:
                    waited = time.perf_counter()
                    groups, rollout_started, rollout_seconds, rollout_done = pending.result()
                    extra["time/trainer_idle_seconds"] = time.perf_counter() - waited
                else:
                    groups, rollout_started, rollout_seconds, _ = _timed_rollout(side, step)
                    extra["time/trainer_idle_seconds"] = rollout_seconds
                groups, returned_metrics = rollout_output(groups)
                extra.update(returned_metrics)
                if side.ctx.compat is not None:
                    side.ctx.compat.adopt_groups(groups)
                report, stop_run = _check_failures(side, step, groups, r.max_failed_steps)
                train_samples, advantages, merge_metrics = _prepare(cfg, groups)
                if r.mask_offpolicy_in_partial_rollout:
                    trainable = sum(sum(s.loss_mask) for s in train_samples)
                    masked = mask_stale(train_samples, step, r.max_staleness)
                    extra["rollout/masked_stale_tokens"] = masked
                    extra["async/masked_token_share"] = masked / max(trainable, 1)
                extra.update(staleness_metrics(train_samples, step))
                trained_groups = sorted(int(g[0].group_index) for g in groups if g)
                pending = None
                if pool is not None and step + 1 < r.num_rollout and stop_run is None:
                    if rollout_done is not None:
                        extra["time/rollout_idle_seconds"] = time.perf_counter() - rollout_done
                    pending = pool.submit(_timed_rollout, side, step + 1)
                payload = (
                    train_samples,
                    advantages,
                    merge_metrics,
                    rollout_metrics(groups),
                    rollout_seconds,
                    rollout_started,
                    {**_version_metrics(groups, step), **extra},
                )
                if stop_run is not None:  # every rank stops, not only this one
                    payload = stop_run
            payload = _broadcast(payload, info)
            if isinstance(payload, RolloutFailedError):
                raise payload
            train_samples, advantages, merge_metrics, r_metrics, rollout_seconds, rollout_started, versions = payload
            train_started = time.time()
            if any(s.num_trainable for s in train_samples):
                t_metrics = actor.train(
                    train_samples,
                    advantages,
                    prompts_per_step=prompts_per_step,
                    on_policy=not (r.async_mode or r.fully_async),
                )
            else:  # every sample failed (below --max-failed-steps) or none kept a trainable token
                logger.warning("step %d: no trainable token in the batch; the step is skipped", step)
                t_metrics = {"train/seconds": 0.0, "train/skipped_steps": 1.0}
            train_finished = time.time()
            drained_seconds = 0.0
            if pending is not None:  # --async: the prefetched rollout ends under the weights it started with
                waited = time.perf_counter()
                concurrent.futures.wait([pending])
                drained_seconds = time.perf_counter() - waited
            t_sync = time.perf_counter()
            _sync_weights(actor, side, step + 1)
            sync_seconds = time.perf_counter() - t_sync
            if manager is not None:
                side.ctx.run_sync(manager.set_version(step + 1))
            if side is not None:
                metrics = {
                    **r_metrics,
                    **t_metrics,
                    **merge_metrics,
                    **versions,
                    "rollout/weight_version": float(step + 1),
                    "time/rollout_seconds": rollout_seconds,
                    "time/train_seconds": t_metrics["train/seconds"],
                    "time/sync_seconds": sync_seconds,
                    "time/step_seconds": time.perf_counter() - t0,
                    "time/rollout_started": rollout_started,
                    "time/train_started": train_started,
                    "time/train_finished": train_finished,
                }
                if drained_seconds:
                    metrics["time/trainer_idle_seconds"] = (
                        metrics.get("time/trainer_idle_seconds", 0.0) + drained_seconds
                    )
                if not (r.async_mode or r.fully_async):  # the engines wait while the step trains and syncs
                    metrics["time/rollout_idle_seconds"] = t_metrics["train/seconds"] + sync_seconds
                if cfg.checkpoint.eval_interval and (step + 1) % cfg.checkpoint.eval_interval == 0 and side.eval_data:
                    metrics.update(_evaluate(cfg, side, step))
                side.metrics.log(step, metrics, {"trained_groups": trained_groups}, note=report.line())
            last = step + 1 == r.num_rollout or stop["requested"]
            if cfg.checkpoint.save and (
                last or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)
            ):
                data_state = side.data.state_dict() if side is not None else None
                if manager is not None:  # groups drawn and not yet trained are drawn again by a resumed run
                    data_state = side.ctx.run_sync(manager.data_state())
                if pending is not None:  # the prefetched rollout already advanced the data: save the cursor before it
                    data_state = side.data_state_before_prefetch
                actor.save(cfg.checkpoint.save, _broadcast({"rollout_step": step + 1, "data": data_state}, info))
            if stop["requested"]:
                break
    finally:
        signal.signal(signal.SIGINT, previous)
        if manager is not None:
            side.ctx.run_sync(manager.stop())
        if side is not None:
            side.metrics.close()
            side.ctx.close()
            side.engines.stop()
        destroy_parallel()


def _timed_rollout(side: RolloutSide, step: int):
    side.data_state_before_prefetch = side.data.state_dict()
    started = time.time()
    began = time.perf_counter()
    groups = side.rollout_fn(side.ctx.args, step, side.data)
    finished = time.perf_counter()
    return groups, started, finished - began, finished


def _batch_metrics(batch) -> dict[str, float]:
    """What a fully-async step's wait for its groups saw."""
    samples = [s for g in batch.groups for s in g]
    return {
        "async/dropped_groups": batch.dropped_groups,
        "async/stale_groups": batch.stale_groups,
        "async/filtered_groups": batch.filtered_groups,
        "async/partial_resumes": sum(s.metadata.get("partial_resumes", 0) for s in samples),
        "async/regenerated_turns": sum(s.metadata.get("regenerated_turns", 0) for s in samples),
        "time/trainer_idle_seconds": batch.trainer_wait_seconds,
        "time/rollout_idle_seconds": batch.rollout_idle_seconds,
        **drop_metrics(batch.groups, batch.dropped),
    }


def _evaluate(cfg: Config, side: RolloutSide, step: int) -> dict[str, float]:
    eval_rollout = dataclasses.replace(
        cfg.rollout,
        n_samples_per_prompt=cfg.rollout.n_samples_per_eval_prompt,
        rollout_temperature=cfg.rollout.rollout_temperature
        if cfg.rollout.eval_temperature is None
        else cfg.rollout.eval_temperature,
        rollout_batch_size=len(side.eval_data.rows),
        dynamic_sampling_filter_path=None,
    )
    ctx = dataclasses.replace(side.ctx, rollout=eval_rollout)
    side.eval_data.load_state_dict({"epoch": 0, "cursor": 0, "next_group": 0})
    from slime_mt.rollout.group_rollout import rollout_groups

    groups = ctx.run_sync(rollout_groups(ctx, side.eval_data, evaluation=True, rollout_id=10_000_000 + step))
    StepReport(step, groups, label="eval at step").log(side.errors_path)
    rewards = [float(s.reward or 0.0) for g in groups for s in g if s.status != Status.FAILED]
    return {
        "eval/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "eval/pass_rate": sum(x > 0 for x in rewards) / max(len(rewards), 1),
        "eval/samples": len(rewards),
    }
