"""The multi-turn loop: engine turn -> env step -> delta-encoded observation, until a stop condition.

Per turn: the engine gets the context in its view (one image pad per image) and every image so far;
its output tokens are appended with their log-probs (loss mask 1); ``env.step(text)`` answers; the
observation is delta-encoded and appended (loss mask 0). Stops and resulting status:

  env done -> COMPLETED            max_turns reached -> COMPLETED (last output kept, no observation)
  an invalid action (InvalidActionError, info["invalid_action"]): its feedback is the observation and
  the turn does not count toward max_turns; more than --max-invalid-actions-per-turn in a row -> TRUNCATED
  engine "length" -> TRUNCATED     context budget exhausted, or an observation cut to fit -> TRUNCATED
  env fault beyond the retry budget, any other env exception, engine failure -> FAILED (error kept)
  RecoverableEnvError: reset and replay, or the episode restarts from its prompt (``env_steps.py``);
  past --max-env-resets -> FAILED
  engine "abort": the call is made again (see ``generate_turn``); past the engine retry budget
  (aborts no weight update caused) -> FAILED, never trained as if the model had ended the turn

Three tokenization paths, as SkyRL's generator has them:
  default                        each observation is its own chat message, delta-encoded after the
                                 model's tokens (token-in/token-out)
  --no-conversation-multi-turn   every turn inside ONE assistant message: a turn the episode goes on
                                 after loses its end-of-turn token (not sent again, not trained) and the
                                 observation follows as raw text in ``--observation-template``
                                 (token-in/token-out)
  --retokenize-chat-history      each context is the whole conversation rendered by the template and
                                 tokenized anew; see ``retokenize.py`` for what the sample trains

A call that an engine aborted (a weight update in the middle of a turn, see ``UpdateGate``, or any
other abort) is resumed with ``--partial-rollout``: its tokens stay, with their log-probs and the
version that generated them, and the next call continues from them with what is left of the turn's
budget, so one turn can hold tokens of two versions (``Sample.token_versions``). Without it the turn
is generated again from its context. Images and the multimodal buffer are untouched by either.

``rollout_max_context_len`` bounds the context a call sends plus its output (prompt + response
under the append policy; the rewritten context under another ``--context-policy``, see
``context_policy.py``); each turn's ``max_new_tokens`` is the smaller of ``rollout_max_response_len``
and what is left. The env is always closed.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from slime_mt.engine.clients.sglang import UPDATE_ABORT, output_of
from slime_mt.engine.images import encode_image
from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.errors import ContextPolicyError, EngineAbortedTurn, EngineError, EnvStepFailed, EpisodeRestart
from slime_mt.multimodal import MultimodalBuffer
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.context_policy import apply_policy, kept_outputs
from slime_mt.rollout.env_steps import EpisodeEnv, call_env
from slime_mt.rollout.failures import fail
from slime_mt.rollout.retokenize import retokenize_history
from slime_mt.tokenization import Encoded, image_parts
from slime_mt.types import Sample, Status, Turn

logger = logging.getLogger(__name__)


def turn_seed(run_seed: int, rollout_id: int, sample_index: int, turn_index: int) -> int:
    """A stable 31-bit sampling seed for one engine call."""
    value = (run_seed * 1_000_003 + rollout_id) * 1_000_033 + sample_index
    return (value * 1_009 + turn_index) % (2**31 - 1)


class Trajectory:
    """Mutable state of one episode: the sample, the engine view of its tokens, its images, and the
    conversation as messages (prompt, then per turn the assistant message and the observation)."""

    def __init__(self, ctx: RolloutContext, sample: Sample, encoder=None):
        self.ctx = ctx
        self.sample = sample
        self.encoder = encoder
        self.buffer = MultimodalBuffer()
        self.engine_ids: list[int] = []  # context with ONE pad per image (kept in step with sample.tokens)
        self.image_token_id = getattr(ctx.processor, "image_token_id", None)
        self.prompt_messages: list[dict] | None = None
        self.turn_messages: list[list[dict]] = []
        self.image_refs: list = []  # each image as the messages give it, in buffer order

    def _engine_view(self, ids: list[int]) -> list[int]:
        return collapse_image_pads(ids, self.image_token_id)[0] if self.image_token_id is not None else ids

    def start(self, encoded, messages: list[dict] | None = None) -> None:
        self.sample.set_prompt_tokens(encoded.ids)
        self.engine_ids = list(self._engine_view(encoded.ids))  # its own list: it grows with the turns
        self.buffer.append(encoded.tensors, encoded.images)
        self.prompt_messages = messages
        self.image_refs.extend(image_parts(messages or []))

    def add_output(self, ids: list[int], logprobs: list[float], text: str, versions: list[int]) -> None:
        self.sample.append_model_runs(ids, logprobs, versions, text)
        self.engine_ids.extend(ids)
        if self.encoder is not None:
            body = ids[:-1] if ids and ids[-1] == self.encoder.eot_id else ids
            content = self.encoder.tokenizer.decode(body, skip_special_tokens=False)
            self.turn_messages.append([{"role": "assistant", "content": content}])

    def add_observation(self, encoded, messages: list[dict] = ()) -> None:
        self.sample.append_observation_tokens(encoded.ids, encoded.text)
        self.engine_ids.extend(self._engine_view(encoded.ids))
        self.buffer.append(encoded.tensors, encoded.images)
        if self.turn_messages:
            self.turn_messages[-1].extend(messages)
        self.image_refs.extend(image_parts(list(messages))[: len(encoded.images)])

    def image_index(self, image) -> int:
        """The trajectory's index of an image a context holds: the same object, else the same pixels."""
        for k, ref in enumerate(self.image_refs):
            if ref is image:
                return k
        encoded = encode_image(image)
        for k, known in enumerate(self.buffer.image_data):
            if known == encoded:
                return k
        raise ContextPolicyError(
            f"sample {self.sample.index}: the context policy returned an image that is not one "
            f"of the trajectory's {self.buffer.num_images} images"
        )

    def conversation(self) -> list[dict]:
        """The append-only conversation so far: the prompt, then every turn's messages."""
        return self.prompt_messages + [m for turn in self.turn_messages for m in turn]

    def drop_end_of_turn(self, turn: Turn) -> None:
        """Take the end-of-turn token off the turn just generated (it is neither sent again nor
        trained): ``--no-conversation-multi-turn`` continues the same assistant message."""
        self.sample.drop_last_model_token()
        self.engine_ids.pop()
        turn.output_end -= 1
        turn.observation_end -= 1

    async def context(
        self, policy, retokenize: bool = False
    ) -> tuple[list[int], list[str], list[int] | None, list[int] | None]:
        """The next call's context -> (engine ids, image_data, context_ids, image_indices); the last two
        are None when the context is the append-only one (token-in/token-out on ``sample.tokens``).
        ``retokenize``: the whole conversation rendered and tokenized in one piece."""
        append_only = (self.engine_ids, self.buffer.image_data, None, None)
        if (policy is None and not retokenize) or not self.turn_messages:
            return append_only
        if self.prompt_messages is None:
            raise ContextPolicyError(
                f"sample {self.sample.index}: a context policy or --retokenize-chat-history "
                f"needs chat messages but the prompt is a raw string; pass "
                f"--apply-chat-template or message prompts"
            )
        conversation = self.conversation()
        if retokenize:
            messages, encoded = conversation, self.encoder.encode_prompt(conversation)
            if encoded.ids == self.sample.tokens:
                return append_only
        else:
            messages = await apply_policy(policy, self.ctx.args, self.sample, self.prompt_messages, self.turn_messages)
            if messages == conversation:
                return append_only
            outputs = [self.sample.tokens[t.output_start : t.output_end] for t in self.sample.turns]
            encoded = self.encoder.encode_context(messages, kept_outputs(messages, self.turn_messages, outputs))
        indices = [self.image_index(image) for image in image_parts(messages)]
        if indices:
            grid = self.buffer.image_grid_thw[indices]
            if not torch.equal(encoded.tensors["image_grid_thw"], grid):
                raise ContextPolicyError(
                    f"sample {self.sample.index}: the rewritten context's image grids "
                    f"{encoded.tensors['image_grid_thw'].tolist()} differ from the trajectory's "
                    f"{grid.tolist()}"
                )
        image_data = self.buffer.image_data
        return self._engine_view(encoded.ids), [image_data[k] for k in indices], encoded.ids, indices


def fit_observation(encoded, room: int, image_token_id: int | None):
    """Cut an encoded observation to ``room`` tokens; images whose pads do not fit entirely are
    dropped with everything after them. -> (encoded, was_cut)."""
    if len(encoded.ids) <= room:
        return encoded, False
    cut = max(room, 0)
    kept_images = 0
    if encoded.images:
        position = 0
        runs = []  # (start, end) of each image's pad run
        while position < len(encoded.ids):
            if encoded.ids[position] == image_token_id:
                start = position
                while position < len(encoded.ids) and encoded.ids[position] == image_token_id:
                    position += 1
                runs.append((start, position))
            else:
                position += 1
        for start, end in runs:
            if end <= cut:
                kept_images += 1
            else:
                cut = min(cut, start)
                break
    tensors = {}
    if kept_images:
        grid = encoded.tensors["image_grid_thw"][:kept_images]
        rows = int(grid.prod(dim=-1).sum())
        tensors = {"image_grid_thw": grid, "pixel_values": encoded.tensors["pixel_values"][:rows]}
    return Encoded(encoded.ids[:cut], encoded.images[:kept_images], tensors, encoded.text), True


async def run_episode(ctx: RolloutContext, sample: Sample, sampling_params: dict | None = None, env=None) -> Sample:
    """Run one trajectory to its end; always returns the sample with a final status. ``env``: an
    environment to use (default: ``build_env`` of the context's env module); it is closed at the end.
    An env that declares ``tools`` has its prompt encoded with them (in place of the row's); an
    observation its ``reset()`` returns follows the row's prompt (part of the prompt); an episode
    whose env cannot be brought back after a reset (``EpisodeRestart``) starts again from its prompt."""
    r = ctx.rollout
    sampling_params = dict(sampling_params or ctx.sampling_params())
    encoder = ctx.encoder((sample.metadata or {}).get("tools"))
    policy = ctx.context_policy()
    keeps_messages = policy is not None or r.retokenize_chat_history
    as_messages = ctx.data.apply_chat_template or not isinstance(sample.prompt, str)
    messages = (
        ([{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt))
        if as_messages
        else None
    )
    prompt = ctx.take_prompt_encoding(sample) or encoder.encode_prompt(sample.prompt, as_messages)
    row_messages = messages

    def open_with(first: dict | None) -> None:
        """The observation the env's reset() returned follows the row's prompt, as part of the prompt."""
        nonlocal prompt, messages
        if first is None:
            if sample.metadata.pop("first_observation", None) is not None:  # a restart that opens without one
                messages = row_messages
                prompt = encoder.encode_prompt(sample.prompt, as_messages)
            return
        sample.metadata["first_observation"] = first.get("text", "")
        if as_messages:
            opening = episode.format_observation(first)
            messages = row_messages + ([opening] if isinstance(opening, dict) else list(opening))
            prompt = encoder.encode_prompt(messages, True)
        else:
            prompt = encoder.encode_prompt(f"{sample.prompt}{first.get('text', '')}", False)

    def begin() -> Trajectory:
        traj = Trajectory(ctx, sample, encoder if keeps_messages else None)
        sample.clear_response()
        traj.start(prompt, messages)
        return traj

    traj = begin()
    episode = None
    stage = "env build"
    try:
        if env is None:
            env = await ctx.open_env(sample)
        if env is not None:
            episode = EpisodeEnv(ctx, env, sample)
            if episode.tools and as_messages:  # the env's tools replace the row's in the template
                sample.metadata["tools"] = episode.tools
                encoder = ctx.encoder(episode.tools)
                prompt = encoder.encode_prompt(sample.prompt, as_messages)
                traj = begin()
            stage = "env reset"
            if (first := await episode.reset()) is not None:
                open_with(first)
                traj = begin()
        stage = "rollout"
        while True:
            try:
                await _turn_loop(ctx, traj, encoder, episode, sampling_params, r, policy)
                break
            except EpisodeRestart as e:  # the env was reset and cannot replay: the episode begins again
                logger.info("sample %s: the episode restarts: %s", sample.index, e)
                sample.metadata["invalid_actions"] = 0
                sample.status = Status.PENDING
                open_with(episode.first_observation)
                traj = begin()
    except Exception as e:  # every fault is this sample's: an env step, the engine, the env's build or reset
        _failed(sample, e, stage)
    finally:
        if env is not None:
            try:
                await call_env(ctx, env.close)
            except Exception:
                logger.exception("env.close failed for sample %s", sample.index)
    _finish(sample, traj, encoder, r)
    return sample


def _failed(sample: Sample, e: Exception, stage: str) -> None:
    """The sample FAILED with ``e``'s cause: an env step that failed past its retries, an engine error, or
    what ``stage`` (the env's build or reset, the rollout) raised; infra failures of this sample only."""
    if isinstance(e, EnvStepFailed):
        fail(sample, e.cause, str(e), e.__cause__ or e)
        sample.metadata["error_turn"] = max(len(sample.turns) - 1, 0)  # the turn whose output the env was given
        if sample.turns:
            sample.turns[-1].env_retries = e.retries
    elif isinstance(e, EngineError):
        cause = "engine aborted the turn" if isinstance(e, EngineAbortedTurn) else "engine error"
        fail(sample, cause, f"engine: {e}", e)
    else:
        fail(sample, f"{stage} raised {type(e).__name__}", f"{stage} raised {type(e).__name__}: {e}", e)


def _finish(sample: Sample, traj: Trajectory, encoder, r) -> None:
    """A finished episode's images (concatenated once), weight versions, and with
    --retokenize-chat-history its final render (a concat sample that cannot be re-rendered FAILS)."""
    sample.multimodal_train_inputs = traj.buffer.finalize()
    if traj.buffer.num_images:
        sample.multimodal_inputs = {**(sample.multimodal_inputs or {}), "image_data": traj.buffer.image_data}
    sample.weight_versions = [t.weight_version for t in sample.turns if t.weight_version is not None]
    if r.retokenize_chat_history and sample.turns:
        try:
            retokenize_history(sample, encoder, traj.conversation(), as_concat=r.sample_format == "concat")
        except Exception as e:  # e.g. the model wrote an image placeholder the render now expands
            logger.warning("sample %s: the final re-render failed: %s", sample.index, e)
            if r.sample_format == "concat":  # nothing exact to train: the sample keeps no trainable token
                message = f"re-rendering the history: {type(e).__name__}: {e}"
                fail(sample, "re-rendering the history failed", message, e)


def resumed_output(
    tokenizer, ids: list[int], stops: list[str], skip_special_tokens: bool = True
) -> tuple[int, str | None]:
    """Where a turn made of several calls ends -> (how many of its ``ids`` it keeps, the stop string
    that ends it, or None). Each call's engine checked the stop strings over its own output only, so
    one that spans a resume point went unseen: the turn ends at the first token whose output (the
    decode of the turn's ids up to it) holds a stop string, where one call would have ended it."""

    def stop_in(n: int) -> str | None:
        text = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        return next((stop for stop in stops if stop in text), None)

    if not stops or stop_in(len(ids)) is None:
        return len(ids), None
    short, long = 0, len(ids)  # stop_in(short) is None, stop_in(long) is not: outputs only grow
    while long - short > 1:
        middle = (short + long) // 2
        if stop_in(middle) is None:
            short = middle
        else:
            long = middle
    return long, stop_in(long)


def version_name(ctx: RolloutContext, engine_version):
    """The version a turn records: the engine's name, ``"default"`` read as the run's starting version."""
    return str(ctx.start_version) if engine_version == "default" else engine_version


def route_of(sample: Sample) -> str:
    """The name that keeps a trajectory's requests on one engine (clients that route themselves)."""
    return f"{sample.metadata.get('rollout_id', '')}/{sample.index}/{id(sample)}"


def token_versions(ctx: RolloutContext, meta: dict, n: int) -> list[int]:
    """The weight version of each of a response's ``n`` tokens: the engine's spans when its tokens span
    an update (vLLM's ``weight_version_spans``), else its one ``weight_version``."""
    versions = [ctx.version_of(meta.get("weight_version"))] * n
    for span in meta.get("weight_version_spans") or []:
        versions[span["start"] : span["end"]] = [ctx.version_of(span["version"])] * (span["end"] - span["start"])
    return versions


def _count(sample: Sample, key: str) -> None:
    sample.metadata[key] = sample.metadata.get(key, 0) + 1


async def generate_turn(
    ctx: RolloutContext, sample: Sample, engine_ids: list[int], params: dict, image_data: list[str] | None
) -> tuple[list[int], list[float], list[int], str, dict]:
    """One turn's engine call(s) -> (output ids, log-probs, per-token versions, text, the turn's
    meta_info: the last call's, with the turn's finish reason).

    A call that ends in abort is made again: one a weight update aborted (``UPDATE_ABORT``) as often
    as updates come; any other (an engine restarted, an operator's ``/abort_request``, an over-sampling
    cut) at most ``--engine-max-retries`` times in the turn, then EngineAbortedTurn fails the sample.
    With ``--partial-rollout`` the next call continues from the turn's tokens, which keep their
    log-probs and version; without it the turn starts again from its context. A turn of several calls
    ends at the first stop string of its joined output and its text is the decode of all its ids
    (a character split across calls is whole). ``sample.metadata`` counts ``partial_resumes`` and
    ``regenerated_turns`` (weight updates) and ``engine_aborts`` (the others)."""
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    texts: list[str] = []
    budget = params["max_new_tokens"]
    calls = aborts = 0
    held = 0 if sample.routed_experts is None else len(sample.routed_experts)  # routed rows before this turn
    while True:
        call = dict(params, max_new_tokens=budget - len(ids))
        if calls and "sampling_seed" in call:  # a call made again must not replay the last call's draws
            call["sampling_seed"] = (call["sampling_seed"] + calls) % (2**31 - 1)
        context = engine_ids + ids if ids else engine_ids  # the growing context is copied only to resume
        response = await ctx.client.generate(
            context, call, image_data=image_data or None, route=route_of(sample), **ctx.route_request(sample)
        )
        calls += 1
        meta = response["meta_info"]
        ctx.add_routes(sample, meta)
        new, new_logprobs = output_of(response)
        aborted, by_update = meta["finish_reason"]["type"] == "abort", bool(meta.get(UPDATE_ABORT))
        if aborted and not by_update:
            aborts += 1
            _count(sample, "engine_aborts")
            if aborts > ctx.client.max_retries:
                raise EngineAbortedTurn(
                    f"the engine aborted turn {len(sample.turns)} {aborts} times, no weight update among them "
                    f"(--engine-max-retries {ctx.client.max_retries}); last: {meta['finish_reason']}"
                )
        if aborted and not ctx.rollout.partial_rollout:
            if by_update:
                _count(sample, "regenerated_turns")
            ids, logprobs, versions, texts = [], [], [], []
            if sample.routed_experts is not None:  # the turn starts again: so do its routes
                sample.routed_experts = sample.routed_experts[:held]
            continue
        ids += new
        logprobs += new_logprobs
        versions += token_versions(ctx, meta, len(new))
        texts.append(response.get("text", ""))
        if not aborted:
            break
        if by_update:
            _count(sample, "partial_resumes")
        if len(ids) >= budget:
            meta = {**meta, "finish_reason": {"type": "length", "length": budget}}
            break
    if len(texts) == 1:
        return ids, logprobs, versions, texts[0], meta
    skip = params.get("skip_special_tokens", True)
    keep, stop = resumed_output(ctx.tokenizer, ids, params.get("stop") or [], skip)
    text = ctx.tokenizer.decode(ids[:keep], skip_special_tokens=skip)
    if stop is not None:
        meta = {**meta, "finish_reason": {"type": "stop", "matched": stop}}
        if not params.get("no_stop_trim", False):
            text = text[: text.index(stop)]
    elif meta["finish_reason"]["type"] == "length":  # the turn's length, not its last call's
        meta = {**meta, "finish_reason": {"type": "length", "length": keep}}
    return ids[:keep], logprobs[:keep], versions[:keep], text, meta


async def _turn_loop(ctx, traj: Trajectory, encoder, env, sampling_params: dict, r, policy) -> None:
    """Turns until a stop; a turn the env rejected as an invalid action does not count toward
    ``max_turns`` (at most ``max_invalid_actions_per_turn`` of them in a row)."""
    sample = traj.sample
    counted = invalid_in_a_row = 0
    for turn_index in itertools.count():  # every engine call (its seed); ``counted``: the valid turns
        if counted >= r.max_turns:
            return
        engine_ids, image_data, context_ids, image_indices = await traj.context(policy, r.retokenize_chat_history)
        room = _context_room(sample, context_ids, r)
        if room <= 0:
            return
        params = dict(sampling_params, max_new_tokens=min(r.rollout_max_response_len, room))
        if "sampling_seed" not in params and "rollout_id" in sample.metadata:
            # a seed per (run seed, step, sample, turn): a resumed run samples what the original did
            params["sampling_seed"] = turn_seed(
                ctx.data.rollout_seed, sample.metadata["rollout_id"], sample.index or 0, turn_index
            )
        started = time.perf_counter()
        ids, logprobs, versions, text, meta = await generate_turn(ctx, sample, engine_ids, params, image_data)
        engine_seconds = time.perf_counter() - started
        start = len(sample.tokens)
        traj.add_output(ids, logprobs, text, versions)
        if sample.routed_experts is not None:  # a turn cut at a stop string keeps the rows of its tokens
            sample.routed_experts = sample.routed_experts[: len(sample.tokens)]
        finish = meta["finish_reason"]
        turn = Turn(
            output_start=start,
            output_end=len(sample.tokens),
            observation_end=len(sample.tokens),
            finish_reason=finish["type"],
            weight_version=version_name(ctx, meta.get("weight_version")),
            engine_seconds=engine_seconds,
            num_images=traj.buffer.num_images,
            context_ids=context_ids,
            image_indices=image_indices,
        )
        sample.turns.append(turn)
        if finish["type"] == "length":
            sample.status, sample.metadata["termination"] = Status.TRUNCATED, "engine_length"
            return
        if env is None:
            sample.status, sample.metadata["termination"] = Status.COMPLETED, "no_env"
            return
        started = time.perf_counter()
        observation, done, info, retries = await env.step(text)
        turn.env_seconds, turn.env_retries = time.perf_counter() - started, retries
        _keep_env_info(sample, turn, info)
        invalid = bool(info.get("invalid_action"))
        invalid_in_a_row = invalid_in_a_row + 1 if invalid else 0
        counted += not invalid
        sample.metadata["invalid_actions"] = sample.metadata.get("invalid_actions", 0) + invalid
        if invalid and invalid_in_a_row > r.max_invalid_actions_per_turn and not done:
            sample.status, sample.metadata["termination"] = Status.TRUNCATED, "invalid_actions"
            return
        last_turn = counted >= r.max_turns
        if done or last_turn:
            sample.status = Status.COMPLETED
            sample.metadata["termination"] = "env_done" if done else "max_turns"
            return
        if _observe(traj, turn, encoder, env.format_observation(observation), ids, r, policy):
            sample.status, sample.metadata["termination"] = Status.TRUNCATED, "observation_cut"
            return


def _context_room(sample: Sample, context_ids: list[int] | None, r) -> int:
    """The tokens the next turn may generate in ``--rollout-max-context-len``; none left ends the sample:
    FAILED when the prompt alone fills the context (the model never saw it), else TRUNCATED."""
    used = len(sample.tokens) if context_ids is None else len(context_ids)
    room = r.rollout_max_context_len - used
    if room <= 0 and not sample.turns:  # the prompt alone fills the context: the model never saw it
        fail(
            sample,
            "prompt longer than the context",
            f"the prompt is {used} tokens and --rollout-max-context-len is {r.rollout_max_context_len}: it never "
            "reached the model (such rows are left out at load; --rollout-max-prompt-len leaves out more)",
        )
    elif room <= 0:
        sample.status = Status.TRUNCATED
        sample.metadata["termination"] = "context_exhausted"
    return room


def _keep_env_info(sample: Sample, turn: Turn, info: dict) -> None:
    """The env step's plain info on the turn, and its reward (the sample's env reward; the turn's when a number)."""
    turn.env_info = {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool)) or v is None}
    if "reward" in info:
        sample.metadata["env_reward"] = info["reward"]
        if isinstance(info["reward"], (int, float)):
            turn.reward = float(info["reward"])


def _observe(traj: Trajectory, turn: Turn, encoder, formatted, ids: list[int], r, policy) -> bool:
    """The env's formatted observation appended after the turn's output (observation tokens: loss mask 0)
    -> whether it was cut to fit the context. Without --conversation-multi-turn the model's end-of-turn
    goes and the observation follows as raw text in one assistant message."""
    sample = traj.sample
    model_ended_turn = bool(ids) and ids[-1] == encoder.eot_id
    if r.conversation_multi_turn:
        encoded = encoder.encode_observation(formatted, model_ended_turn)
    else:
        if model_ended_turn:
            traj.drop_end_of_turn(turn)
        encoded = encoder.encode_raw_observation(formatted, r.observation_template)
    cut = False
    if policy is None and not r.retokenize_chat_history:  # a re-rendered context is measured when built
        encoded, cut = fit_observation(encoded, r.rollout_max_context_len - len(sample.tokens), traj.image_token_id)
    traj.add_observation(encoded, [formatted] if isinstance(formatted, dict) else list(formatted))
    turn.observation_end = len(sample.tokens)
    return cut
