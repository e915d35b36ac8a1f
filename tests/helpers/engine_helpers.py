"""Helpers for engine tests: run a coroutine, draw distinct images, encode them as data URIs, a client
on a loop of its own (what a weight transport needs of the rollout context), an embedded engine in a
process of its own."""

import asyncio
import base64
import contextlib
import io
import subprocess
import sys
import threading

from PIL import Image, ImageDraw
from train_helpers import REPO

from slime_mt.engine.clients import client_for
from slime_mt.engine.embedded.server import wait_healthy
from slime_mt.engine.launch import free_port


def run(coro):
    return asyncio.run(coro)


def diagram(seed: int, size=(96, 80)) -> Image.Image:
    """A small distinct image per seed (a triangle on a coloured background)."""
    image = Image.new("RGB", size, ((37 * seed) % 256, (91 * seed) % 256, (53 * seed) % 256))
    draw = ImageDraw.Draw(image)
    draw.polygon([(5, size[1] - 5), (size[0] - 5, size[1] - 5), (size[0] // 2, 5 + seed % 20)], outline=(255, 255, 255))
    return image


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def eager_to_stop_model(src, out, eos: int, runner_up: int | None = None):
    """A copy of the tiny (tied-embedding) Qwen2 model at ``src`` that wants to emit ``eos`` at every
    step, and ``runner_up`` second: attention and MLP outputs are zeroed, so the last hidden state is
    the normalised embedding of the current token; every token embeds near one direction u, ``eos``
    as 4u and ``runner_up`` as 3u, so their logits dominate whatever the context."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, H], tied with lm_head
        u = torch.ones(embed.shape[1]) / embed.shape[1] ** 0.5
        embed.copy_(u + 0.05 * torch.randn(embed.shape, generator=generator))
        embed[eos] = 4 * u
        if runner_up is not None:
            embed[runner_up] = 3 * u
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out, safe_serialization=True)
    return out


class LoopSide:
    """What a weight transport needs of the rollout context: a client and a loop in its own thread."""

    def __init__(self, url: str, engine: str = "local") -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = client_for(engine, url)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro):
        return self.submit(coro).result()

    def close(self) -> None:
        self.run_sync(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def engine_process(model_path, *flags: str):
    """An embedded engine in its own process (``slime-mt serve``: as on another node, nothing shared but
    the network) -> its URL; stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "slime_mt.cli", "serve", "--model-path", str(model_path), "--port", str(port)]
    proc = subprocess.Popen([*cmd, *flags], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
