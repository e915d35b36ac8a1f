"""slime.rollout.rm_hub: ``async_rm`` (``--custom-rm-path``, else the ``--rm-type`` grader),
``batched_async_rm``, and the graders slime's examples import from here (``grade_answer_verl``,
``extract_boxed_answer``; see ``math_utils``)."""

import asyncio

from slime_mt.plugins import load_function
from slime_mt.rollout.rewards import remote_rm, rule_based_rm

from .math_utils import extract_boxed_answer, grade_answer_verl

__all__ = ["async_rm", "batched_async_rm", "extract_boxed_answer", "grade_answer_verl", "remote_rm"]


async def async_rm(args, sample, **kwargs):
    path = getattr(sample, "custom_rm_path", None) or args.custom_rm_path
    if path:
        return await load_function(path)(args, sample, **kwargs)
    return await rule_based_rm(args, sample)


async def batched_async_rm(args, samples, **kwargs):
    if args.custom_rm_path:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples))
