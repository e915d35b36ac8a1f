"""Weight updates in the middle of a turn (``--fully-async``): a real embedded engine over HTTP, the
client's UpdateGate, new weights pushed while the turn generates. With ``--partial-rollout`` the
turn keeps what it generated under version 0 and continues under version 1; without it the turn is
generated again. Text and VLM (the images go with the resumed call)."""

import pytest

from slime_mt.rollout.finalize import finalize
from slime_mt.types import NO_VERSION, Sample


def test_observation_tokens_have_no_version_and_the_sample_checks_lengths():
    sample = Sample(index=3)
    sample.set_prompt_tokens([1, 2])
    sample.append_model_tokens([5, 6], [-0.1, -0.2], version=4)
    sample.append_observation_tokens([7])
    sample.append_model_tokens([8], [-0.3], version=5)
    assert sample.token_versions == [4, 4, NO_VERSION, 5]
    sample.drop_last_model_token()
    assert sample.token_versions == [4, 4, NO_VERSION]
    sample.validate()
    sample.token_versions.append(9)
    with pytest.raises(ValueError, match="sample 3: len\\(token_versions\\)=4 != response_length=3"):
        sample.validate()


def test_versions_follow_each_token_through_step_wise_and_merge():
    """Two turns, the first resumed across an update (versions 3 then 4), an observation between: each
    format keeps every token's version, and merge gives the observation delta NO_VERSION."""
    from slime_mt.types import Turn

    sample = Sample(index=0, group_index=0)
    sample.set_prompt_tokens([1, 2, 3])
    sample.append_model_tokens([10, 11], [-0.1, -0.2], version=3)
    sample.append_model_tokens([12], [-0.3], version=4)
    sample.append_observation_tokens([20, 21])
    sample.append_model_tokens([13, 14], [-0.4, -0.5], version=4)
    sample.turns = [Turn(3, 6, 8), Turn(8, 10, 10)]
    sample.validate()
    (concat,), _ = finalize([sample], "concat", merge=False)
    assert concat.token_versions == [3, 3, 4, NO_VERSION, NO_VERSION, 4, 4]
    steps, _ = finalize([sample], "step_wise", merge=False)
    assert [s.token_versions for s in steps] == [[3, 3, 4], [4, 4]]
    (merged,), _ = finalize([sample], "step_wise", merge=True)
    assert merged.token_versions == concat.token_versions and merged.loss_mask == [1, 1, 1, 0, 0, 1, 1]
