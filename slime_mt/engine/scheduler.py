"""Continuous batching for the embedded engine: one thread owns the model and steps the batch.

Each loop iteration admits waiting requests (prefill each alone, merge its KV cache into the
running batch) up to ``max_batch_size``, then runs one decode step for the whole batch, samples,
and finishes sequences that hit a stop token, a stop string, ``max_new_tokens`` or the context
length. Aborts and pauses take effect between steps; weight updates hold the same lock as a step,
so a step never sees half-updated weights.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from slime_mt.engine.protocol import GenerateRequest, ProtocolError, finish_abort, finish_length, finish_stop
from slime_mt.engine.runner import Batch, ModelRunner, Sequence

logger = logging.getLogger(__name__)


@dataclass
class Job:
    request: GenerateRequest
    future: Future
    created: float = field(default_factory=time.perf_counter)
    aborted: str | None = None
    seq: Sequence | None = None


class Scheduler:
    def __init__(self, runner: ModelRunner, max_batch_size: int = 32, seed: int = 0, weight_version: str = "0"):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.lock = threading.RLock()  # held by a decode step and by weight updates
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # id(job.seq) -> job
        self._batch = Batch()
        self._paused = False
        self._stopped = False
        self._generator = torch.Generator().manual_seed(seed)
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

    def submit(self, request: GenerateRequest) -> Future:
        job = Job(request, Future())
        with self._cond:
            self._waiting.append(job)
            self._cond.notify_all()
        return job.future

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Mark matching requests aborted; they finish with finish_reason abort at the next step."""
        count = 0
        with self._cond:
            for job in list(self._waiting) + list(self._running.values()):
                if abort_all or job.request.rid == rid:
                    job.aborted = "Abort requested" + ("" if abort_all else f" for rid {rid}")
                    count += 1
            self._cond.notify_all()
        return count

    def pause(self, mode: str = "abort") -> None:
        """``abort``: abort in-flight requests then pause; ``in_place``/``retract``: keep them waiting."""
        if mode not in ("abort", "in_place", "retract"):
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

    def load(self) -> dict:
        with self._cond:
            return {"#running_req": len(self._running), "#queue_req": len(self._waiting),
                    "#finished_req": self.finished_requests, "generated_tokens": self.generated_tokens,
                    "last_gen_throughput": self.last_throughput, "paused": self._paused}

    # ------------------------------------------------------------------ the loop (engine thread)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (self._paused and not self._any_aborted()
                                             or not (self._waiting or self._running)):
                    self._cond.wait()
                if self._stopped:
                    break
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_batch_size and not self._paused:
                    admitted.append(self._waiting.popleft())
                aborted_waiting = [j for j in self._waiting if j.aborted]
                for job in aborted_waiting:
                    self._waiting.remove(job)
            for job in aborted_waiting:
                self._finish(job, finish_abort(job.aborted))
            try:
                with self.lock:
                    for job in admitted:
                        self._admit(job)
                    self._drop_aborted()
                    if self._batch.seqs and not self._paused:
                        self._step()
            except Exception as e:  # a model failure must not kill the server: fail the batch
                logger.exception("engine step failed")
                for job in list(self._running.values()):
                    self._fail(job, e)
                self._running.clear()
                self._batch = Batch()
        for job in list(self._waiting) + list(self._running.values()):
            self._finish(job, finish_abort("Engine shut down"))

    def _any_aborted(self) -> bool:
        return any(j.aborted for j in self._running.values()) or any(j.aborted for j in self._waiting)

    def _admit(self, job: Job) -> None:
        req = job.request
        if job.aborted:
            self._finish(job, finish_abort(job.aborted))
            return
        try:
            prompt_ids, vision = self.runner.encode_prompt(req.input_ids, req.text, req.images)
            total = len(prompt_ids) + req.sampling.max_new_tokens
            if total > self.runner.context_length:
                raise ProtocolError(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{self.runner.context_length} tokens: {len(prompt_ids)} prompt tokens + "
                    f"{req.sampling.max_new_tokens} max_new_tokens"
                )
        except ProtocolError as e:
            job.future.set_exception(e)
            return
        generator = None
        if req.sampling.sampling_seed is not None:
            generator = torch.Generator().manual_seed(req.sampling.sampling_seed)
        seq = Sequence(req.rid, prompt_ids, req.sampling, generator or self._generator)
        job.seq = seq
        cache, logits = self.runner.prefill(seq, vision, req.logprob_start_len if req.return_logprob else -1)
        if req.sampling.max_new_tokens == 0:
            self._finish(job, finish_length(0))
            return
        self._running[id(seq)] = job
        self._accept(job, logits[None], cache)

    def _step(self) -> None:
        started = time.perf_counter()
        logits = self.runner.decode(self._batch)  # [B, V]
        jobs = [self._job_of(s) for s in self._batch.seqs]
        self._accept_tokens(jobs, logits)
        # tokens per second of this decode step (forward + sampling), as SGLang's gen throughput
        self.last_throughput = len(jobs) / max(time.perf_counter() - started, 1e-9)

    def _accept(self, job: Job, logits: torch.Tensor, cache) -> None:
        """First token of a newly prefilled sequence; it joins the batch unless already finished."""
        token, logprob = self.runner.sample(logits, [job.seq.sampling], [job.seq.generator])
        job.seq.output_ids.append(token[0])
        job.seq.output_logprobs.append(logprob[0])
        self.generated_tokens += 1
        reason = self._finish_reason(job.seq)
        if reason is not None:
            self._complete(job, reason)
        else:
            self._batch.add(job.seq, cache)

    def _accept_tokens(self, jobs: list[Job], logits: torch.Tensor) -> None:
        seqs = [j.seq for j in jobs]
        tokens, logprobs = self.runner.sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        keep = []
        for row, (job, token, logprob) in enumerate(zip(jobs, tokens, logprobs)):
            job.seq.output_ids.append(token)
            job.seq.output_logprobs.append(logprob)
            reason = self._finish_reason(job.seq)
            if reason is None:
                keep.append(row)
            else:
                self._complete(job, reason)
        self.generated_tokens += len(jobs)
        if len(keep) != len(jobs):
            self._batch.keep(keep)

    def _finish_reason(self, seq: Sequence) -> dict | None:
        sp = seq.sampling
        token = seq.output_ids[-1]
        n = len(seq.output_ids)
        if n >= sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.runner.eos_ids):
                return finish_stop(token)
            if sp.stop:
                text = self.runner.tokenizer.decode(seq.output_ids, skip_special_tokens=sp.skip_special_tokens)
                for stop in sp.stop:
                    if stop in text:
                        return finish_stop(stop)
        if n >= sp.max_new_tokens or len(seq.prompt_ids) + n >= self.runner.context_length:
            return finish_length(n)
        return None

    def _drop_aborted(self) -> None:
        rows = []
        for row, seq in enumerate(self._batch.seqs):
            job = self._job_of(seq)
            if job.aborted:
                self._complete(job, finish_abort(job.aborted))
            else:
                rows.append(row)
        if len(rows) != len(self._batch.seqs):
            self._batch.keep(rows)

    def _job_of(self, seq: Sequence) -> Job:
        return self._running[id(seq)]

    def _complete(self, job: Job, reason: dict) -> None:
        if job.seq is not None:
            self._running.pop(id(job.seq), None)
        self._finish(job, reason)

    def _fail(self, job: Job, error: Exception) -> None:
        if not job.future.done():
            job.future.set_exception(RuntimeError(f"engine step failed: {type(error).__name__}: {error}"))

    def _finish(self, job: Job, reason: dict) -> None:
        if job.future.done():
            return
        self.finished_requests += 1
        job.future.set_result(self._response(job, reason))

    def _response(self, job: Job, reason: dict) -> dict:
        req, seq = job.request, job.seq
        output_ids = list(seq.output_ids) if seq else []
        sp = req.sampling
        text_ids = output_ids
        if reason["type"] == "stop" and isinstance(reason["matched"], int) and not sp.no_stop_trim:
            text_ids = output_ids[:-1]
        text = self.runner.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens) if text_ids else ""
        if reason["type"] == "stop" and isinstance(reason["matched"], str) and not sp.no_stop_trim:
            text = text[: text.index(reason["matched"])]
        meta = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(seq.prompt_ids) if seq else 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - job.created,
        }
        if req.return_logprob:
            show = req.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                [lp, t, self.runner.tokenizer.decode([t]) if show else None]
                for lp, t in zip(seq.output_logprobs if seq else [], output_ids)
            ]
            if seq is not None and seq.input_logprobs is not None:
                start = max(req.logprob_start_len, 0)
                meta["input_token_logprobs"] = [
                    [lp, t, self.runner.tokenizer.decode([t]) if show else None]
                    for lp, t in zip(seq.input_logprobs, seq.prompt_ids[start:])
                ]
        if req.return_prompt_token_ids and seq is not None:
            meta["prompt_token_ids"] = list(seq.prompt_ids)
        return {"text": text, "output_ids": output_ids, "meta_info": meta}
