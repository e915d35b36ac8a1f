"""The embedded engine serves MoE models and takes their weights in the checkpoint layouts the trainer
exports (integration tier, ~8 s: one engine per family over HTTP, transformers as the reference).
transformers holds experts fused; Qwen3-MoE checkpoints name each expert's tensors, Qwen3-VL-MoE's
publish a transposed fused pair. An update in either layout serves exactly what transformers serves
from the same folder, and a refused update changes nothing."""

import shutil

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.safetensors_files import load_hf_state

PROMPT = [9707, 1879, 11, 1128, 525, 498, 30]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _generate(url: str) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


def _reference_logprobs(folder, kind: str, tokens: list[int]) -> list[float]:
    cls = AutoModelForImageTextToText if "vl" in kind else AutoModelForCausalLM
    model = cls.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + k, t]) for k, t in enumerate(tokens)]


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-vl-moe"])
def test_an_moe_update_in_the_checkpoint_layout_serves_what_transformers_serves(tiny_paths, tmp_path, kind):
    source = tiny_paths[kind]
    state = load_hf_state(source)
    assert any(".experts.7.down_proj." in n for n in state) or any(n.endswith("experts.gate_up_proj") for n in state)
    folder = tmp_path / "perturbed"
    shutil.copytree(source, folder)
    g = torch.Generator().manual_seed(5)
    perturbed = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if ".mlp." in k else v for k, v in state.items()
    }  # every expert, router and dense MLP moves
    save_file(perturbed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with LocalEngine(source) as engine:
        before = _generate(engine.url)
        prefix = "model.language_model." if "vl" in kind else "model."
        bad = tmp_path / "bad"  # expert 99 of 8
        bad.mkdir()
        save_file(
            {f"{prefix}layers.0.mlp.experts.99.gate_proj.weight": torch.zeros(48, 64)}, str(bad / "model.safetensors")
        )
        refused = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60)
        assert refused.status_code == 400 and "is not a parameter" in refused.json()["error"]["message"]
        assert _generate(engine.url) == before  # nothing changed
        ok = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": str(folder)}, timeout=60)
        assert ok.status_code == 200, ok.text
        tokens, logprobs = _generate(engine.url)
    assert (tokens, logprobs) != before
    reference = _reference_logprobs(folder, kind, tokens)
    assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-4, (logprobs, reference)
