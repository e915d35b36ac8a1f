"""Each trainer rank receives its own share of the step's batch from rank 0, never the whole batch, and
rank 0's rollout failure in its place (``roles.link.send_shares``): a gloo world of 4 ranks at TP=2 x DP=2
under torchrun. Integration tier,
about 10 s (four processes import torch)."""

import json
import subprocess
import sys

from train_helpers import HELPERS, REPO, repo_env

from slime_mt.algo.batching import split_by_dp


def test_each_rank_receives_its_dp_ranks_groups_alone_and_the_failure_of_a_step(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    proc = subprocess.run(
        [*cmd, str(HELPERS / "rank_shares_worker.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=repo_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(4)]
    sys.path.insert(0, str(HELPERS))
    from rank_shares_worker import batch

    whole = batch(8)
    expected = split_by_dp(whole.samples, whole.advantages, 8, 2, "token_mean", 4096)
    for rank, received in enumerate(got):
        share = expected[rank // 2]  # TP peers train the same groups
        assert received["indices"] == share.indices and len(share.indices) == 8  # 4 of the 8 groups
        assert received["pixels"] == [float(i) for i in share.indices]  # each sample's image came with it
        assert received["weights"] == share.weights
    sent = got[0]["sent"]
    half = sent["train/batch_bytes"] / 2
    assert half <= sent["train/batch_bytes_per_rank"] < half * 1.02  # 1/DP of the batch, plus headers
    assert all(r["sent"] == {} for r in got[1:])  # only rank 0 sends
    for rank in range(4):  # a failed step reaches every rank as the error rank 0 raised
        failed = (tmp_path / f"failed_{rank}.txt").read_text()
        assert failed == "RolloutFailedError: step 3: every sample failed"
