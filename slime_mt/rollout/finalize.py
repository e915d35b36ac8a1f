"""From trajectories (Samples) to training sequences (TrainingSamples), as SkyRL defines the formats.

- concat: one sequence per trajectory; response = every token after the prompt (model output and
  observations), mask and log-probs as recorded.
- step-wise: one sequence per LLM turn; prompt = the exact context the model saw at that turn (which
  need not extend the previous turn's context when a rollout rewrites history), response = that turn's
  generated tokens (mask 1), reward on the last step, ``is_last_step`` marking it; VLM steps carry
  the tensors of the images in their own context.
- merge: greedy prefix-aware merge of consecutive steps of a trajectory whose context extends the
  previous step's prompt + response, tokens and images alike (a context policy can put another
  screenshot of the same size, and so the same image pad run, where an earlier one was): the
  observation delta joins with mask 0, log-prob 0.0.

Every format carries each response token's weight version (``token_versions``, NO_VERSION on
observation tokens) next to its rollout log-prob, so a turn resumed across a weight update trains
each token against the policy that sampled it.

FAILED samples keep no trainable token (mask all 0); with ``mask_truncated`` TRUNCATED and ABORTED
samples neither. In step-wise formats a sample without turns (FAILED before its first engine call,
or TRUNCATED because its prompt already filled the context) has no step: it is counted in the
metrics (``train/samples_without_turns``) and, having no last step, stays out of its group's
advantage statistics.
"""

from __future__ import annotations

import dataclasses

import torch

from slime_mt.errors import StepWiseError
from slime_mt.routes import rows_for
from slime_mt.types import NO_VERSION, Sample, Status, TrainingSample


def _copy(values: list | None, start: int = 0, end: int | None = None) -> list | None:
    """A slice copy of a list that may be None (rollout log-probs that do not exist)."""
    return None if values is None else list(values[start:end])


def _versions(sample: Sample, start: int = 0, end: int | None = None) -> list[int] | None:
    """The sample's per-token versions over a response slice; None when it recorded none."""
    versions = sample.token_versions
    if not versions or len(versions) != sample.response_length:
        return None
    return list(versions[start:end])


def _trainable(sample: Sample, mask_truncated: bool) -> bool:
    if sample.status == Status.FAILED:
        return False
    return not (mask_truncated and sample.status in (Status.TRUNCATED, Status.ABORTED))


def _trajectory_id(sample: Sample) -> str:
    return f"{sample.group_index}/{sample.index}"


def _stop_reason(sample: Sample) -> str | None:
    return sample.metadata.get("termination") or (sample.turns[-1].finish_reason if sample.turns else None)


def to_concat_samples(samples: list[Sample], mask_truncated: bool = False) -> list[TrainingSample]:
    out = []
    for s in samples:
        if not s.tokens:  # failed before its prompt was encoded: nothing to pack or train
            continue
        rewritten = [k for k, t in enumerate(s.turns) if t.context_ids is not None]
        if rewritten:
            raise StepWiseError(
                f"sample {s.index}: the context of turn {rewritten[0]} was rewritten, so its "
                f"concatenated sequence is not what the model saw; use --sample-format step_wise"
            )
        start = s.prompt_length
        mask = list(s.loss_mask) if _trainable(s, mask_truncated) else [0] * s.response_length
        out.append(
            TrainingSample(
                prompt_ids=list(s.tokens[:start]),
                response_ids=list(s.tokens[start:]),
                loss_mask=mask,
                rollout_log_probs=_copy(s.rollout_log_probs),
                reward=float(s.reward or 0.0),
                trajectory_id=_trajectory_id(s),
                group_id=int(s.group_index or 0),
                is_last_step=True,
                stop_reason=_stop_reason(s),
                multimodal_train_inputs=s.multimodal_train_inputs,
                status=s.status,
                token_versions=_versions(s),
                routed_experts=rows_for(s.routed_experts, len(s.tokens)),
            )
        )
    return out


def image_rows(multimodal: dict | None, image_indices: list[int]) -> dict | None:
    """The tensors of the chosen images: ``image_grid_thw`` rows and their ``pixel_values`` rows
    (image i owns ``prod(grid[i])`` consecutive pixel rows)."""
    if not multimodal or not image_indices:
        return None
    grid = multimodal["image_grid_thw"]  # [N, 3]
    sizes = grid.prod(dim=-1)  # [N]
    starts = torch.cumsum(sizes, 0) - sizes
    pixels = torch.cat([multimodal["pixel_values"][int(starts[i]) : int(starts[i] + sizes[i])] for i in image_indices])
    return {"pixel_values": pixels, "image_grid_thw": grid[image_indices]}


def to_step_wise_samples(samples: list[Sample], mask_truncated: bool = False) -> list[TrainingSample]:
    """One sequence per turn; samples without turns give none (see the module docstring)."""
    out = []
    for s in samples:
        trainable = _trainable(s, mask_truncated)
        start = s.prompt_length
        if not s.turns and s.response_length:
            raise StepWiseError(
                f"sample {s.index}: {s.response_length} response tokens but no turn records; "
                f"step-wise needs them: a generate function appends its turns with "
                f"ctx.append_engine_turn / Sample.append_turn (docs/rollouts.md: Writing a generate function)"
            )
        for k, turn in enumerate(s.turns):
            last = k == len(s.turns) - 1
            prompt = list(turn.context_ids) if turn.context_ids is not None else list(s.tokens[: turn.output_start])
            response = list(s.tokens[turn.output_start : turn.output_end])
            logprobs = _copy(s.rollout_log_probs, turn.output_start - start, turn.output_end - start)
            images = turn.image_indices if turn.image_indices is not None else list(range(turn.num_images))
            out.append(
                TrainingSample(
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=[int(trainable)] * len(response),
                    rollout_log_probs=logprobs,
                    reward=float(s.reward or 0.0) if last else 0.0,
                    trajectory_id=_trajectory_id(s),
                    group_id=int(s.group_index or 0),
                    is_last_step=last,
                    stop_reason=_stop_reason(s) if last else turn.finish_reason,
                    multimodal_train_inputs=image_rows(s.multimodal_train_inputs, images),
                    status=s.status,
                    token_versions=_versions(s, turn.output_start - start, turn.output_end - start),
                    turns=[k],
                    # append-only contexts (R3 refuses the others): the turn's sequence is tokens[:output_end]
                    routed_experts=rows_for(s.routed_experts, turn.output_end) if turn.context_ids is None else None,
                )
            )
    return out


def validate_step_wise(samples: list[TrainingSample]) -> None:
    """Assert the step-wise invariants; StepWiseError names the first broken one."""
    if not samples:
        raise StepWiseError("no step-wise samples")
    if not samples[-1].is_last_step:
        raise StepWiseError(f"the last entry (trajectory {samples[-1].trajectory_id}) is not a last step")
    seen: set[str] = set()
    for i, s in enumerate(samples):
        logprobs = len(s.response_ids) if s.rollout_log_probs is None else len(s.rollout_log_probs)
        versions = len(s.response_ids) if s.token_versions is None else len(s.token_versions)
        if not (len(s.response_ids) == len(s.loss_mask) == logprobs == versions):
            raise StepWiseError(
                f"entry {i} (trajectory {s.trajectory_id}): response {len(s.response_ids)}, "
                f"mask {len(s.loss_mask)}, log-probs {logprobs}, versions {versions} differ"
            )
        nxt = samples[i + 1] if i + 1 < len(samples) else None
        boundary = nxt is None or nxt.trajectory_id != s.trajectory_id
        if s.is_last_step != boundary:
            raise StepWiseError(
                f"entry {i} (trajectory {s.trajectory_id}): is_last_step={s.is_last_step} but the "
                f"trajectory {'ends' if boundary else 'continues'} here"
            )
        if i == 0 or samples[i - 1].trajectory_id != s.trajectory_id:
            if s.trajectory_id in seen:
                raise StepWiseError(f"entry {i}: steps of trajectory {s.trajectory_id} are not contiguous")
            seen.add(s.trajectory_id)


def _images_extend(before: dict | None, after: dict | None) -> bool:
    """``after``'s images begin with ``before``'s: the same grids and the same pixel rows."""
    if not before:
        return True
    if not after:
        return False
    grid, pixels = before["image_grid_thw"], before["pixel_values"]  # [N, 3], [rows, C]
    later_grid, later_pixels = after["image_grid_thw"], after["pixel_values"]
    if later_grid.shape[0] < grid.shape[0] or not torch.equal(later_grid[: grid.shape[0]], grid):
        return False
    return later_pixels.shape[0] >= pixels.shape[0] and torch.equal(later_pixels[: pixels.shape[0]], pixels)


def merge_step_wise(samples: list[TrainingSample]) -> list[TrainingSample]:
    """Greedy prefix-aware merge within each trajectory (input: validated step-wise samples)."""
    merged: list[TrainingSample] = []
    current: TrainingSample | None = None
    for step in samples:
        if current is not None and current.trajectory_id == step.trajectory_id:
            context = current.prompt_ids + current.response_ids
            if step.prompt_ids[: len(context)] == context and _images_extend(
                current.multimodal_train_inputs, step.multimodal_train_inputs
            ):
                delta = step.prompt_ids[len(context) :]
                current = dataclasses.replace(
                    step,
                    prompt_ids=current.prompt_ids,
                    response_ids=current.response_ids + delta + step.response_ids,
                    loss_mask=current.loss_mask + [0] * len(delta) + step.loss_mask,
                    rollout_log_probs=None
                    if None in (current.rollout_log_probs, step.rollout_log_probs)
                    else current.rollout_log_probs + [0.0] * len(delta) + step.rollout_log_probs,
                    token_versions=None
                    if None in (current.token_versions, step.token_versions)
                    else current.token_versions + [NO_VERSION] * len(delta) + step.token_versions,
                    turns=(current.turns or []) + (step.turns or []),
                )
                continue
        if current is not None:
            merged.append(current)
        current = dataclasses.replace(
            step,
            prompt_ids=list(step.prompt_ids),
            response_ids=list(step.response_ids),
            loss_mask=list(step.loss_mask),
            rollout_log_probs=_copy(step.rollout_log_probs),
            token_versions=_copy(step.token_versions),
            turns=_copy(step.turns),
        )
    if current is not None:
        merged.append(current)
    return merged


def sequence_metrics(before: list[TrainingSample], after: list[TrainingSample]) -> dict[str, float]:
    """Sequences and tokens to forward before and after merging."""
    tokens = lambda xs: sum(len(x.prompt_ids) + len(x.response_ids) for x in xs)  # noqa: E731
    return {
        "train/sequences_before_merge": len(before),
        "train/sequences_after_merge": len(after),
        "train/tokens_before_merge": tokens(before),
        "train/tokens_after_merge": tokens(after),
    }


def finalize(
    samples: list[Sample], sample_format: str, merge: bool, mask_truncated: bool = False
) -> tuple[list[TrainingSample], dict[str, float]]:
    """Samples -> training sequences in the configured format, with merge metrics."""
    if sample_format == "concat":
        out = to_concat_samples(samples, mask_truncated)
        return out, sequence_metrics(out, out)
    steps = to_step_wise_samples(samples, mask_truncated)
    without = [s for s in samples if not s.turns]
    if not steps:
        raise StepWiseError(
            f"no step-wise samples: all {len(samples)} samples ended before their first turn "
            f"(statuses {sorted({s.status.value for s in without})})"
        )
    validate_step_wise(steps)
    merged = merge_step_wise(steps) if merge else steps
    return merged, {**sequence_metrics(steps, merged), "train/samples_without_turns": len(without)}
