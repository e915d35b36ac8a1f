"""The embedded engine's model side: prefill one request, decode a batch, sample, update weights.

A running batch keeps one KV cache, left-padded to a common length: ``keys/values [B, H, L, D]``
per layer, ``attention_mask [B, L]`` (1 = real token), ``positions [B]`` (next rotary position;
for M-RoPE models the text position shared by the 3 axes, ``prompt_len + rope_delta``).
Log-probs are ``log_softmax(logits / T)`` of the sampled token, as SGLang reports them
(temperature applied, top-p/top-k/min-p not renormalised).

MoE models: every forward pass records the experts each MoE layer's router chose for every token it
processed (a hook on each router; ``slime_mt/routes.py``), and each sequence keeps its tokens' routes
(``Sequence.routes``), as SGLang's ``--enable-return-routed-experts`` keeps them with the KV cache.

FP8 checkpoints (block-wise e4m3, ``engine/weights/fp8.py``) are served dequantized: the folder loads
through this engine's dequantizer, the one every update takes, so a fresh load of a folder and an update
with the same tensors serve the same weights. An update must then send each quantized weight in FP8 with
its scale (a full-precision one is refused, as an FP8 tensor is by an engine serving full precision).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as transformers_logging

from slime_mt.engine.embedded.lora import ServedAdapters
from slime_mt.engine.protocol import SamplingParams, expand_image_pads
from slime_mt.engine.weights import fp8
from slime_mt.engine.weights.checkpoint import checkpoint_files
from slime_mt.errors import ProtocolError, WeightUpdateError
from slime_mt.processing import QwenVLProcessor, load_tokenizer_or_processor, tokenizer_of
from slime_mt.routes import RouteLayout


@dataclass
class Sequence:
    """A request being decoded: its prompt, outputs so far and sampling state."""

    rid: str
    prompt_ids: list[int]  # expanded (image pads per image)
    sampling: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # from prompt position input_logprob_start on
    input_logprob_start: int = 0
    # the input log-probs not yet computed: (final hidden states [T, H], their target ids [T]); the
    # scheduler projects them a chunk at a time between decode steps (``advance_input_logprobs``)
    pending_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    position: int = 0  # next rotary position
    cached_tokens: int = 0  # prompt tokens whose KV state came from the prefix cache
    epoch: int = 0  # the scheduler's weight updates when it was admitted
    lora: str | None = None  # the adapter it decodes with (``lora.py``; None: the base model)
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE: [n, moe_layers, top_k] per forward, in order

    def routed(self, layout: RouteLayout) -> torch.Tensor:
        """The routes ``[prompt + outputs - 1, moe_layers, top_k]`` of every processed token but the last
        of the sequence (MoE models), as SGLang answers them: a prefill that sampled nothing
        (``max_new_tokens`` 0) processed the last prompt token too, and its row is not returned."""
        rows = torch.cat(self.routes) if self.routes else layout.empty()
        return rows[: max(0, len(self.prompt_ids) + len(self.output_ids) - 1)]


# fp32 logits of a prefill's input log-probs alive at once (a chunk of positions: this many bytes)
LOGPROB_CHUNK_BYTES = 128 * 1024 * 1024


class ModelRunner:
    """Owns the HF model and its tokenizer/processor; all methods run on the scheduler thread."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.processor = load_tokenizer_or_processor(model_path)
        self.tokenizer = tokenizer_of(self.processor)
        self.is_vlm = isinstance(self.processor, QwenVLProcessor)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.fp8 = fp8.folder_format(self.model_path)  # None: full-precision weights
        self.model = self._load_model().eval()
        self.adapters = ServedAdapters(self.model)  # LoRA adapters by name (off until the engine enables them)
        self._released: list[tuple[torch.nn.Parameter, torch.Size]] | None = None  # while released
        self._unloaded: set[int] = set()  # parameters resumed and not yet loaded again (by id)
        if self.fp8 is not None:  # the FP8 tensors dequantized with their scales (``_load_model``)
            self.load_weights_from_disk(self.model_path)
        text_config = getattr(self.config, "text_config", self.config)
        self.vocab_size = int(text_config.vocab_size)
        self.context_length = int(getattr(text_config, "max_position_embeddings", 4096))
        self.eos_ids = self._eos_ids()
        self.image_token_id = self.processor.image_token_id if self.is_vlm else None
        self.route_layout = RouteLayout.of(self.config.to_dict())  # None: no experts
        self._captured: dict[int, torch.Tensor] = {}
        if self.route_layout is not None:
            self._hook_routers()
        # the final hidden states of a prefill that returns input log-probs (projected a chunk at a time)
        self._hidden: list[torch.Tensor] = []
        self.model.model.register_forward_hook(
            lambda mod, args, out: self._hidden.append(out[0]) if self._keep else None
        )
        self._keep = False
        self.logprob_chunk_rows = max(1, LOGPROB_CHUNK_BYTES // (4 * self.vocab_size))
        # the most characters one token stands for: a text longer than the context times this cannot fit
        self.max_token_chars = max(len(t) for t in self.tokenizer.convert_ids_to_tokens(range(len(self.tokenizer))))

    def _hook_routers(self) -> None:
        """A forward hook on each MoE layer's router records its top-k expert indices (its third
        output) for the tokens of the current forward pass, by MoE layer."""
        position = {layer: k for k, layer in enumerate(self.route_layout.moe_layers)}
        for name, module in self.model.named_modules():
            head, _, tail = name.rpartition(".layers.")
            index, _, rest = tail.partition(".")
            if head and rest == "mlp.gate" and index.isdigit() and int(index) in position:
                k = position[int(index)]
                module.register_forward_hook(lambda mod, args, out, k=k: self._captured.__setitem__(k, out[2]))

    def _take_routes(self, tokens: int) -> torch.Tensor | None:
        """The routes of the last forward pass's ``tokens`` tokens, ``[tokens, moe_layers, top_k]`` (None
        for a model without experts)."""
        layout = self.route_layout
        if layout is None:
            return None
        captured, self._captured = self._captured, {}
        if sorted(captured) != list(range(len(layout.moe_layers))):
            raise RuntimeError(f"routes captured for MoE layers {sorted(captured)} of {len(layout.moe_layers)}")
        routes = torch.stack([captured[k].reshape(tokens, layout.top_k) for k in range(len(layout.moe_layers))], 1)
        return routes.to(device="cpu", dtype=layout.dtype)

    def _load_model(self) -> torch.nn.Module:
        if self.is_vlm:
            from transformers import AutoModelForImageTextToText

            cls = AutoModelForImageTextToText
        else:
            cls = AutoModelForCausalLM
        if self.fp8 is None:
            return cls.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
        # built as a full-precision model: transformers casts the FP8 tensors without their scales (and
        # reports the scales as unexpected keys), and ``__init__`` loads the folder again through
        # ``fp8.BlockFp8``. transformers' own dequantizer takes the block size from the scale grid, which
        # is wrong or refused for a dimension of several blocks with a partial last one, and on a GPU it
        # keeps FP8 modules an update in full precision could not be copied into.
        config = copy.deepcopy(self.config)
        del config.quantization_config
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            model = cls.from_pretrained(self.model_path, config=config, dtype=self.dtype)
        finally:
            transformers_logging.set_verbosity(verbosity)
        return model.to(self.device)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ prompts

    def encode_prompt(self, input_ids: list[int] | None, text: str | None, images: list) -> tuple[list[int], dict]:
        """-> (expanded prompt ids, vision inputs) for one request; one pad per image expected."""
        if input_ids is None:
            input_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not self.is_vlm:
            if images:
                raise ProtocolError(f"image_data given but the served model {self.model_path} is text-only")
            return list(input_ids), {}
        pads = sum(1 for t in input_ids if t == self.image_token_id)
        if pads != len(images):
            raise ProtocolError(
                f"input_ids hold {pads} <|image_pad|> tokens but {len(images)} images were given "
                "(send ONE pad per image; the engine expands it)"
            )
        if not images:
            return list(input_ids), {}
        try:
            vision = self.processor.image_processor(images=images, return_tensors="pt")
        except Exception as e:  # e.g. an aspect ratio the processor refuses: the client's image
            raise ProtocolError(
                f"image_data: the image processor rejected the images: {type(e).__name__}: {e}"
            ) from None
        counts = self.processor.num_image_tokens(vision["image_grid_thw"])
        return expand_image_pads(list(input_ids), self.image_token_id, counts), dict(vision)

    # ------------------------------------------------------------------ forward passes

    @torch.no_grad()
    def prefill(
        self,
        seq: Sequence,
        vision: dict,
        input_logprob_start: int | None = None,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        past_routes: torch.Tensor | None = None,
    ) -> tuple[DynamicCache, torch.Tensor]:
        """Run the prompt alone -> (its KV cache [1, H, L, D] per layer, last logits [V] float32).
        Sets ``seq.position``; with ``input_logprob_start`` = s in [0, L), ``seq.input_logprobs`` for
        prompt tokens s..L-1 as SGLang returns them: None for token s, then log p(token i | < i), those
        computed later (``seq.pending_logprobs``, ``advance_input_logprobs``).
        ``past``: the KV state of the prompt's first m tokens (a text model's cached prefix, m <= s
        and m < L): only tokens m..L-1 are computed; ``past_routes`` their routes (MoE models), which
        ``seq.routes`` starts with."""
        ids = torch.tensor([seq.prompt_ids], device=self.device)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
        if past:
            reused = past[0][0].shape[-2]
            cache = DynamicCache()
            for layer, (keys, values) in enumerate(past):
                cache.update(keys, values, layer)  # concatenates: the cached tensors are never written
            kwargs.update(input_ids=ids[:, reused:], past_key_values=cache)
        if vision:
            kwargs["pixel_values"] = vision["pixel_values"].to(self.device, self.dtype)
            kwargs["image_grid_thw"] = vision["image_grid_thw"].to(self.device)
        if self.is_vlm:
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).long()
            self.model.model.rope_deltas = None
        length = len(seq.prompt_ids)
        kwargs["logits_to_keep"] = 1  # the last position's, to sample from
        self._captured, self._hidden, self._keep = {}, [], input_logprob_start is not None
        self.adapters.set_rows([seq.lora], self.device)
        try:
            out = self.model(**kwargs)
        finally:
            self._keep = False
        routes = self._take_routes(kwargs["input_ids"].shape[1])
        if routes is not None:
            seq.routes = ([] if past_routes is None else [past_routes]) + [routes]
        seq.position = length
        deltas = getattr(self.model.model, "rope_deltas", None) if self.is_vlm else None
        if deltas is not None:  # M-RoPE: image tokens advance the position less than one per token
            seq.position += int(deltas.reshape(-1)[0])
        if input_logprob_start is not None:
            computed = kwargs["input_ids"].shape[1]  # the prompt's last tokens (a cached prefix is not run)
            start = input_logprob_start
            rows = self._hidden[0][0, start - (length - computed) : computed - 1]  # [L - start - 1, H]
            seq.input_logprobs, seq.input_logprob_start = [None], start
            seq.pending_logprobs = (rows.detach().clone(), ids[0, start + 1 :]) if len(rows) else None
        self._hidden = []
        return out.past_key_values, out.logits[0, -1].float()

    @torch.no_grad()
    def advance_input_logprobs(self, seq: Sequence, chunks: int | None = 1) -> None:
        """``chunks`` more chunks of ``seq``'s pending input log-probs (all of them with None): log p(token
        i + 1 | tokens <= i) from the final hidden state at i through the output layer, in fp32, a chunk
        of positions at a time, so that ``[T, V]`` logits never exist at once."""
        head = self.model.get_output_embeddings()
        while seq.pending_logprobs is not None and (chunks is None or chunks > 0):
            hidden, targets = seq.pending_logprobs
            n = self.logprob_chunk_rows
            logits = head(hidden[:n]).float()  # [chunk, V]
            seq.input_logprobs += (logits.gather(-1, targets[:n, None])[:, 0] - torch.logsumexp(logits, -1)).tolist()
            seq.pending_logprobs = (hidden[n:], targets[n:]) if len(hidden) > n else None
            chunks = None if chunks is None else chunks - 1

    @torch.no_grad()
    def decode(self, batch: Batch) -> torch.Tensor:
        """One decode step for every sequence of the batch -> next-token logits [B, V] float32."""
        last = torch.tensor([[s.output_ids[-1]] for s in batch.seqs], device=self.device)  # [B, 1]
        mask = torch.cat([batch.attention_mask, torch.ones_like(last)], dim=1)  # [B, L+1]
        pos = torch.tensor([[s.position] for s in batch.seqs], device=self.device)  # [B, 1]
        position_ids = pos.unsqueeze(0).expand(3, -1, -1) if self.is_vlm else pos
        self._captured = {}
        self.adapters.set_rows([s.lora for s in batch.seqs], self.device)
        out = self.model(
            input_ids=last, attention_mask=mask, position_ids=position_ids, past_key_values=batch.cache, use_cache=True
        )
        routes = self._take_routes(len(batch.seqs))
        if routes is not None:
            for row, s in enumerate(batch.seqs):
                s.routes.append(routes[row : row + 1])
        batch.attention_mask = mask
        for s in batch.seqs:
            s.position += 1
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        blocked: list[list[int] | None] | None = None,
    ) -> tuple[list[int], list[float]]:
        """Sample one token per row of ``logits [B, V]`` -> (token ids, their log-probs). ``blocked[i]``:
        token ids row i may not produce (logit -inf before everything else, as SGLang's penalizers do,
        so the reported log-probs are under the masked distribution)."""
        vocab = logits.shape[-1]
        if blocked and any(blocked):
            logits = logits.clone()
            for i, ids in enumerate(blocked):
                ids = [t for t in ids or () if 0 <= t < vocab]
                if ids:
                    logits[i, torch.tensor(ids, device=logits.device)] = float("-inf")
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)  # [B]
        logprobs = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)  # [B, V]
        probs = logprobs.exp()  # [B, V]
        for i, p in enumerate(params):
            if not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0):
                probs[i] = _filtered_probs(probs[i], p)
        # Inverse-CDF draw, one uniform number per row (20x cheaper than torch.multinomial over a
        # 150k vocabulary); right=True never lands on a zero-mass token.
        cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [B, V]
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generators])  # [B]
        drawn = torch.searchsorted(cumulative, (u.to(logits.device) * cumulative[:, -1]).unsqueeze(1), right=True)[:, 0]
        drawn = drawn.clamp_max(vocab - 1)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn) if greedy.any() else drawn  # [B]
        chosen = logprobs.gather(1, tokens.unsqueeze(1))[:, 0]
        return tokens.tolist(), chosen.tolist()

    # ------------------------------------------------------------------ weights

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list(dict.fromkeys(self.model.parameters()))  # tied weights once

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on the device now."""
        tensors = self._parameters() + list(self.model.buffers())
        return sum(t.nbytes for t in tensors)

    @property
    def weights_released(self) -> bool:
        return self._released is not None

    @property
    def weights_unloaded(self) -> int:
        """Parameters resumed since a release and not loaded again (their content is undefined)."""
        return len(self._unloaded)

    def release_weights(self) -> None:
        """Free every parameter's storage on the device (SGLang's ``release_memory_occupation`` of the
        ``weights`` tag without a CPU backup: the content is gone until an update loads it again).
        Buffers the checkpoint does not carry (rotary frequencies) stay."""
        if self._released is not None:
            return
        self._released = [(p, p.shape) for p in self._parameters()]
        for param, _ in self._released:
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_weights(self) -> None:
        """Allocate the parameters again, content undefined until an update loads every one of them."""
        if self._released is None:
            return
        for param, shape in self._released:
            param.data = torch.empty(shape, dtype=param.dtype, device=self.device)
        self._unloaded = {id(param) for param, _ in self._released}
        self._released = None

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor]) -> int:
        """Copy HF-named tensors into the model, all or nothing -> number of tensors updated. Every
        name, shape and dtype is checked and every tensor converted (staged) before the first copy,
        so a WeightUpdateError leaves the served weights exactly as they were."""
        if self._released is not None:
            raise WeightUpdateError(
                "the weights are released (release_memory_occupation); resume them "
                "(resume_memory_occupation with tag weights) before an update"
            )
        named = self._full_precision(named)
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        aliases = _hf_name_aliases(params)
        staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for name, tensor in named.items():  # every one a tensor (``_full_precision``)
            base, target, tensor = _target(params, aliases, name, tensor)
            if target is None:
                raise WeightUpdateError(f"weight '{name}' is not a parameter of {type(self.model).__name__}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightUpdateError(
                    f"weight '{name}': shape {tuple(tensor.shape)} != model's {tuple(target.shape)}"
                )
            if tensor.is_floating_point() != target.is_floating_point():
                raise WeightUpdateError(
                    f"weight '{name}': dtype {tensor.dtype} cannot replace the model's {target.dtype}"
                )
            staged.append((base, target, tensor.to(dtype=target.dtype)))
        for base, target, tensor in staged:  # same shape and dtype: a plain copy that cannot fail half-way
            target.copy_(tensor)
            self._unloaded.discard(id(base))
        return len(staged)

    def _full_precision(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An update's tensors in the served precision: FP8 weights dequantized with their scales when
        this engine serves an FP8 checkpoint; a value that is not a tensor, or a tensor in the other
        precision, is a WeightUpdateError."""
        for name, tensor in named.items():
            if not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"weight '{name}' is a {type(tensor).__name__}, not a tensor")
            if self.fp8 is None and tensor.dtype == fp8.FP8_DTYPE:
                raise WeightUpdateError(
                    f"weight '{name}' is float8_e4m3fn, but this engine serves full-precision weights "
                    "(its checkpoint has no FP8 quantization_config)"
                )
            if self.fp8 is not None and tensor.dtype != fp8.FP8_DTYPE and fp8.quantized(name, tensor):
                raise WeightUpdateError(
                    f"weight '{name}' is {str(tensor.dtype).removeprefix('torch.')}, but this engine serves FP8 "
                    f"weights ({self.fp8.block[0]} x {self.fp8.block[1]} blocks): send it in float8_e4m3fn with "
                    f"'{fp8.scale_name(name)}' (--rollout-quantization fp8)"
                )
        return named if self.fp8 is None else fp8.dequantize_named(named, self.fp8, self.dtype)

    def load_weights_from_disk(self, model_path: str) -> int:
        """Load every ``*.safetensors`` file of an HF folder into the model, all or nothing. A missing
        folder, a bad index or an unreadable file is a WeightUpdateError naming it."""
        files = checkpoint_files(model_path)
        named: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                tensors = load_file(str(f))
            except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
                raise WeightUpdateError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
            named.update(tensors)
        if not named:
            raise WeightUpdateError(f"the safetensors files in {model_path} hold no tensors")
        try:
            return self.load_weights(named)
        except WeightUpdateError as e:
            raise WeightUpdateError(f"{model_path}: {e}") from None


@dataclass
class Batch:
    """Sequences decoded together and their shared left-padded KV cache."""

    seqs: list[Sequence] = field(default_factory=list)
    cache: DynamicCache | None = None
    attention_mask: torch.Tensor | None = None  # [B, L]

    def add(self, seq: Sequence, cache: DynamicCache) -> None:
        """Append a prefilled sequence, left-padding whichever side is shorter. Every new tensor is
        built before the batch changes, so a failure leaves the batch as it was."""
        length = cache.layers[0].keys.shape[-2]
        mask = torch.ones(1, length, dtype=torch.long, device=cache.layers[0].keys.device)
        if self.cache is None:
            self.seqs, self.cache, self.attention_mask = [seq], cache, mask
            return
        total = max(length, self.attention_mask.shape[1])
        merged = [
            (
                torch.cat([_left_pad(mine.keys, total), _left_pad(new.keys, total)], dim=0),
                torch.cat([_left_pad(mine.values, total), _left_pad(new.values, total)], dim=0),
            )
            for mine, new in zip(self.cache.layers, cache.layers)
        ]
        attention_mask = torch.cat([_left_pad(self.attention_mask, total, dim=1), _left_pad(mask, total, dim=1)], dim=0)
        for layer, (keys, values) in zip(self.cache.layers, merged):
            layer.keys, layer.values = keys, values
        self.attention_mask = attention_mask
        self.seqs.append(seq)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` and drop KV columns that are padding for every remaining row."""
        if not rows:
            self.seqs, self.cache, self.attention_mask = [], None, None
            return
        index = torch.tensor(rows, device=self.attention_mask.device)
        mask = self.attention_mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[..., first:, :]
            layer.values = layer.values.index_select(0, index)[..., first:, :]
        self.attention_mask = mask[:, first:]
        self.seqs = [self.seqs[i] for i in rows]


def _left_pad(t: torch.Tensor, total: int, dim: int = -2) -> torch.Tensor:
    missing = total - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def _filtered_probs(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply top-k, top-p and min-p to ``probs [V]`` (unnormalised result is fine for sampling)."""
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        drop = (cumulative - sorted_probs) > p.top_p * cumulative[-1]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


_EXPERT = re.compile(r"^(?P<experts>.*\.mlp\.experts\.)(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _target(
    params: dict[str, torch.Tensor], aliases: dict[str, str], name: str, tensor: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(the model's tensor, the part of it ``name`` writes, the tensor to write) for a checkpoint
    name; (None, None, tensor) when the model has no such weight. transformers keeps MoE experts
    fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): a per-expert
    checkpoint tensor writes its expert's rows of them, and the published fused layout (``[E, H, 2I]``,
    ``[E, I, H]``, Qwen3-VL-MoE's) is transposed into them."""

    def lookup(key: str) -> torch.Tensor | None:
        return params.get(key) if key in params else params.get(aliases.get(key, ""))

    found = lookup(name)
    if found is not None:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and tensor.dim() == 3:
            if tensor.shape != found.shape and tensor.transpose(1, 2).shape == found.shape:
                return found, found, tensor.transpose(1, 2)
        return found, found, tensor
    expert = _EXPERT.match(name)
    if expert is None:
        return None, None, tensor
    proj, index = expert["proj"], int(expert["index"])
    fused = lookup(expert["experts"] + ("down_proj" if proj == "down_proj" else "gate_up_proj"))
    if fused is None or fused.dim() != 3 or index >= fused.shape[0]:
        return None, None, tensor
    if proj == "down_proj":
        return fused, fused[index], tensor
    inter = fused.shape[1] // 2
    return fused, fused[index, :inter] if proj == "gate_proj" else fused[index, inter:], tensor


def _hf_name_aliases(params: dict[str, torch.Tensor]) -> dict[str, str]:
    """Checkpoint names -> module names where transformers renamed them (VLM ``model.`` prefixes)."""
    aliases = {}
    for name in params:
        if name.startswith("model.language_model."):
            aliases["model." + name[len("model.language_model.") :]] = name
        if name.startswith("model.visual."):
            aliases["visual." + name[len("model.visual.") :]] = name
    return aliases
