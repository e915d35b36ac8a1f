"""Prefix-tree packing (``prefix_tree.build_tree``): a property test over random tries, the tree
attention layout (``attention.Tree``) against the dense ancestor mask, and a real model whose logits
on the tree row, gathered per path, equal its logits on each sequence alone."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_mt.backends.megatron.layouts import Tree, tree_attention
from slime_mt.backends.megatron.prefix_tree import build_tree

# sequences over a 3-token alphabet share prefixes often
SEQUENCES = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=6)


def ancestors(tree, node):
    chain = []
    while node >= 0:
        chain.append(node)
        node = tree.parents[node]
    return set(chain)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(SEQUENCES)
def test_every_path_spells_its_sequence_and_each_prefix_is_one_node(sequences):
    tree = build_tree(sequences)
    prefixes = {tuple(seq[: k + 1]) for seq in sequences for k in range(len(seq))}
    assert tree.num_nodes == len(prefixes) and tree.num_sequence_tokens == sum(map(len, sequences))
    for seq, path in zip(sequences, tree.paths):
        assert [tree.tokens[n] for n in path] == seq
        assert [tree.positions[n] for n in path] == list(range(len(seq)))
        assert [tree.parents[n] for n in path] == [-1] + path[:-1]
    assert all(parent < node for node, parent in enumerate(tree.parents))  # parents first: causal order
    mask = tree.mask()
    for node in range(tree.num_nodes):  # a node sees exactly its ancestors and itself
        assert set(torch.nonzero(~mask[node]).flatten().tolist()) == ancestors(tree, node)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(SEQUENCES, st.integers(0, 2**31 - 1))
def test_the_tree_layout_attends_exactly_like_the_dense_ancestor_mask(sequences, seed):
    """``Tree``'s subtree ends and branches describe the ancestor relation, and the branch-wise
    attention (the CPU path) gives the dense-mask attention's output and gradients."""
    tree = build_tree(sequences)
    layout = Tree(tuple(tree.parents))
    n, mask = tree.num_nodes, tree.mask()
    q_idx, k_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ends = torch.tensor(layout.ends)
    assert torch.equal((k_idx <= q_idx) & (q_idx < ends[None, :]), ~mask)  # flex_attention's mask_mod
    covered = [i for start, end, _ in layout.branches for i in range(start, end)]
    assert covered == list(range(n))
    for start, _, ranges in layout.branches:
        assert {i for a, e in ranges for i in range(a, e)} == ancestors(tree, start) - {start}
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = tree_attention(q, k, v, layout, 0.0, 0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=0.5)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-12)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_the_flex_block_mask_gives_the_dense_mask_attention(seed):
    """The block mask CUDA trains with (``Tree.block_mask``), run through flex_attention's eager
    forward on CPU (its backward exists on CUDA only) over trees of several 128-token blocks: the
    dense ancestor mask's attention."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 50, (150,), generator=g).tolist()
    sequences = [
        prompt[: int(torch.randint(20, 150, (1,), generator=g))]
        + torch.randint(0, 50, (int(torch.randint(40, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(5)
    ]
    tree = build_tree(sequences)
    layout = Tree(tuple(tree.parents))
    assert tree.num_nodes > 256  # several blocks, some skipped, some partial
    q, k, v = (torch.randn(1, 2, tree.num_nodes, 16, generator=g) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=layout.block_mask(torch.device("cpu")), scale=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~tree.mask(), scale=0.25)
    assert torch.allclose(out, ref, atol=1e-5)
    assert layout.block_mask(torch.device("cpu")) is layout.block_mask(torch.device("cpu"))  # built once


def test_keys_decide_sharing_and_positions_must_agree():
    pad = 7
    # the same pad ids holding different images must not share; equal images do
    tree = build_tree(
        [[1, pad, pad, 2], [1, pad, pad, 3], [1, pad, pad, 2]],
        keys=[
            [1, (pad, "a", 0), (pad, "a", 1), 2],
            [1, (pad, "b", 0), (pad, "b", 1), 3],
            [1, (pad, "a", 0), (pad, "a", 1), 2],
        ],
    )
    assert tree.num_nodes == 1 + 2 + 1 + 2 + 1
    assert tree.paths[0] == tree.paths[2] and tree.paths[0][1] != tree.paths[1][1]
    with pytest.raises(ValueError, match="positions must depend on the prefix only"):
        build_tree([[1, 2], [1, 2]], positions=[[0, 1], [0, 5]])
    with pytest.raises(ValueError, match="sequence 0: 2 tokens but 1 keys"):
        build_tree([[1, 2]], keys=[[1]])
    with pytest.raises(ValueError, match="no context"):
        build_tree([[1, 2]]).logit_nodes(0, 0, 2)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_a_model_on_the_tree_row_gives_each_sequence_its_own_logits(tiny_paths, kind):
    """A GRPO-like group (a shared prompt, different responses) and step-wise-like sequences (one
    extending another, one branching early): logits at each path's nodes == the sequence alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_paths[kind]), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, 20000, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(24)
    group = [prompt + ids(6) for _ in range(4)]
    steps = [prompt + ids(5)]
    steps += [steps[0] + ids(7), prompt[:9] + ids(4)]
    sequences = group + steps
    tree = build_tree(sequences)
    assert tree.num_nodes == 24 + 4 * 6 + 5 + 7 + 4 < tree.num_sequence_tokens
    additive = torch.zeros(tree.num_nodes, tree.num_nodes).masked_fill(tree.mask(), float("-inf"))
    with torch.no_grad():
        packed = model(
            input_ids=torch.tensor([tree.tokens]),
            attention_mask=additive[None, None],
            position_ids=torch.tensor([tree.positions]),
        ).logits[0]
        for s, seq in enumerate(sequences):
            alone = model(input_ids=torch.tensor([seq])).logits[0]
            assert float((packed[tree.paths[s]] - alone).abs().max()) < 1e-5, s
            # the logits that predict tokens 1..end are the path's nodes 0..end-1
            assert tree.logit_nodes(s, 1, len(seq)) == tree.paths[s][:-1]


def test_image_pads_are_keyed_by_the_images_content_and_offset():
    from slime_mt.backends.megatron.packing import tree_keys
    from slime_mt.types import TrainingSample

    pad = 151655
    red, blue = torch.zeros(4, 6), torch.ones(4, 6)  # one image: a 1x2x2 grid (4 patches), merged into 2 pads
    grid = torch.tensor([[1, 2, 2], [1, 2, 2]])

    def sample(prompt, pixels):
        return TrainingSample(
            prompt,
            [9],
            [1],
            [-1.0],
            0.0,
            "0/0",
            0,
            True,
            multimodal_train_inputs={"pixel_values": pixels, "image_grid_thw": grid},
        )

    keys = tree_keys(sample([1, pad, pad, 2, pad, pad], torch.cat([red, blue])), pad)
    same = tree_keys(sample([1, pad, pad, 2, pad, pad], torch.cat([red, red])), pad)
    assert keys[0] == 1 and keys[3] == 2 and keys[1][2] == 0 and keys[2][2] == 1
    assert keys[1][1] != keys[4][1] and same[1] == same[4] and same[2] == same[5]  # content decides
    assert tree_keys(sample([1, pad, pad, 2, pad, pad], torch.cat([red, blue])), None) == [1, pad, pad, 2, pad, pad, 9]
    with pytest.raises(ValueError, match="3 image pad tokens for 8 patches"):
        tree_keys(sample([1, pad, pad, pad], torch.cat([red, blue])), pad)
