"""The model families: Megatron-core decoders built from a Hugging Face checkpoint folder's config.

Text families: Llama (SmolLM2), Qwen2/Qwen2.5 (qkv bias), Qwen3 (q/k RMSNorm), Qwen3-MoE ->
``GPTModel`` with the local layer spec on CPU (the Transformer Engine spec when ``transformer_engine``
imports and CUDA is present), RMSNorm, SwiGLU, and rotary embeddings from the checkpoint's rope
configuration (``rope.py``: default, linear, llama3, yarn; the others are refused at start-up). VLMs
wrap such a decoder (``vlm.py``), Qwen3-VL-MoE included.

Mixture-of-experts (``MoeSpec``, from the HF keys ``num_experts``, ``num_experts_per_tok``,
``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``, ``moe_intermediate_size``): the
sparse layers get Megatron's ``MoELayer`` (a top-k softmax router computed in fp32, its experts
sequential on CPU and grouped GEMMs with Transformer Engine), the others a dense MLP. Qwen's router
takes the softmax over every expert, then the top k, renormalised when ``norm_topk_prob``: the same
as Megatron's softmax over the top-k logits (``moe_router_pre_softmax=False``); without
renormalisation Megatron's pre-softmax. How experts are placed and routed is ``MoeOptions``
(``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``, ``--moe-token-dispatcher-type``,
the load-balancing loss); routing replay is the MoE layer's own (``moe.py``).

Device and dtype policy: parameters are created on ``parallel.current_device()`` in ``dtype``
(bf16 with ``--bf16``); nothing else differs between CPU and GPU.

``TextPolicy`` runs the decoder to its final hidden states and leaves the vocabulary projection to
the caller (``output_weight``), so log-probs can be computed one chunk of rows at a time
(``logprobs.py``) instead of materialising ``[L, V/tp]`` logits.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments
from slime_mt.backends.megatron.moe import shard_moe_layers
from slime_mt.backends.megatron.parallel import PipelineSplit, Stage, current_device
from slime_mt.backends.megatron.recompute import Recompute
from slime_mt.backends.megatron.rope import PositionRotary, rope_frequencies
from slime_mt.backends.megatron.sequence_parallel import (
    SequenceParallelNorm,
    gather_sequence,
    scatter_sequence,
    use_sequence_parallel_norms,
)
from slime_mt.errors import ModelConfigError, RopeConfigError
from slime_mt.routes import sparse_layers

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

TEXT_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3-moe"}
VLM_FAMILIES = {"qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl", "qwen3_vl_moe": "qwen3-vl-moe"}
QK_NORM_TYPES = ("qwen3", "qwen3_vl", "qwen3_moe", "qwen3_vl_moe")
MOE_TYPES = ("qwen3_moe", "qwen3_vl_moe")


@dataclass
class MoeSpec:
    """The experts of a mixture-of-experts decoder, as its HF config states them."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # each expert's intermediate size
    sparse_layers: list[bool]  # per decoder layer: an MoE layer (else a dense MLP)
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1

    @property
    def layer_pattern(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` as a list: 1 for an MoE layer, 0 for a dense one."""
        return [int(sparse) for sparse in self.sparse_layers]


@dataclass(frozen=True)
class MoeOptions:
    """How an MoE decoder is placed and trained (Megatron's names; ``TrainConfig`` carries the flags)."""

    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None  # None: the tensor-parallel size, as Megatron defaults it
    dispatcher: str = "alltoall"
    aux_loss_coef: float = 0.0
    load_balancing: str = "aux_loss"

    def expert_tp(self, tp: int) -> int:
        return tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @classmethod
    def of(cls, train) -> MoeOptions:
        """The options a ``TrainConfig`` sets."""
        return cls(
            expert_parallel=train.expert_model_parallel_size,
            expert_tensor_parallel=train.expert_tensor_parallel_size,
            dispatcher=train.moe_token_dispatcher_type,
            aux_loss_coef=train.moe_aux_loss_coef,
            load_balancing=train.moe_router_load_balancing_type,
        )


@dataclass
class DecoderSpec:
    """What the Megatron decoder needs from an HF config (text part of a VLM included)."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_positions: int
    inv_freq: torch.Tensor  # [head_dim / 2] rotary inverse frequencies (scaling applied)
    attention_factor: float = 1.0  # YaRN: cos/sin scale, i.e. attention logits x factor**2
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False
    moe: MoeSpec | None = None
    pad_token_id: int | None = None  # transformers' padding_idx: its embedding row gets no gradient from lookups


def read_hf_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelConfigError(
            f"model folder {path} has no config.json (--hf-checkpoint must be a Hugging Face model folder)"
        )
    return json.loads(file.read_text())


def _rope(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def moe_spec(text: dict, text_type: str, where: str) -> MoeSpec | None:
    """The experts of a Qwen3-MoE / Qwen3-VL-MoE text config (None for dense families). A layer is
    sparse when it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, as
    transformers builds it; Qwen3-VL-MoE always renormalises its top-k probabilities."""
    if text_type.removesuffix("_text") not in MOE_TYPES:
        return None
    experts = text.get("num_experts") or text.get("num_local_experts")
    topk = text.get("num_experts_per_tok")
    if not experts or not topk:
        raise ModelConfigError(f"{where}: a {text_type} config needs num_experts and num_experts_per_tok")
    if topk > experts:
        raise ModelConfigError(f"{where}: num_experts_per_tok {topk} exceeds num_experts {experts}")
    if text.get("shared_expert_intermediate_size"):
        raise ModelConfigError(f"{where}: shared experts are not supported for {text_type}")
    return MoeSpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=text["moe_intermediate_size"],
        sparse_layers=sparse_layers(text),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)) if text_type == "qwen3_moe" else True,
    )


def decoder_spec(config: dict, where: str = "config.json") -> DecoderSpec:
    model_type = config.get("model_type")
    text = config.get("text_config", config) if model_type in VLM_FAMILIES else config
    family = VLM_FAMILIES.get(model_type) or TEXT_FAMILIES.get(model_type)
    if family is None:
        supported = sorted(TEXT_FAMILIES) + sorted(VLM_FAMILIES)
        raise ModelConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {supported}")
    heads = text["num_attention_heads"]
    rope = _rope(text)
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text_type = text.get("model_type", model_type)
    try:
        inv_freq, attention_factor = rope_frequencies(text, text_type, where)
    except RopeConfigError as e:
        raise ModelConfigError(str(e)) from None
    if rope.get("mrope_section") and attention_factor != 1.0:
        raise ModelConfigError(f"{where}: a rope attention factor with M-RoPE is not supported")
    return DecoderSpec(
        family=family,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
        qkv_bias=model_type in ("qwen2", "qwen2_5_vl") or bool(text.get("attention_bias", False)),
        qk_norm=model_type in QK_NORM_TYPES,
        tie_embeddings=bool(tie),
        max_positions=text.get("max_position_embeddings", 4096),
        inv_freq=inv_freq,
        attention_factor=attention_factor,
        mrope_section=rope.get("mrope_section"),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        moe=moe_spec(text, text_type, where),
        pad_token_id=text.get("pad_token_id"),
    )


def have_transformer_engine() -> bool:
    """The Transformer Engine layer spec is used when TE imports and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_tp(spec: DecoderSpec, tp: int, moe: MoeOptions | None = None) -> None:
    if spec.num_heads % tp or spec.num_kv_heads % tp:
        raise ModelConfigError(
            f"--tensor-model-parallel-size {tp} must divide the {spec.num_heads} attention heads "
            f"and {spec.num_kv_heads} key/value heads of this {spec.family} model"
        )
    moe = moe or MoeOptions()
    etp = moe.expert_tp(tp)
    if spec.moe is None:
        if moe.expert_parallel > 1:
            raise ModelConfigError(
                f"--expert-model-parallel-size {moe.expert_parallel}: this {spec.family} model has no experts"
            )
        return
    if spec.moe.num_experts % moe.expert_parallel:
        raise ModelConfigError(
            f"--expert-model-parallel-size {moe.expert_parallel} must divide the {spec.moe.num_experts} "
            f"experts of this {spec.family} model"
        )
    if etp < 1 or spec.moe.ffn_hidden_size % etp:
        raise ModelConfigError(
            f"--expert-tensor-parallel-size {etp} must be at least 1 and divide the experts' intermediate "
            f"size {spec.moe.ffn_hidden_size}"
        )


def transformer_config(
    spec: DecoderSpec,
    tp: int,
    dtype: torch.dtype = torch.float32,
    moe: MoeOptions | None = None,
    te: bool = False,
    recompute: Recompute | None = None,
    sequence_parallel: bool = False,
    pp: int | PipelineSplit = 1,
):
    """Megatron TransformerConfig for the decoder; fusions off on CPU (they need CUDA kernels);
    ``sequence_parallel`` under TP > 1 only (``sequence_parallel.py``); ``pp`` pipeline stages (a count:
    split evenly), whose packed rows differ in length from one micro-batch to the next (their shapes
    travel with them)."""
    from megatron.core.transformer import TransformerConfig

    check_tp(spec, tp, moe)
    split = pp if isinstance(pp, PipelineSplit) else PipelineSplit(pp)
    split.layer_counts(spec.num_layers)  # Megatron builds a missing or a doubled layer without a word
    pp = split.size
    gpu = torch.cuda.is_available()
    experts = _expert_kwargs(spec, tp, moe or MoeOptions(), te, pp)
    # rope's attention factor scales q and k, so the logits by its square (YaRN's mscale)
    softmax_scale = spec.attention_factor**2 / spec.head_dim**0.5 if spec.attention_factor != 1.0 else None
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        **split.config_kwargs(),
        pipeline_dtype=dtype if pp > 1 else None,
        variable_seq_lengths=pp > 1,
        sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=not gpu,
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        softmax_scale=softmax_scale,
        mrope_section=list(spec.mrope_section) if spec.mrope_section else [spec.head_dim // 2],
        **experts,
        **(recompute or Recompute()).config_kwargs(),
    )


def _expert_kwargs(spec: DecoderSpec, tp: int, moe: MoeOptions, te: bool, pp: int) -> dict:
    """TransformerConfig's mixture-of-experts fields for ``spec`` (a dense decoder's token dispatcher
    under pipeline parallelism: Megatron refuses its default, allgather, with variable row lengths)."""
    if spec.moe is None:
        return dict(moe_token_dispatcher_type="alltoall") if pp > 1 else {}
    return dict(
        num_moe_experts=spec.moe.num_experts,
        moe_router_topk=spec.moe.topk,
        moe_ffn_hidden_size=spec.moe.ffn_hidden_size,
        moe_layer_freq=spec.moe.layer_pattern,
        moe_router_pre_softmax=not spec.moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=moe.dispatcher,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_grouped_gemm=te,  # Transformer Engine's grouped GEMM on GPU; sequential experts otherwise
        moe_permute_fusion=False,
        expert_model_parallel_size=moe.expert_parallel,
        expert_tensor_parallel_size=moe.expert_tp(tp),
    )


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows padded to a multiple of the TP size (padded logits are masked out)."""
    return -(-vocab_size // tp) * tp


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set Megatron's ``tensor_model_parallel``/``partition_dim`` attributes on the sharded weights.

    Megatron sets them while initialising weights; models built without initialisation (weights
    come from the checkpoint) lack them, and the grad norm then counts each shard as a replicated
    parameter of TP rank 0 only. Column-parallel weights and biases split dim 0, row-parallel
    weights dim 1, the vocabulary embedding dim 0; norms stay replicated."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    column, row = [ColumnParallelLinear], [RowParallelLinear]
    if have_transformer_engine():
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        column += [TEColumnParallelLinear, TELayerNormColumnParallelLinear]
        row.append(TERowParallelLinear)
    for module in model.modules():
        if isinstance(module, (VocabParallelEmbedding, *column)):
            sharded = [(module.weight, 0)] + ([(module.bias, 0)] if getattr(module, "bias", None) is not None else [])
        elif isinstance(module, tuple(row)):
            sharded = [(module.weight, 1)]
        else:
            continue
        for param, dim in sharded:
            if isinstance(param, torch.nn.Parameter) and not getattr(param, "tensor_model_parallel", False):
                for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    if hasattr(param, attribute):
                        delattr(param, attribute)
                set_tensor_model_parallel_attributes(param, True, dim, 1)


ATTENTION = ("fused", "megatron")


def layer_spec(spec: DecoderSpec, te: bool, attention: str = "fused", config=None):
    """Transformer Engine's layer spec, else Megatron's local one with ``attention``: ``fused``
    (``attention.FusedCoreAttention``, PyTorch's fused kernels, no ``[L, L]`` scores) or ``megatron``
    (its ``DotProductAttention``, which materialises them; kept as the reference). An MoE decoder gets
    Megatron's block spec (``config``'s layer pattern: MoE and dense layers). Under sequence
    parallelism the local spec's norms are ``SequenceParallelNorm`` (a block spec: the final one too)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: use one of {ATTENTION}")
    if spec.moe is not None:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
        layers = block.layer_specs
        shard_moe_layers(layers, config)
    elif te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        block = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
        layers = [block]
    if attention == "fused" and not te:
        from slime_mt.backends.megatron.attention import FusedCoreAttention

        for layer in layers:  # the block's layers may share one spec object
            layer.submodules.self_attention.submodules.core_attention = FusedCoreAttention
    if config is not None and config.sequence_parallel and not te:
        use_sequence_parallel_norms(layers)
        if isinstance(block, TransformerBlockSubmodules):
            block.layer_norm = SequenceParallelNorm
        else:
            layers = get_num_layers_to_build(config)  # this pipeline stage's (all of them without PP)
            block = TransformerBlockSubmodules(layer_specs=[block] * layers, layer_norm=SequenceParallelNorm)
    return block


def build_gpt(
    spec: DecoderSpec,
    tp: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    te: bool | None = None,
    attention: str = "fused",
    moe: MoeOptions | None = None,
    recompute: Recompute | None = None,
    sequence_parallel: bool = False,
    pp: int | PipelineSplit = 1,
):
    """The Megatron decoder (``GPTModel``) for ``spec`` on this rank, parameters in ``dtype`` on
    ``device``, rotary from explicit positions (``rope.PositionRotary``), TP attributes set;
    ``attention``: the core attention without Transformer Engine (``layer_spec``); ``moe``: how an MoE
    decoder's experts are placed and routed; ``recompute``: which activations the backward recomputes;
    ``sequence_parallel``: the decoder runs on this TP rank's slice of the row (``TextPolicy.hidden``
    splits it after the embedding and gathers the final hidden states: the embedding and the output
    layer see whole rows); ``pp``: this rank's pipeline stage of it (its layers by Megatron's split, even
    or a ``PipelineSplit``'s, the embedding on the first stage, the final norm and the output layer on
    the last: ``stage_of``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    device = device or current_device()
    te = have_transformer_engine() if te is None else te
    config = transformer_config(spec, tp, dtype, moe, te, recompute, sequence_parallel, pp)
    first = config.pipeline_model_parallel_size == 1 or parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = config.pipeline_model_parallel_size == 1 or parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    with torch.device(device):
        model = GPTModel(
            config,
            layer_spec(spec, te, attention, config),
            vocab_size=padded_vocab(spec.vocab_size, tp),
            max_sequence_length=spec.max_positions,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="mrope",
            scatter_embedding_sequence_parallel=False,
        )
    if last:
        model.output_layer.sequence_parallel = False  # it is given gathered rows
    model.rotary_pos_emb = PositionRotary(spec.inv_freq, spec.mrope_section, spec.mrope_interleaved, device=device)
    model.to(device=device)
    # The local spec builds its norms in fp32 whatever params_dtype says (megatron casts whole models
    # with Float16Module); cast parameters only, so the rotary frequencies stay fp32 as in transformers.
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    mark_tensor_parallel(model)
    return model


def stage_of(gpt) -> Stage:
    """The part of the decoder ``gpt`` (``build_gpt``) holds: its layers' global indices (Megatron's
    1-based ``layer_number``, offset by the stages before it), and whether it embeds and projects."""
    numbers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    layers = range(numbers[0], numbers[-1] + 1) if numbers else range(0)
    if list(layers) != numbers:
        raise ModelConfigError(f"a pipeline stage holds layers {numbers}: not one run of layers")
    return Stage(layers, first=gpt.pre_process, last=gpt.post_process)


class TextPolicy(torch.nn.Module):
    """A decoder run to its final (normed) hidden states; ``output_logits`` projects rows to this
    rank's vocabulary slice. Under pipeline parallelism a stage's ``hidden`` runs its own layers: the
    first embeds the row, the others start from the previous stage's output (``set_input_tensor``),
    and only the last stage's output is normed and projected."""

    def __init__(self, gpt, pad_token_id: int | None = None):
        super().__init__()
        self.gpt = gpt
        self.pad_token_id = pad_token_id
        self.input_tensor: torch.Tensor | None = None

    @property
    def config(self):
        return self.gpt.config

    @property
    def model_type(self):  # what Megatron's schedules ask of the model they run
        return self.gpt.model_type

    @property
    def module(self):
        """The decoder, where Megatron's helpers (``get_attr_wrapped_model``: the schedules, the tied
        embedding's gradient sum in ``finalize_model_grads``) look for what this wrapper lacks."""
        return self.gpt

    def set_input_tensor(self, tensor) -> None:
        """The previous pipeline stage's output for the next ``hidden`` (Megatron's schedules pass a
        list of one)."""
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def hidden(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        packed_seq_params=None,
        decoder_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens [1, L]``, ``position_ids [1, L]`` (``[3, 1, L]`` M-RoPE) -> hidden ``[L, 1, H]``; under
        context parallelism (a ``ContextParallelSegments`` layout) the row is embedded whole and this
        rank's tokens go through the decoder -> ``[L / cp, 1, H]`` in the layout's order. Under sequence
        parallelism the decoder runs on this TP rank's slice of those tokens, gathered back after it."""
        if decoder_input is None and self.gpt.pre_process:
            decoder_input = self.embed(tokens)  # [L, 1, H]
        if isinstance(attention_mask, ContextParallelSegments):
            if decoder_input is not None:
                decoder_input = decoder_input.index_select(0, attention_mask.query_position)
            position_ids = position_ids.index_select(-1, attention_mask.query_position)
        rotary = self.gpt.rotary_pos_emb(position_ids)  # the whole (CP-local) row's: attention sees it whole
        sequence_parallel = self.config.sequence_parallel
        if not self.gpt.pre_process:  # a later pipeline stage: the decoder reads its input tensor
            self.gpt.decoder.set_input_tensor(
                scatter_sequence(self.input_tensor) if sequence_parallel else self.input_tensor
            )
            decoder_input = None
        elif sequence_parallel:
            decoder_input = scatter_sequence(decoder_input)
        hidden = self.gpt.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary,
            packed_seq_params=packed_seq_params,
        )
        return gather_sequence(hidden) if sequence_parallel else hidden

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [1, L]`` -> their embeddings ``[L, 1, H]``; where a token is the config's
        ``pad_token_id``, as transformers' ``nn.Embedding(padding_idx=...)``: its value, no gradient to its
        row (a tied output layer's gradient to it is the projection's, as in transformers)."""
        embeds = self.gpt.embedding(input_ids=tokens, position_ids=None)
        if self.pad_token_id is None:
            return embeds
        looked_up = (tokens != self.pad_token_id).transpose(0, 1)[..., None]  # [L, 1, 1]
        return torch.where(looked_up, embeds, embeds.detach())

    def output_weight(self) -> torch.Tensor:
        """This rank's output projection ``[V/tp, H]`` (the embedding when they are tied); the
        training log-prob path (``logprobs.hidden_logprobs``) projects with it directly."""
        if self.gpt.output_layer.bias is not None:
            raise ModelConfigError("an output layer with a bias is not supported")
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [C, H]`` -> this rank's logits ``[C, V/tp]`` (in the parameters' dtype), through
        Megatron's output layer (parity checks)."""
        weight = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(hidden.unsqueeze(1), weight=weight)
        return logits[:, 0]

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None):
        """Full logits ``[1, L, V/tp]`` (parity checks; training uses ``hidden`` + chunked projection)."""
        hidden = self.hidden(tokens, position_ids, attention_mask, packed_seq_params)
        return self.output_logits(hidden[:, 0])[None]

    def decoder_state_dict(self) -> dict[str, torch.Tensor]:
        return self.gpt.state_dict()
