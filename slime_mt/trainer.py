"""The RL loop (``slime-mt train``): the roles, wired to the processes of a run.

Launched as one process, with ``torchrun`` (one process per rank), or by ``--ray`` (one Ray actor
per rank, ``launch/ray``); each process runs ``train``. Three roles, each with a narrow interface:

  train_loop.TrainLoop      every rank: train on a batch, export the weights (collective)
  rollout_side.RolloutSide  rank 0: engines, data, rollout function, metrics; batches in, weights out
  batches.NextBatch         rank 0: the next batch, one implementation per mode (sync, --async, --fully-async)

Data flows one way: rollout side -> batch -> each rank's share (its DP rank's groups, sent to it alone)
-> train loop -> weights -> engines.
Per step:

  rollout (rank 0) -> finalize (--sample-format, --merge-step-wise) -> advantages -> split by DP rank
  -> Megatron train step(s) (each rank on its share) -> HF weights to the engine
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

import logging
import pickle
import signal
import threading
import time
from pathlib import Path

import torch.distributed as dist

from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.models import check_tp, decoder_spec, read_hf_config
from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel
from slime_mt.compat import install
from slime_mt.config import Config, RolloutConfig
from slime_mt.data import PromptDataset, load_rows
from slime_mt.errors import ConfigError, RolloutFailedError, TrainSetupError
from slime_mt.inspection.dumps import dump_path
from slime_mt.inspection.replay import ReplaySide, checked_dump
from slime_mt.plugins import judge_parser_prototype, load_function, load_module
from slime_mt.rollout.group_rollout import _expected_rollout, load_plugins
from slime_mt.rollout_side import RolloutSide
from slime_mt.run_dir import run_dir_of
from slime_mt.timeline import Timeline
from slime_mt.train_loop import TrainLoop

logger = logging.getLogger(__name__)


def preflight(cfg: Config) -> None:
    """Check every input before anything is launched or written; one clear error per problem."""
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
    d = cfg.debug
    if d.train_only and not cfg.checkpoint.load:
        first = dump_path(d.load_debug_rollout_data, 0)
        if not first.is_file():
            raise TrainSetupError(f"--load-debug-rollout-data {d.load_debug_rollout_data}: no dump of step 0 ({first})")
        checked_dump(cfg, 0)  # before a model is built: a dump of other settings stops here
    for url in [] if d.train_only else cfg.engine.engine_url or []:
        from slime_mt.engine.embedded.server import wait_healthy

        try:
            wait_healthy(url, timeout=10.0)
        except TimeoutError as e:
            raise TrainSetupError(f"--engine-url {url} does not answer: {e}") from None
    if cfg.checkpoint.load and not (Path(cfg.checkpoint.load) / "latest").is_file():
        raise TrainSetupError(f"--load {cfg.checkpoint.load}: no checkpoint there (no 'latest' file)")


def _check_compat_images(cfg: Config) -> None:
    """``--slime-compat`` hands the framework's own generate functions the rendered text prompt: with a
    dataset of images every sample would reach the engine without them (an HTTP 400 each, after the
    model loaded). Refused here, before anything starts."""
    r = cfg.rollout
    if (
        not (r.slime_compat and cfg.data.multimodal_keys)
        or r.rollout_function_path != RolloutConfig.rollout_function_path
    ):
        return
    generate = load_function(r.custom_generate_function_path)
    if (getattr(generate, "__module__", None) or "").split(".")[0] == "rollouts":
        raise TrainSetupError(
            f"--slime-compat with images (--multimodal-keys) and this project's own generate function "
            f"(--custom-generate-function-path {r.custom_generate_function_path}): under --slime-compat it gets "
            "the rendered text prompt, so the images would never reach the engine. Pass a slime-style generate "
            "function that sends them (slime's examples/geo3k_vlm_multi_turn/rollout.py with its env), or drop "
            "--slime-compat"
        )


def check_plugins(cfg: Config):
    """Import every plug-in the run names and check it against its contract -> the env module (None
    without ``--rollout-interaction-env-path``)."""
    r = cfg.rollout
    if r.slime_compat:
        install()
    load_function(r.rollout_function_path, _expected_rollout, "--rollout-function-path")
    load_plugins(r)
    _check_compat_images(cfg)
    if r.context_policy_path:
        load_function(r.context_policy_path, what="--context-policy-path")
    if cfg.judge.judge_parser_path:
        load_function(cfg.judge.judge_parser_path, judge_parser_prototype, "--judge-parser-path")
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


def _rollout_side(cfg: Config, run_dir: Path, engine_actors: list | None):
    """Rank 0's rollout side: engines and rollouts, or the saved rollouts of ``--debug-train-only``."""
    if cfg.debug.train_only:
        return ReplaySide(cfg, run_dir)
    return RolloutSide.start(cfg, run_dir, engine_actors)


def rollout_only(cfg: Config, run_dir: Path | None = None) -> None:
    """``--debug-rollout-only``: every step's rollout, prepared as for training (finalized, advantages,
    metrics, dumps, turn records, trace) and never trained; no Megatron model is built and the
    engines keep their starting weights."""
    run_dir = run_dir or run_dir_of(cfg)
    side = RolloutSide.start(cfg, run_dir)
    batches = side.begin(0)
    try:
        for step in range(cfg.rollout.num_rollout):
            t0 = time.perf_counter()
            batch = side.collect(step, batches)
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
            side.log_step(step, batch, metrics)
    finally:
        batches.close()
        side.close()


def _gather(obj, info) -> list:
    """Every rank's ``obj`` on rank 0 (a list by rank; None elsewhere)."""
    if info.world_size == 1:
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def _broadcast(obj, info):
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _send_shares(batch, split, dp_of_rank: list[int] | None, prompts_per_step: int, info):
    """Each rank's share of rank 0's ``batch`` (``split``: ``MegatronActor.split``), sent to it alone: a
    rank receives and unpickles only the groups of its DP rank (its TP peers the same ones), never the
    whole batch; a ``RolloutFailedError`` from rank 0 goes to every rank in its place. -> (this rank's
    share or the failure, rank 0: the bytes sent, ``train/batch_bytes`` for the whole batch and
    ``train/batch_bytes_per_rank`` for the largest share, when there are other ranks)."""
    failed = isinstance(batch, RolloutFailedError)
    if info.world_size == 1:
        return (batch if failed else split(batch.samples, batch.advantages, prompts_per_step)[0]), {}
    payloads, sent = None, {}
    if info.is_main:
        if failed:
            payloads = [pickle.dumps(batch)] * info.world_size
        else:
            shares = split(batch.samples, batch.advantages, prompts_per_step)
            pickled = [pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL) for share in shares]
            payloads = [pickled[dp] for dp in dp_of_rank]
            sent = {
                "train/batch_bytes": float(sum(len(p) for p in pickled)),
                "train/batch_bytes_per_rank": float(max(len(p) for p in pickled)),
            }
    out = [None]
    dist.scatter_object_list(out, payloads, src=0)
    return pickle.loads(out[0]), sent


def train(
    cfg: Config,
    run_dir: Path | None = None,
    engine_actors: list | None = None,
    stop_requested: threading.Event | None = None,
) -> int:
    """The RL loop -> the steps done when it stopped (``num_rollout`` unless Ctrl-C stopped it early);
    ``run_dir``: the run folder (default: ``run_dir_of(cfg)``). Every rank runs its
    ``TrainLoop``; rank 0 also runs the ``RolloutSide`` and the mode's ``NextBatch``. ``engine_actors``
    (``--ray``, rank 0): the engines' actors, to start again one that dies. ``stop_requested`` (``--ray``:
    the driver's Ctrl-C) acts as Ctrl-C does: rank 0's request, shared with every rank after the step's
    weight export, finishes the step, saves and stops."""
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
    timeline = Timeline(f"trainer rank {info.rank}") if cfg.debug.trace != "off" else None
    actor.timeline = timeline
    actor.keep_log_probs = bool(cfg.debug.save_debug_rollout_data)
    loop = TrainLoop(actor, on_policy=not (r.async_mode or r.fully_async), timeline=timeline)
    dp_of_rank = _gather(info.dp_rank, info)  # rank 0: the DP rank of every rank, whose share it is sent
    side = _rollout_side(cfg, run_dir, engine_actors) if info.is_main else None
    batches = None
    start = done = 0
    stop = {"requested": False}

    def request_stop(signum, frame):
        stop["requested"] = True
        logger.warning("interrupt: finishing this step, saving, stopping engines")

    in_main = threading.current_thread() is threading.main_thread()  # a Ray actor's task may not be
    previous = signal.signal(signal.SIGINT, request_stop) if in_main else None
    try:
        if cfg.checkpoint.load:
            extra = actor.load(cfg.checkpoint.load)
            start = int(extra["rollout_step"])
            if side is not None:
                side.resume(extra["data"], start)
        receive = side.push_weights if side is not None else None
        if cfg.checkpoint.load or (cfg.engine.engine_url and not cfg.cluster.ray and not cfg.debug.train_only):
            # the engines serve the run's starting weights as its starting version: a resumed run's
            # checkpoint, and for engines the run did not start, whatever an earlier run left there
            # (under --ray the run started them, from --hf-checkpoint)
            loop.export_weights(receive, start)
        if side is not None:
            batches = side.begin(start)
        colocated, offload = cfg.cluster.colocate, cfg.cluster.offload
        if offload:
            actor.offload()  # the engines generate first

        def save_if_due(step: int) -> None:
            last = step + 1 == r.num_rollout or stop["requested"]
            if cfg.checkpoint.save and (
                last or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)
            ):
                data_state = batches.data_state() if batches is not None else None
                actor.save(cfg.checkpoint.save, _broadcast({"rollout_step": step + 1, "data": data_state}, info))

        colocate_metrics: dict[str, float] = {}
        for step in range(start, r.num_rollout):
            t0 = time.perf_counter()
            batch = side.collect(step, batches) if side is not None else None
            share, sent = _send_shares(batch, actor.split, dp_of_rank, prompts_per_step, info)
            if isinstance(share, RolloutFailedError):
                raise share
            if offload:
                actor.onload()  # the engines released their memory in collect
            actor.kept_log_probs = {}  # a skipped step trains nothing and keeps none
            t_metrics, train_started, train_finished = loop.train(step, share)
            t_metrics.update(sent)
            if actor.keep_log_probs:  # every rank's share into the step's dump (TP ranks hold the same)
                kept = _gather(actor.kept_log_probs, info)
                if side is not None:
                    side.records.trained(step, {i: lp for part in kept for i, lp in part.items()})
            drained_seconds = batches.drain() if batches is not None else 0.0
            sync_seconds = loop.export_weights(receive, step + 1)
            trainer_events = _gather(timeline.drain() if timeline is not None else [], info)
            requested = stop["requested"] or (stop_requested is not None and stop_requested.is_set())
            stop["requested"] = _broadcast(requested, info)  # rank 0's: every rank stops after the same step
            if colocated:  # slime's order: the checkpoint, the trainer off the device, the engines' KV cache
                save_if_due(step)
                if offload:
                    actor.offload()
                    colocate_metrics["colocate/trainer_bytes_while_generating"] = float(actor.device_bytes())
                if side is not None:
                    side.wake_engines()
            if side is not None:
                batches.weights_changed(step + 1)
                metrics = {
                    **batch.rollout_metrics,
                    **t_metrics,
                    **batch.merge_metrics,
                    **batch.metrics,
                    "rollout/weight_version": float(step + 1),
                    "time/rollout_seconds": batch.rollout_seconds,
                    "time/train_seconds": t_metrics["train/seconds"],
                    "time/sync_seconds": sync_seconds,
                    "time/step_seconds": time.perf_counter() - t0,
                    "time/rollout_started": batch.rollout_started,
                    "time/train_started": train_started,
                    "time/train_finished": train_finished,
                    **batches.idle_metrics(t_metrics["train/seconds"], sync_seconds),
                    **colocate_metrics,
                }
                if drained_seconds:
                    metrics["time/trainer_idle_seconds"] = (
                        metrics.get("time/trainer_idle_seconds", 0.0) + drained_seconds
                    )
                side.add_trace([e for events in trainer_events for e in events])
                side.log_step(step, batch, metrics)
            if not colocated:
                save_if_due(step)
            done = step + 1
            if stop["requested"]:
                break
        else:
            done = max(start, r.num_rollout)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)
        if batches is not None:
            batches.close()
        if side is not None:
            side.close()
        destroy_parallel()
    return done
