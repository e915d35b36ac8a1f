"""Issue 69 (items 1, 2 and 5): the held-out datasets as slime reads them (its example multi-task YAML,
``--eval-prompt-data NAME PATH ...``), each setting from the dataset, eval.defaults, the eval flag or the
training run's; bad input refused before the run naming the dataset; pass@k the unbiased estimator; the
per-dataset figures. Unit tier: parsing and arithmetic (under a second)."""

import itertools
import json
import math

import pytest
from eval_helpers import SLIME_MULTI_TASK

from slime_mt.config import eval_datasets
from slime_mt.config_parsing import parse_config
from slime_mt.errors import ConfigError, DatasetError
from slime_mt.rollout.evaluation import eval_metrics, ks_for, load_eval_sets, pass_at_k
from slime_mt.types import Sample, Status


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name in ("aime", "gpqa", "ifbench"):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text(json.dumps({"prompt": f"a {name} question", "label": "1"}) + "\n")
    return paths


def config(tmp_path, files, *flags, text=SLIME_MULTI_TASK):
    path = tmp_path / "multi_task.yaml"
    path.write_text(text.format(**files))
    return parse_config(["--rollout-max-context-len", "32768", "--eval-config", str(path), *flags])


def test_slimes_multi_task_yaml_resolves_each_dataset_as_slime_does(tmp_path, files):
    # ifbench is graded by the reward function here (this project has no ifbench grader), as slime's
    # custom_rm_path wins over the dataset's rm_type, which stays in each row's metadata
    cfg = config(tmp_path, files, "--custom-rm-path", "my_rm.py:rm", "--rollout-temperature", "0.6")
    aime, gpqa, ifbench = eval_datasets(cfg)
    assert [d.name for d in (aime, gpqa, ifbench)] == ["aime", "gpqa", "ifbench"]
    assert [d.n_samples_per_eval_prompt for d in (aime, gpqa, ifbench)] == [16, 2, 1]
    assert {(d.max_response_len, d.top_p, d.temperature) for d in (aime, gpqa, ifbench)} == {(16384, 0.7, 0.6)}
    assert [d.rm_type for d in (aime, gpqa, ifbench)] == ["deepscaler", "gpqa", "ifbench"]
    assert {d.custom_rm_path for d in (aime, gpqa, ifbench)} == {"my_rm.py:rm"}
    rollout = aime.rollout_config(cfg.rollout)
    assert (rollout.n_samples_per_prompt, rollout.rollout_top_p, rollout.rollout_max_response_len) == (16, 0.7, 16384)
    assert rollout.dynamic_sampling_filter_path is None
    sets = load_eval_sets(cfg)
    assert [es.rows.rows[0].metadata["rm_type"] for es in sets] == ["deepscaler", "gpqa", "ifbench"]
    assert [es.rows.n for es in sets] == [16, 2, 1]


def test_without_a_reward_function_a_grader_this_project_lacks_is_refused_naming_the_dataset(tmp_path, files):
    with pytest.raises(ConfigError, match="dataset 'ifbench': rm_type 'ifbench': not a built-in grader"):
        config(tmp_path, files)


def test_eval_prompt_data_pairs_and_the_fallbacks(tmp_path, files):
    flags = ["--eval-prompt-data", "a", str(files["aime"]), "g", str(files["gpqa"]), "--eval-top-p", "0.5"]
    flags += ["--rollout-top-k", "20", "--n-samples-per-eval-prompt", "4", "--eval-label-key", "answer"]
    a, g = eval_datasets(parse_config(flags))
    assert (a.name, a.path, g.name) == ("a", str(files["aime"]), "g")
    assert (a.top_p, a.top_k, a.n_samples_per_eval_prompt, a.label_key, a.input_key) == (0.5, 20, 4, "answer", "prompt")
    (one,) = eval_datasets(parse_config(["--eval-prompt-data", str(files["gpqa"])]))
    assert one.name == "gpqa"  # one PATH alone: named after its file
    assert eval_datasets(parse_config([])) == []


ONE = "eval:\n  datasets:\n    - name: x\n      path: {aime}\n"  # one dataset, named x


@pytest.mark.parametrize(
    "text, message",
    [
        ("eval:\n  datasets: []\n", "defines no datasets under eval.datasets"),
        ("eval:\n  datasets:\n    - path: {aime}\n", r"eval.datasets\[0\] must be a mapping with a name"),
        (ONE + "      topp: 0.7\n", "dataset 'x': unknown key 'topp'"),
        (ONE + "      app_service: u\n", "app_service is slime's"),
        (ONE.replace("eval:\n", "eval:\n  defaults:\n    top_pp: 1\n"), "eval.defaults: unknown"),
        (ONE + "      top_p: 2\n", "dataset 'x': top_p 2 must be"),
        (ONE + "      rm_type: nope\n", "dataset 'x': rm_type 'nope'"),
        (
            "eval:\n  datasets:\n    - name: x\n      path: {aime}\n    - name: x\n      path: {gpqa}\n",
            "names must be unique; x given more than once",
        ),
        (ONE + "      n_samples_per_eval_prompt: 0\n", "positive"),
    ],
)
def test_bad_eval_configs_are_refused_naming_the_dataset_and_key(tmp_path, files, text, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, files, text=text)


def test_a_missing_file_is_named_when_the_rows_are_read_not_by_a_dry_run(tmp_path, files):
    """The flags alone do not need the data (``--dry-run`` prints a GPU recipe's configuration where its
    files are not); reading the rows, as preflight does before the run, names the dataset and file."""
    cfg = config(tmp_path, files, text=ONE.replace("{aime}", "/nowhere.jsonl"))
    assert [d.path for d in eval_datasets(cfg)] == ["/nowhere.jsonl"]
    with pytest.raises(DatasetError, match="eval dataset 'x': /nowhere.jsonl: no such file"):
        load_eval_sets(cfg)


def test_a_row_without_the_datasets_key_names_the_dataset(tmp_path, files):
    text = "eval:\n  datasets:\n    aime:\n      path: {aime}\n      input_key: question\n"  # slime's mapping form
    with pytest.raises(DatasetError, match="eval dataset 'aime': row 1 of aime.jsonl: no key 'question'"):
        load_eval_sets(config(tmp_path, files, text=text))


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in itertools.product([8], range(9), [1, 2, 4, 8]):
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_a_datasets_figures_from_known_rewards():
    """Two prompts of 8 samples: 3 and 0 of them right; one truncated, one failed (reward 0)."""

    def sample(reward, status=Status.COMPLETED, length=10):
        return Sample(reward=reward, status=status, response_length=length)

    first = [sample(1.0), sample(1.0), sample(1.0, Status.TRUNCATED, 30)] + [sample(0.0) for _ in range(5)]
    second = [sample(0.5), sample(1.0, Status.FAILED)] + [sample(0.0) for _ in range(6)]
    m = eval_metrics("aime", [first, second], 8)
    assert m["eval/aime/reward_mean"] == pytest.approx(3.5 / 16)
    assert m["eval/aime/samples"] == 16 and m["eval/aime/truncated_rate"] == m["eval/aime/failed_rate"] == 1 / 16
    assert m["eval/aime/response_length_mean"] == pytest.approx((15 * 10 + 30) / 16)
    for k in (1, 2, 4, 8):
        assert m[f"eval/aime/pass@{k}"] == pytest.approx((pass_at_k(8, 3, k) + pass_at_k(8, 0, k)) / 2)
    assert m["eval/aime/pass@1"] == pytest.approx(3 / 16) and m["eval/aime/pass@8"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("flags", "beside", "priorities"),
    [
        ([], False, False),  # sync: between steps, as today
        (["--async"], True, True),
        (["--fully-async"], True, True),
        (["--fully-async", "--engine-url", "http://127.0.0.1:1"], True, True),  # SGLang ignores what it does not use
        (["--fully-async", "--engine", "vllm", "--engine-url", "http://127.0.0.1:1"], True, False),  # vLLM FCFS refuses
        (["--fully-async", "--skip-eval-before-train"], True, True),
    ],
)
def test_async_runs_evaluate_beside_the_rollout_with_their_requests_last(tmp_path, files, flags, beside, priorities):
    """Issue 69 item 3: --async and --fully-async evaluate beside the rollout, and their requests carry
    priorities (the evaluation's last) wherever the engines take them; without --eval-interval nothing."""
    from slime_mt.config import eval_beside_rollout, priority_scheduling

    rm = ["--custom-rm-path", "my_rm.py:rm"]  # ifbench's grader (this project has none)
    cfg = config(tmp_path, files, *rm, "--eval-interval", "1", *flags)
    assert (eval_beside_rollout(cfg), priority_scheduling(cfg)) == (beside, priorities)
    assert not eval_beside_rollout(config(tmp_path, files, *rm, *flags))


def test_an_evaluations_weight_version_is_read_from_its_samples():
    """``eval/weight_version``: the version every turn of the evaluation was generated with (a second
    version is named, not hidden); the steps trained where no turn recorded one."""
    from slime_mt.roles.evaluations import weight_versions

    def group(*versions):
        return [Sample(index=i, weight_versions=[v]) for i, v in enumerate(versions)]

    assert weight_versions([("a", [group("3", "3")]), ("b", [group("3")])], 3) == {"eval/weight_version": 3.0}
    assert weight_versions([("a", [group("2", "3")])], 3) == {
        "eval/weight_version": 2.0,
        "eval/weight_version_max": 3.0,
    }
    assert weight_versions([("a", [[Sample(index=0)]])], 4) == {"eval/weight_version": 4.0}


def test_a_vllm_policy_that_refuses_priorities_is_refused_for_an_evaluation_beside_the_rollout(tmp_path, files):
    """vLLM takes a priority only under --scheduling-policy priority: a launch told otherwise, whose
    evaluation beside the rollout would ask last, stops at parsing naming the setting."""
    flags = ["--custom-rm-path", "my_rm.py:rm", "--eval-interval", "1", "--fully-async", "--engine", "vllm"]
    flags += ["--weight-transport", "disk", "--vllm-extra-args", "--scheduling-policy fcfs"]
    with pytest.raises(ConfigError, match="eval.interval.*--scheduling-policy fcfs.*an evaluation beside the rollout"):
        config(tmp_path, files, *flags)
