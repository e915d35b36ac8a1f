"""``--slime-compat``: plug-ins written against slime's API (tests/slime_plugins, in the style of slime's
Search-R1, geo3k VLM multi-turn and custom-rollout examples) train through ``slime-mt train``; slime's
names, ``append_response_tokens``, turns rebuilt from loss-mask runs, the drift of text sent to the
engine, and the built-in graders of ``--rm-type``."""

from argparse import Namespace

from http_helpers import json_server

from slime_mt.compat import install
from slime_mt.rollout.rewards import rule_based_rm

install()
from slime.utils.types import Sample  # noqa: E402  (resolved by install())


def slime_sample(prompt_ids, **kw) -> Sample:
    return Sample(**{"index": 0, "group_index": 0, **kw}, tokens=list(prompt_ids))


def rm(args, sample):
    import asyncio

    return asyncio.run(rule_based_rm(args, sample))


def test_remote_rm_posts_the_sample_to_rm_url():
    def grade(path, body):
        return {"score": float(body["response"] == body["label"])}

    with json_server(grade) as (url, seen):
        args = Namespace(rm_type="remote_rm", rm_url=f"{url}/grade")
        assert rm(args, slime_sample([1], prompt="q", response="4", label="4")) == {"score": 1.0}
        assert seen == [{"prompt": "q", "response": "4", "label": "4"}]
