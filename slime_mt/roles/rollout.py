"""The rollout role: engines, rollout context, data, the rollout function or fully-async manager, metrics.

One process hosts it (the first trainer rank's; ``roles/link.py`` is how every rank reaches it). Per
step it turns the next batch of groups (``roles/batches.py``) into a ``TrainBatch`` the ranks train on
(each its share): failures logged and counted, samples
finalized (``--sample-format``, ``--merge-step-wise``), advantages, staleness; it receives the new
weights for its engines (``push_weights``, behind the client's update gate) and logs the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from slime_mt.algo.advantages import compute_advantages
from slime_mt.cluster.supervisor import EngineSupervisor
from slime_mt.compat import SlimeCompat
from slime_mt.config import Config, eval_beside_rollout
from slime_mt.data import PromptDataset
from slime_mt.engine.clients.update_gate import UpdateGate
from slime_mt.engine.weights.fp8 import rollout_checkpoint
from slime_mt.engine.weights.sync import EngineWeights, UpdatePlan, transport_for
from slime_mt.errors import DatasetError, RolloutFailedError
from slime_mt.inspection.records import RunRecords
from slime_mt.metrics import MetricsLogger, read_evals
from slime_mt.plugins import load_function
from slime_mt.roles.batches import next_batch_for
from slime_mt.roles.evaluations import Evaluations
from slime_mt.roles.replay import ReplayRole
from slime_mt.roles.steps import RolloutSteps
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.evaluation import EvalSet, load_eval_sets
from slime_mt.rollout.failures import StepReport
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.group_rollout import rollout_output
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.rollout.rollout_workers import RolloutWorkerPool
from slime_mt.rollout.staleness import mask_stale, route_staleness_metrics, staleness_metrics, turn_versions
from slime_mt.run_dir import ERRORS_FILE
from slime_mt.timeline import maybe_span, now_us
from slime_mt.types import TrainBatch

logger = logging.getLogger(__name__)


def drop_long_prompts(dataset: PromptDataset, ctx, path: str) -> None:
    """Leave out the prompts longer than ``--rollout-max-prompt-len`` tokens, and always those that leave
    no room in ``--rollout-max-context-len`` (they would never reach the model): one line per dataset."""
    r = ctx.rollout
    limit = r.rollout_max_context_len - 1
    if r.rollout_max_prompt_len is not None:
        limit = min(limit, r.rollout_max_prompt_len)
    total = len(dataset.rows)
    dropped = dataset.keep_rows(lambda row: len(ctx.encode_prompt(row.prompt, row.metadata.get("tools")).ids) <= limit)
    if not dropped:
        return
    if limit == r.rollout_max_prompt_len:
        why = f"--rollout-max-prompt-len {limit}"
    else:
        why = f"no room left in --rollout-max-context-len {r.rollout_max_context_len}"
    if not dataset.rows:
        raise DatasetError(f"{path}: every one of its {total} prompts is longer than {limit} tokens ({why})")
    rows = ", ".join(str(row.index) for row in dropped[:10]) + (", ..." if len(dropped) > 10 else "")
    logger.warning(
        "%s: %d of %d prompts are longer than %d tokens (%s) and are left out (rows %s)",
        path,
        len(dropped),
        total,
        limit,
        why,
        rows,
    )


@dataclasses.dataclass
class RolloutRole(RolloutSteps):
    engines: object
    ctx: object
    data: PromptDataset
    eval_sets: list[EvalSet]  # the held-out datasets (rollout/evaluation.py)
    rollout_fn: object
    metrics: object
    weights: EngineWeights | None  # the weight transport to the engines (None: another process sends them)
    errors_path: Path  # RUN_DIR/errors.jsonl: every failed sample with its traceback
    cfg: Config
    data_state_before_prefetch: dict | None = None
    failed_steps: int = 0  # consecutive steps in which every sample failed
    asleep: bool = False  # --colocate: the engines' memory is released while the trainer trains
    records: RunRecords | None = None  # the dumps, turn records and trace (inspection/records.py)
    supervisor: object = None  # --ray: cluster/supervisor.py, starts again an engine that dies
    update_started: int = 0  # when the weight update in progress began (the trace's microseconds)
    gate_closed_at: int = 0
    evaluations: Evaluations | None = None  # the held-out datasets' evaluations (roles/evaluations.py)

    @classmethod
    def start(
        cls,
        cfg: Config,
        run_dir: Path,
        engine_actors: list | None = None,
        sends_weights: bool = True,
        version: int = 0,
    ) -> RolloutRole:
        """Data, engines (launched, or the ``--engine-url`` ones; launched ones serve their weights as
        ``version``), the rollout context with its update gate, the rollout function, the metrics logger
        and (``sends_weights``) the weight transport; under ``--ray`` (``engine_actors``: the driver's
        EngineActors) the supervisor that starts again an engine that dies."""
        from slime_mt.engine.launch import run_engine_settings, start_engines

        data = PromptDataset.from_config(cfg.data.prompt_data, cfg.data, cfg.rollout.n_samples_per_prompt)
        eval_sets = load_eval_sets(cfg)
        served, quantization = rollout_checkpoint(cfg.engine, cfg.train.hf_checkpoint, run_dir)
        settings, lora = run_engine_settings(cfg)
        engines = start_engines(
            settings,
            served,
            run_dir / "logs",
            seed=cfg.train.seed,
            tp_size=cfg.train.tensor_model_parallel_size,
            weight_version=str(version),
            lora=lora,
        )
        ctx = None
        try:  # whatever fails from here stops the engines (and closes the context) before it is raised
            ctx = RolloutContext.create(cfg, cfg.train.hf_checkpoint, engines.url, engines.worker_urls)
            ctx.start_version = version
            ctx.client.gate = UpdateGate()
            drop_long_prompts(data, ctx, cfg.data.prompt_data)
            for es in eval_sets:
                drop_long_prompts(es.rows, ctx, f"eval dataset {es.dataset.name!r} ({es.dataset.path})")
            if cfg.rollout.rollout_num_processes > 1:
                ctx.rollout_workers = RolloutWorkerPool(cfg, engines.url, engines.worker_urls, ctx.env_workers)
                ctx.client.gate.followers = ctx.rollout_workers
                ctx.rollout_workers.timeline = ctx.timeline
            for pool in (ctx.env_workers, ctx.rollout_workers):
                for line in pool.describe() if pool is not None else []:
                    print(f"placement: {line}", flush=True)
            if cfg.rollout.slime_compat:
                compat = SlimeCompat.activate(ctx)
                compat.adopt_dataset(data, cfg.data.apply_chat_template)
                for es in eval_sets:
                    compat.adopt_dataset(es.rows, es.dataset.apply_chat_template)
            rollout_fn = load_function(cfg.rollout.rollout_function_path, what="--rollout-function-path")
            c = cfg.checkpoint
            metrics = MetricsLogger(
                run_dir, use_wandb=c.use_wandb, wandb_project=c.wandb_project, wandb_options=c.wandb_options()
            )
            weights = None
            if sends_weights:
                weights = EngineWeights(
                    lambda urls: transport_for(
                        cfg.engine, cfg.cluster.ray, cfg.cluster.colocate, engines.local_engines, ctx, run_dir
                    ),
                    ctx.client.worker_urls,
                    quantization,
                )
        except BaseException:
            if ctx is not None:
                ctx.close()
            engines.stop()
            raise
        side = cls(engines, ctx, data, eval_sets, rollout_fn, metrics, weights, run_dir / ERRORS_FILE, cfg)
        side.records = RunRecords(cfg, run_dir)
        side.evaluations = Evaluations(side, eval_beside_rollout(cfg))
        if engine_actors:
            side.supervisor = _supervisor(cfg, engines, ctx, engine_actors)
        return side

    def resume(self, step: int, data_state: dict) -> None:
        self.data.load_state_dict(data_state)
        self.metrics.truncate_after(step)
        self.records.resume(step)

    def batch_source(self, start: int):
        """The run starts at step ``start`` -> the mode's batch source (``roles/batches.py``)."""
        self.ctx.start_version = start
        return next_batch_for(self.cfg.rollout, self, start)

    def timed_rollout(self, step: int):
        """The rollout function for ``step`` -> (groups, wall-clock start, seconds, perf_counter end)."""
        self.data_state_before_prefetch = self.data.state_dict()
        started = time.time()
        began = time.perf_counter()
        with maybe_span(self.ctx.timeline, "rollout", "step", lane="rollout", step=step):
            groups = self.rollout_fn(self.ctx.args, step, self.data)
        finished = time.perf_counter()
        return groups, started, finished - began, finished

    def collect(self, step: int, batches) -> TrainBatch | RolloutFailedError:
        """The step's batch from ``batches``, ready to train -> a TrainBatch, or the error that stops
        the run (every sample failed ``--max-failed-steps`` steps in a row)."""
        with maybe_span(self.ctx.timeline, "take batch", "step", lane="steps", step=step):
            batch = batches.take(step)
        with maybe_span(self.ctx.timeline, "prepare batch", "step", lane="steps", step=step):
            return self._collected(step, batch, batches)

    def _collected(self, step: int, batch, batches) -> TrainBatch | RolloutFailedError:
        r = self.cfg.rollout
        groups, returned_metrics = rollout_output(batch.groups)
        extra = {**batch.metrics, **returned_metrics}
        if self.ctx.compat is not None:
            self.ctx.compat.adopt_groups(groups)
        report, stop_run = self._check_failures(step, groups, r.max_failed_steps)
        samples, advantages, merge_metrics = self._prepare(groups)
        if r.mask_offpolicy_in_partial_rollout:
            trainable = sum(sum(s.loss_mask) for s in samples)
            masked = mask_stale(samples, step, r.max_staleness)
            extra["rollout/masked_stale_tokens"] = masked
            extra["async/masked_token_share"] = masked / max(trainable, 1)
        extra.update(staleness_metrics(samples, step))
        extra.update(route_staleness_metrics([s for g in groups for s in g], step))
        if self.ctx.env_workers is not None:
            extra["env/worker_restarts"] = self.ctx.env_workers.take_restarts()
        if self.supervisor is not None:
            extra["engine/restarts"] = self.supervisor.take_restarts()
        if self.ctx.rollout_workers is not None:
            extra["rollout/process_restarts"] = self.ctx.rollout_workers.take_restarts()
        if stop_run is not None:  # every rank stops, not only this one
            return stop_run
        batches.prefetch(step, extra)
        if self.cfg.cluster.colocate:
            extra.update(self.sleep_engines())
        train_batch = TrainBatch(
            samples,
            advantages,
            merge_metrics,
            rollout_metrics(groups),
            batch.seconds,
            batch.started,
            {**_version_metrics(groups, step), **extra},
            sorted(int(g[0].group_index) for g in groups if g),
            report.line(),
        )
        self.records.step(step, groups, train_batch)
        return train_batch

    def _prepare(self, groups) -> tuple[list, list[float], dict]:
        cfg = self.cfg
        samples = [s for g in groups for s in g]
        train_samples, merge_metrics = finalize(
            samples, cfg.rollout.sample_format, cfg.rollout.merge_step_wise, cfg.rollout.mask_truncated
        )
        a = cfg.algo
        advantages = compute_advantages(
            train_samples, a.advantage_estimator, a.normalize_advantages_std, a.normalize_advantages
        )
        return train_samples, advantages, merge_metrics

    def _check_failures(self, step: int, groups, max_failed_steps: int) -> tuple[StepReport, RolloutFailedError | None]:
        """Log the step's failed and truncated samples and keep the failures -> (the report, the error
        that stops the run when every sample failed ``max_failed_steps`` steps in a row, else None)."""
        report = StepReport(step, groups)
        report.log(self.errors_path)
        self.failed_steps = self.failed_steps + 1 if report.all_failed else 0
        if self.failed_steps < max_failed_steps:
            return report, None
        first = next(s for g in groups for s in g)
        return report, RolloutFailedError(
            f"step {step}: every sample failed ({report.line()}), {self.failed_steps} step(s) in a row "
            f"(--max-failed-steps {max_failed_steps}); nothing to train on. First: sample {first.index}: "
            f"{first.metadata.get('error', '')}. Every failure with its traceback: {self.errors_path}"
        )

    def push_weights(self, stream: Iterator, version: int) -> None:
        """New weights to every engine as ``version`` through the run's transport (in-process, a folder,
        or broadcast); the client's update gate pauses and empties the engines only around the update.
        Engines asleep (``--colocate``) take their weights back first, then the update; their KV cache
        follows in ``wake_engines``."""
        plan = self.begin_update(version)
        self.weights.push(stream, version, plan, self.gate_closed)
        self.end_update(version, plan)

    def begin_update(self, version: int) -> UpdatePlan:
        """A weight update starts (sent from this process, or from the trainer rank that holds the
        weights under ``--ray``) -> what it must know: an engine lost since the last look leaves it,
        one started again joins it, engines asleep get their weights' memory back first."""
        self.update_started = now_us()
        ready = {}
        if self.supervisor is not None:
            self.supervisor.check()
            ready = self.supervisor.take_ready()
            self.ctx.run_sync(_set_workers(self.ctx.client, self.ctx.client.worker_urls + list(ready.values())))
        if self.asleep:
            self.ctx.run_sync(self.ctx.client.resume_memory_occupation(["weights"]))
        return UpdatePlan(list(self.ctx.client.worker_urls), ready, self.asleep)

    def engine_urls(self) -> tuple[str, list[str]]:
        """Where the engines are (the router's or first engine's URL, every engine's) as the client has them."""
        return self.ctx.client.url, list(self.ctx.client.worker_urls)

    def end_update(self, version: int, plan: UpdatePlan) -> None:
        """Every engine serves ``version``: the ones started again go back in the rotation."""
        for e, url in plan.ready.items():
            self.supervisor.admit(e, url)
        if self.ctx.timeline is not None:
            self.ctx.timeline.add("weight update", self.update_started, now_us(), "weights", "weights", version=version)

    def wake_engines(self) -> None:
        """``--colocate``: the engines' KV cache back and the gate open, once the new weights are in
        them and the trainer has left the device (``--offload``)."""
        if not self.asleep:
            return
        client = self.ctx.client
        self.ctx.run_sync(client.resume_memory_occupation(["kv_cache"]))
        self.asleep = False
        if client.gate is not None:
            self.ctx.run_sync(client.gate.open(client))

    def sleep_engines(self) -> dict[str, float]:
        """``--colocate``: the rollout is done; close the update gate (nothing runs in an engine) and
        release every engine's memory (weights and KV cache) for the trainer -> what the engines report
        holding after it (the embedded engine reports it; SGLang does not)."""
        client = self.ctx.client
        if client.gate is not None:
            self.ctx.run_sync(client.gate.close(client))
        self.ctx.run_sync(client.release_memory_occupation())
        self.asleep = True
        held = [info.get("memory_occupation") for info in self.ctx.run_sync(client.server_info())]
        if any(h is None for h in held):
            return {}
        held_bytes = sum(h["weights_bytes"] + h["kv_cache_bytes"] for h in held)
        return {"colocate/engine_bytes_while_training": float(held_bytes)}

    @contextlib.contextmanager
    def gate_closed(self):
        """No request inside an engine for the duration."""
        self.close_gate()
        try:
            yield
        finally:
            self.open_gate()

    def close_gate(self) -> None:
        self.gate_closed_at = now_us()
        self.ctx.run_sync(self.ctx.client.gate.close(self.ctx.client))

    def open_gate(self) -> None:
        self.ctx.run_sync(self.ctx.client.gate.open(self.ctx.client))
        if self.ctx.timeline is not None:
            self.ctx.timeline.add("gate paused", self.gate_closed_at, now_us(), "update gate", "gate")

    def begin(self, start: int, split) -> None:
        """The baseline first: a run that starts from step 0 evaluates its starting weights (unless
        ``--skip-eval-before-train``), as slime does, before any rollout (beside the first one, under
        ``--async`` and ``--fully-async``). A resumed run evaluates the weights it resumes from where
        that evaluation was due and is not in eval.jsonl (it was still running beside the rollout when
        the run stopped)."""
        e = self.cfg.evaluation
        if self.eval_sets and e.eval_interval:
            if start == 0:
                due = not e.skip_eval_before_train
            else:
                due = start % e.eval_interval == 0 and all(
                    row["step"] != start for row in read_evals(self.metrics.run_dir)
                )
            if due:
                self.evaluations.due(start)
        super().begin(start, split)

    def drain(self) -> float:
        """The step has trained: what still generates for it, and an evaluation beside it, finish
        before the weights change -> seconds waited."""
        return super().drain() + self.evaluations.settle()

    def write_step(self, step: int, batch: TrainBatch, metrics: dict[str, float]) -> None:
        """The step's metrics to metrics.jsonl and the loggers, then the evaluation when one is due (of
        the weights the step trained, to eval.jsonl)."""
        self.metrics.log(step, metrics, {"trained_groups": batch.trained_groups}, note=batch.note)
        interval = self.cfg.evaluation.eval_interval
        if self.eval_sets and interval and (step + 1) % interval == 0:
            self.evaluations.due(step + 1)
        if self.ctx.timeline is not None:
            self.records.write_trace(self.ctx.timeline.drain())

    def add_trace(self, events: list[dict]) -> None:
        """Spans recorded elsewhere (the trainer ranks') for the step's part of the trace."""
        if self.ctx.timeline is not None:
            self.ctx.timeline.extend(events)

    def evaluate(self, steps_trained: int) -> None:
        """Every held-out dataset on the engines' weights after ``steps_trained`` steps, now, logged."""
        self.evaluations.now(steps_trained)

    def close(self) -> None:
        try:
            if self.evaluations is not None:
                self.evaluations.close()
            self.close_batches()
        finally:
            if self.supervisor is not None:
                self.supervisor.close()
            self.metrics.close()
            self.records.close()
            try:
                if self.weights is not None:
                    self.weights.close()
            finally:
                self.ctx.close()
                self.engines.stop()


async def _call(fn, *args):
    """``fn(*args)`` on the client's loop, between its calls."""
    return fn(*args)


async def _set_workers(client, urls: list[str]) -> None:
    """The client's control calls go to ``urls`` from now on (changed on its loop, between calls)."""
    client.worker_urls = list(urls)


def _version_metrics(groups, version: int) -> dict[str, float]:
    """Weight versions the samples were generated with, and the gap to the version being trained."""
    versions = turn_versions(groups)
    if not versions:
        return {"rollout/weight_version_gap": 0.0}
    return {
        "rollout/weight_version_gap": float(version - min(versions)),
        "rollout/sample_weight_version_min": float(min(versions)),
        "rollout/sample_weight_version_max": float(max(versions)),
    }


def start_role(cfg: Config, run_dir: Path, engine_actors: list | None = None, sends_weights: bool = True):
    """The run's rollout role: engines and rollouts (``RolloutRole``), or the saved rollouts of
    ``--debug-train-only`` (``ReplayRole``)."""
    if cfg.debug.train_only:
        return ReplayRole(cfg, run_dir)
    return RolloutRole.start(cfg, run_dir, engine_actors, sends_weights)


def _supervisor(cfg: Config, engines, ctx, engine_actors: list) -> EngineSupervisor:
    """Under ``--ray``: what starts an engine again when it dies, and takes it out of (and back into) the
    rotation: the router's, or for vLLM (no router) the client's own."""
    from slime_mt.engine.launch import add_worker, remove_worker

    def lost(url: str) -> None:
        if cfg.engine.engine == "vllm":  # no router: the client's own rotation
            ctx.run_sync(_call(ctx.client.leave, url))
        else:
            remove_worker(engines.url, url)
        ctx.run_sync(_set_workers(ctx.client, [u for u in ctx.client.worker_urls if u != url]))

    def admitted(url: str) -> None:
        if cfg.engine.engine == "vllm":
            ctx.run_sync(_call(ctx.client.enter, url))
        else:
            add_worker(engines.url, url)

    return EngineSupervisor(engine_actors, engines.worker_urls, lost, admitted)
