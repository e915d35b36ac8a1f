"""What the evaluation tests share."""

# examples/eval_multi_task/multi_task.yaml of THUDM/slime at 624b824a, as it is there but for the paths
SLIME_MULTI_TASK = """eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: {aime}
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
    - name: gpqa    # hf download --repo-type dataset zyzshishui0627/gpqa_diamond --local-dir /root/gpqa
      path: {gpqa}
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
    - name: ifbench   # hf download --repo-type dataset zyzshishui0627/IFBench --local-dir /root/ifbench
      path: {ifbench}
      rm_type: ifbench
      n_samples_per_eval_prompt: 1
"""
