"""Continuous batching for the embedded engine: one thread owns the model and steps the batch.

Each loop iteration admits waiting requests (prefill each alone, merge its KV cache into the
running batch) up to ``max_batch_size``, highest ``priority`` first and in arrival order among equals
(SGLang's ``--enable-priority-scheduling``), then runs one decode step for the whole batch, samples,
and finishes sequences that hit ``max_new_tokens`` or the context length, a stop token or a stop
string (checked in SGLang's order). Aborts and pauses take effect between steps. The input log-probs a
request asks for are projected a chunk of positions at a time, one chunk between two decode steps
(``_advance_input_logprobs``), so a long prompt's hold no other request, and its answer waits for them.

Weight updates (``update_weights``) follow SGLang's model-update lock: unless the engine is paused,
an update waits until every running request has finished, and no request is admitted meanwhile, so
every token of a response comes from the weights its ``weight_version`` names. Paused in place
(``pause("in_place")``), the update applies at once and the paused requests continue on their KV
state, as in SGLang. Each update starts a new weights epoch: a sequence admitted under an older one
never enters the prefix cache.

Failure isolation: an exception while admitting a request fails that request alone (HTTP 400 for a
``ProtocolError``, else an ``EngineFault`` naming the cause, HTTP 500) and the requests admitted with
it go on; an exception in a decode step fails the running batch with an ``EngineFault`` and the
loop goes on serving the queue. Every future is settled exactly once (``_settle``); a future that
its waiter cancelled counts as an abort.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from slime_mt.engine.embedded.prefix_cache import PrefixCache
from slime_mt.engine.embedded.responses import finish_reason, response
from slime_mt.engine.embedded.runner import Batch, ModelRunner, Sequence
from slime_mt.engine.protocol import GenerateRequest, finish_abort, finish_length
from slime_mt.errors import EngineAsleep, EngineFault, MemoryBusy, ProtocolError

PAUSE_MODES = ("abort", "in_place", "retract")  # SGLang's /pause_generation modes

logger = logging.getLogger(__name__)


@dataclass
class Job:
    request: GenerateRequest
    future: Future
    created: float = field(default_factory=time.perf_counter)
    aborted: str | None = None
    seq: Sequence | None = None

    def abort_reason(self) -> str | None:
        if self.future.cancelled():
            return "Cancelled by the waiter"
        return self.aborted


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        max_batch_size: int = 32,
        seed: int = 0,
        weight_version: str = "0",
        cache_tokens: int = 0,
    ):
        self.runner = runner
        # text models only (prefix_cache.py); touched by the engine thread and, under ``lock``, by updates
        self.prefix_cache = PrefixCache(cache_tokens) if cache_tokens and not runner.is_vlm else None
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.lock = threading.RLock()  # held by a decode step and by weight updates
        runner.adapters.step_lock = self.lock  # LoRA adapters are installed between forwards (lora.py)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # id(job.seq) -> job
        # the running jobs whose generation has ended and whose input log-probs are still being computed,
        # a chunk between decode steps (a long prompt's would otherwise hold every other request): their
        # finish reasons, by id(job.seq)
        self._finishing: dict[int, dict] = {}
        self._batch = Batch()
        self._paused = False
        self._stopped = False
        self._updates_waiting = 0  # updates waiting for the running requests to finish: admit nothing
        self._epoch = 0  # weight updates so far
        self.released: set[str] = set()  # memory tags released (release_memory_occupation)
        self._generator = torch.Generator(device=runner.device).manual_seed(seed)
        self._thread = threading.Thread(target=self._loop, name="slime-mt-engine", daemon=True)
        self.generated_tokens = 0
        self.finished_requests = 0
        self.last_throughput = 0.0

    # ------------------------------------------------------------------ public API (any thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        """The engine thread is serving (False once stopped or if it died)."""
        return self._thread.is_alive() and not self._stopped

    def submit(self, request: GenerateRequest) -> Future:
        job = Job(request, Future())
        with self._cond:
            if self._stopped:
                job.future.set_exception(EngineFault("the engine is shut down"))
                return job.future
            asleep = self.asleep()
            if asleep:
                job.future.set_exception(EngineAsleep(asleep))
                return job.future
            self._waiting.append(job)
            self._cond.notify_all()
        return job.future

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Mark matching requests aborted; they finish with finish_reason abort at the next step."""
        message = "Abort requested" + ("" if abort_all else f" for rid {rid}")
        return self._mark_aborted(lambda job: abort_all or job.request.rid == rid, message)

    def abort_futures(self, futures: list[Future], message: str) -> int:
        """Abort the requests behind ``futures`` (a batch whose answer is no longer wanted)."""
        wanted = {id(f) for f in futures}
        return self._mark_aborted(lambda job: id(job.future) in wanted, message)

    def _mark_aborted(self, match, message: str) -> int:
        count = 0
        with self._cond:
            for job in list(self._waiting) + list(self._running.values()):
                if match(job) and not job.future.done():
                    job.aborted = message
                    count += 1
            self._cond.notify_all()
        return count

    def pause(self, mode: str = "abort") -> None:
        """``abort``: abort in-flight requests then pause; ``in_place``/``retract``: keep them waiting."""
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"pause mode must be abort, in_place or retract, got {mode!r}")
        if mode == "abort":
            self.abort(abort_all=True)
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def uses(self, adapter: str) -> bool:
        """Whether a waiting or running request decodes with the LoRA adapter named ``adapter``."""
        with self.lock, self._cond:
            return any(j.request.lora == adapter for j in list(self._waiting) + list(self._running.values()))

    def aborting(self) -> int:
        """Requests marked aborted and not yet answered."""
        with self._cond:
            return sum(1 for j in list(self._waiting) + list(self._running.values()) if j.abort_reason())

    def update_weights(self, load: Callable[[], int], weight_version: str | None) -> int:
        """Run ``load()`` (all-or-nothing) between decode steps once no request is running (at once when
        paused) -> its result; then clear the prefix cache and, when given, set ``weight_version``
        (SGLang keeps the version otherwise). A failed ``load`` changes neither."""
        with self._holding_updates():
            while True:
                with self.lock:  # held by every admission and decode step
                    if self._paused or not self._running or self._stopped:
                        self._finish_input_logprobs()  # under the weights they were prefilled with
                        count = load()
                        self._epoch += 1
                        if self.prefix_cache is not None:
                            self.prefix_cache.clear()
                        if weight_version is not None:
                            self.weight_version = weight_version
                        return count
                with self._cond:
                    self._cond.wait(0.005)

    @contextlib.contextmanager
    def _holding_updates(self):
        with self._cond:
            self._updates_waiting += 1
        try:
            yield
        finally:
            with self._cond:
                self._updates_waiting -= 1
                self._cond.notify_all()

    def release_memory(self, tags: set[str]) -> None:
        """Free the ``kv_cache`` (the prefix cache) and/or the ``weights`` on the device, as SGLang's
        ``release_memory_occupation``: only while no request runs or waits (MemoryBusy otherwise);
        nothing is served until they are resumed."""
        with self.lock, self._cond:
            busy = len(self._running) + len(self._waiting)
            if busy:
                raise MemoryBusy(f"release_memory_occupation needs an idle engine: {busy} request(s) in it")
            if "kv_cache" in tags and self.prefix_cache is not None:
                self.prefix_cache.clear()
            if "weights" in tags:
                self.runner.release_weights()
            self.released |= tags

    def resume_memory(self, tags: set[str]) -> None:
        """Take the released ``tags`` back (weights: allocated, to be loaded by the next update)."""
        with self.lock, self._cond:
            if "weights" in tags:
                self.runner.resume_weights()
            self.released -= tags

    def asleep(self) -> str:
        """Why the engine cannot serve now ('' when it can): memory released, or weights resumed and not
        loaded again."""
        if self.released:
            return f"the engine's memory is released ({', '.join(sorted(self.released))}); resume it first"
        if self.runner.weights_unloaded:
            return (
                f"{self.runner.weights_unloaded} weight tensor(s) were resumed after a release and not "
                "loaded again; update the weights first"
            )
        return ""

    def memory(self) -> dict:
        """What the engine holds on its device: weight and KV-cache bytes, and the tags released."""
        with self.lock:
            kv = self.prefix_cache.nbytes() if self.prefix_cache is not None else 0
            cache = self._batch.cache
            if cache is not None:
                kv += sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
            return {
                "weights_bytes": self.runner.weight_bytes() if not self.runner.weights_released else 0,
                "kv_cache_bytes": kv,
                "released": sorted(self.released),
            }

    def load(self) -> dict:
        with self._cond:
            return {
                "#running_req": len(self._running),
                "#queue_req": len(self._waiting),
                "#finished_req": self.finished_requests,
                "generated_tokens": self.generated_tokens,
                "last_gen_throughput": self.last_throughput,
                "paused": self._paused,
            }

    # ------------------------------------------------------------------ the loop (engine thread)

    def _loop(self) -> None:
        while True:
            admitted: list[Job] = []
            try:
                with self._cond:
                    while not self._stopped and (
                        self._paused and not self._any_aborted() or not (self._waiting or self._running)
                    ):
                        self._cond.wait()
                    if self._stopped:
                        break
                    while (
                        self._waiting
                        and len(self._running) + len(admitted) < self.max_batch_size
                        and not self._paused
                        and not self._updates_waiting
                    ):
                        job = self._next_waiting(admitted)
                        if job is None:  # what waits needs more adapters than the batch may hold
                            break
                        admitted.append(job)
                    dropped = [j for j in self._waiting if j.abort_reason()]
                    for job in dropped:
                        self._waiting.remove(job)
                for job in dropped:
                    self._settle(job, finish_abort(job.abort_reason()))
                with self.lock:
                    for job in admitted:
                        self._admit(job)
                    admitted = []
                    self._step_batch()
                    self._advance_input_logprobs()
            except Exception as e:  # a bug in the loop itself: fail what is in hand, keep serving
                logger.exception("engine loop iteration failed")
                for job in admitted:
                    self._settle(job, error=EngineFault(f"engine loop failed: {type(e).__name__}: {e}"))
                self._fail_running(e)
        with self._cond:
            leftover = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
            self._finishing.clear()
        for job in leftover:
            self._settle(job, finish_abort("Engine shut down"))

    def _next_waiting(self, admitted: list[Job]) -> Job | None:
        """The waiting request admitted next: the highest priority, the earliest among equals (SGLang's
        ``--enable-priority-scheduling`` order; a request without one comes after every request with
        one, so without priorities this is first come, first served), among those whose LoRA adapter
        the batch can take (``--max-loras-per-batch``); None when none can join."""
        batch = [s.lora for s in self._batch.seqs] + [j.request.lora for j in admitted]
        fitting = [j for j in self._waiting if self.runner.adapters.fits(j.request.lora, batch)]
        if not fitting:
            return None
        job = max(fitting, key=_priority)  # max keeps the first of equals
        self._waiting.remove(job)
        return job

    def _any_aborted(self) -> bool:
        return any(j.abort_reason() for j in self._running.values()) or any(j.abort_reason() for j in self._waiting)

    def _admit(self, job: Job) -> None:
        """Prefill one request and add it to the batch; any failure settles this job alone."""
        try:
            reason = job.abort_reason()
            if reason:
                self._settle(job, finish_abort(reason))
                return
            seq, vision, generates = self._new_sequence(job)
            job.seq = seq
            req = job.request
            start = req.logprob_start_len if req.return_logprob else None
            if start is not None and start < 0:
                start = len(seq.prompt_ids) - 1  # SGLang's default: the last prompt token
            past = past_routes = None
            if self.prefix_cache is not None:  # at least the last prompt token is computed, and every
                limit = len(seq.prompt_ids) - 1 if start is None else start  # requested input log-prob
                seq.cached_tokens, past, past_routes = self.prefix_cache.match(
                    seq.prompt_ids, limit, self.runner.adapters.namespace(seq.lora)
                )
            cache, logits = self.runner.prefill(seq, vision, start, past, past_routes)
            if not generates:
                self._finish(job, finish_length(0))
                return
            self._accept(job, logits[None], cache)
        except ProtocolError as e:
            self._settle(job, error=e)
        except Exception as e:
            logger.exception("admitting request %s failed", job.request.rid)
            self._running.pop(id(job.seq), None)
            self._settle(
                job, error=EngineFault(f"request {job.request.rid} failed in the engine: {type(e).__name__}: {e}")
            )

    def _new_sequence(self, job: Job) -> tuple[Sequence, dict, bool]:
        """-> (the sequence, its vision inputs, whether it generates). Raises ProtocolError for
        requests that do not fit this model."""
        req = job.request
        prompt_ids, vision = self.runner.encode_prompt(req.input_ids, req.text, req.images)
        context = self.runner.context_length
        if len(prompt_ids) >= context:
            raise ProtocolError(
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context length ({context} tokens)."
            )
        sampling = req.sampling
        if sampling.max_new_tokens is None:  # null: as many as the context allows, as SGLang does
            sampling.max_new_tokens = context - len(prompt_ids)
        if len(prompt_ids) + sampling.max_new_tokens > context:
            raise ProtocolError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens: "
                f"{len(prompt_ids)} prompt tokens + {sampling.max_new_tokens} max_new_tokens"
            )
        if req.return_logprob and req.logprob_start_len >= len(prompt_ids):
            raise ProtocolError(
                f"logprob_start_len={req.logprob_start_len} is not below the number of input tokens ({len(prompt_ids)})"
            )
        if req.return_routed_experts and self.runner.route_layout is None:
            raise ProtocolError(f"return_routed_experts: the served model {self.runner.model_path} has no experts")
        if req.return_routed_experts and req.routed_experts_start_len > len(prompt_ids):
            raise ProtocolError(
                f"routed_experts_start_len={req.routed_experts_start_len} is past the {len(prompt_ids)} input tokens"
            )
        generator = self._generator
        if sampling.sampling_seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(sampling.sampling_seed)
        self.runner.adapters.check_request(req.lora)  # unloaded since it was queued: refused
        seq = Sequence(req.rid, prompt_ids, sampling, generator, epoch=self._epoch, lora=req.lora)
        return seq, vision, sampling.max_new_tokens > 0

    def _step_batch(self) -> None:
        """Drop aborted sequences and run one decode step; a failure fails the running batch."""
        try:
            self._drop_aborted()
            if self._batch.seqs and not self._paused:
                self._step()
        except Exception as e:
            logger.exception("engine decode step failed")
            self._fail_running(e)

    def _fail_running(self, error: Exception) -> None:
        fault = EngineFault(f"engine decode step failed: {type(error).__name__}: {error}")
        for job in list(self._running.values()):
            self._settle(job, error=fault)
        self._running.clear()
        self._finishing.clear()
        self._batch = Batch()

    def _step(self) -> None:
        started = time.perf_counter()
        logits = self.runner.decode(self._batch)  # [B, V]
        jobs = [self._job_of(s) for s in self._batch.seqs]
        self._accept_tokens(jobs, logits)
        # tokens per second of this decode step (forward + sampling), as SGLang's gen throughput
        self.last_throughput = len(jobs) / max(time.perf_counter() - started, 1e-9)

    def _blocked(self, seq: Sequence) -> list[int] | None:
        """Token ids that may not be sampled yet: SGLang's min_new_tokens penalizer masks every stop
        token id and EOS id until ``min_new_tokens`` tokens exist."""
        sp = seq.sampling
        if len(seq.output_ids) >= sp.min_new_tokens:
            return None
        return sorted(set(sp.stop_token_ids) | self.runner.eos_ids)

    def _accept(self, job: Job, logits: torch.Tensor, cache) -> None:
        """First token of a newly prefilled sequence; it joins the batch unless already finished."""
        seq = job.seq
        token, logprob = self.runner.sample(logits, [seq.sampling], [seq.generator], [self._blocked(seq)])
        seq.output_ids.append(token[0])
        seq.output_logprobs.append(logprob[0])
        self.generated_tokens += 1
        reason = finish_reason(seq, self.runner)
        if reason is not None:
            self._remember(seq, [(layer.keys, layer.values) for layer in cache.layers])
            self._finish(job, reason)
            return
        self._batch.add(seq, cache)
        self._running[id(seq)] = job

    def _accept_tokens(self, jobs: list[Job], logits: torch.Tensor) -> None:
        seqs = [j.seq for j in jobs]
        tokens, logprobs = self.runner.sample(
            logits, [s.sampling for s in seqs], [s.generator for s in seqs], [self._blocked(s) for s in seqs]
        )
        keep = []
        for row, (job, token, logprob) in enumerate(zip(jobs, tokens, logprobs)):
            job.seq.output_ids.append(token)
            job.seq.output_logprobs.append(logprob)
            reason = finish_reason(job.seq, self.runner)
            if reason is None:
                keep.append(row)
            else:
                self._remember_row(row)
                self._complete(job, reason)
        self.generated_tokens += len(jobs)
        if len(keep) != len(jobs):
            self._batch.keep(keep)

    def _drop_aborted(self) -> None:
        rows = []
        for row, seq in enumerate(self._batch.seqs):
            job = self._job_of(seq)
            reason = job.abort_reason()
            if reason:
                self._remember_row(row)  # a resumed turn (partial rollout) reuses what it generated
                self._complete(job, finish_abort(reason))
            else:
                rows.append(row)
        if len(rows) != len(self._batch.seqs):
            self._batch.keep(rows)

    def _remember_row(self, row: int) -> None:
        """Cache the KV state of batch row ``row`` (before it leaves the batch): its columns are the
        rightmost ones (rows are left-padded), one per prompt token and generated token but the last."""
        seq = self._batch.seqs[row]
        if self.prefix_cache is None or seq.epoch != self._epoch:  # no state of older weights
            return
        n = len(seq.prompt_ids) + len(seq.output_ids) - 1
        self._remember(
            seq,
            [
                (layer.keys[row : row + 1, :, -n:].clone(), layer.values[row : row + 1, :, -n:].clone())
                for layer in self._batch.cache.layers
            ],
        )

    def _remember(self, seq: Sequence, kv) -> None:
        if self.prefix_cache is not None and seq.epoch == self._epoch:  # no state of older weights
            layout = self.runner.route_layout
            routes = seq.routed(layout) if layout is not None else None
            namespace = self.runner.adapters.namespace(seq.lora)
            self.prefix_cache.insert(seq.prompt_ids + seq.output_ids[:-1], kv, routes, namespace)

    def _job_of(self, seq: Sequence) -> Job:
        return self._running[id(seq)]

    def _complete(self, job: Job, reason: dict) -> None:
        """A running job that stops generating: answered, or once its input log-probs are done."""
        self._running.pop(id(job.seq), None)
        self._finish(job, reason)

    def _finish(self, job: Job, reason: dict) -> None:
        """Answer ``job`` for ``reason``; a job still owing input log-probs (not aborted) stays running
        until ``_advance_input_logprobs`` has them."""
        seq = job.seq
        if seq is None or seq.pending_logprobs is None or reason["type"] == "abort":
            self._settle(job, reason)
            return
        self._running[id(seq)] = job
        self._finishing[id(seq)] = reason

    def _advance_input_logprobs(self) -> None:
        """Between two decode steps: the finishing jobs aborted meanwhile answered, then one chunk of the
        input log-probs of the earliest job that owes them, more while nothing else waits or generates
        (a job done with them and with generating answered); a failure there fails that job alone."""
        for key in [k for k in self._finishing if self._running[k].abort_reason()]:
            job = self._running.pop(key)
            del self._finishing[key]
            self._settle(job, finish_abort(job.abort_reason()))
        job = next((j for j in self._running.values() if j.seq.pending_logprobs is not None), None)
        if job is None:
            return
        try:
            self.runner.advance_input_logprobs(job.seq)
            while (
                job.seq.pending_logprobs is not None
                and not self._waiting
                and self._running.keys() <= self._finishing.keys()
            ):
                self.runner.advance_input_logprobs(job.seq)
        except Exception as e:
            logger.exception("input log-probs of request %s failed", job.request.rid)
            self._fail_one(job, EngineFault(f"request {job.request.rid} failed in the engine: {type(e).__name__}: {e}"))
            return
        if job.seq.pending_logprobs is None and id(job.seq) in self._finishing:
            self._running.pop(id(job.seq))
            self._settle(job, self._finishing.pop(id(job.seq)))

    def _finish_input_logprobs(self) -> None:
        """Every job's input log-probs to the end now (before a weight update), the finishing jobs answered."""
        for job in list(self._running.values()):
            self.runner.advance_input_logprobs(job.seq, chunks=None)
        for key, reason in list(self._finishing.items()):
            self._settle(self._running.pop(key), reason)
        self._finishing.clear()

    def _fail_one(self, job: Job, error: Exception) -> None:
        """``job`` failed alone: out of the batch (if it still generates) and answered with ``error``."""
        key = id(job.seq)
        self._running.pop(key, None)
        self._finishing.pop(key, None)
        rows = [row for row, seq in enumerate(self._batch.seqs) if seq is not job.seq]
        if len(rows) != len(self._batch.seqs):
            self._batch.keep(rows)
        self._settle(job, error=error)

    def _settle(self, job: Job, reason: dict | None = None, error: Exception | None = None) -> None:
        """Complete ``job.future`` once: with the response for ``reason``, or with ``error``. A failure
        to build the response is an EngineFault; a future already done (or cancelled) is left as is."""
        if job.future.done():
            return
        result = None
        if error is None:
            try:
                result = response(job.request, job.seq, reason, self.runner, self.weight_version, job.created)
            except Exception as e:
                logger.exception("building the response of request %s failed", job.request.rid)
                error = EngineFault(
                    f"building the response of request {job.request.rid} failed: {type(e).__name__}: {e}"
                )
        if error is None:  # counted before the answer can reach its client, who may read the count next
            self.finished_requests += 1
        try:
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
        except InvalidStateError:  # cancelled by its waiter meanwhile
            if error is None:
                self.finished_requests -= 1


def _priority(job: Job) -> int:
    """A waiting job's rank: its request's priority, or SGLang's for none (``-sys.maxsize - 1``)."""
    priority = job.request.priority
    return -sys.maxsize - 1 if priority is None else priority
