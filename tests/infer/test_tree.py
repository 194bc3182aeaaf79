"""Tree construction equals a brute-force trie; pruning keeps the most valuable nodes."""

import torch
from reference.tree import build_tree, prune_paths


def brute_force_tree(paths):
    """Reference: a Python trie over one row's paths; nodes numbered in (path, depth) order."""
    nodes = {(): 0}
    order = [()]
    for path in paths:
        prefix = ()
        for t in path:
            if t < 0:
                break
            prefix = prefix + (t,)
            if prefix not in nodes:
                nodes[prefix] = len(order)
                order.append(prefix)
    return nodes, order


def random_paths(gen, B=3, P=7, L=5, vocab=3):
    paths = torch.randint(0, vocab, (B, P, L), generator=gen)
    cut = torch.randint(0, L + 1, (B, P), generator=gen)  # path lengths 0..L
    return torch.where(torch.arange(L)[None, None] < cut[:, :, None], paths, -1)


def test_build_tree_matches_brute_force_on_random_paths():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        paths = random_paths(gen)
        tree = build_tree(paths)
        for b in range(paths.shape[0]):
            nodes, order = brute_force_tree(paths[b].tolist())
            n = len(order)
            assert int(tree.num_nodes[b]) == n
            assert tree.valid[b].sum() == n
            for idx, prefix in enumerate(order[1:], start=1):
                assert int(tree.tokens[b, idx]) == prefix[-1]
                assert int(tree.depth[b, idx]) == len(prefix)
                assert int(tree.parent[b, idx]) == nodes[prefix[:-1]]
                # ancestors: exactly the node's prefixes (root included)
                expect = {nodes[prefix[:i]] for i in range(len(prefix) + 1)}
                got = set(torch.nonzero(tree.anc[b, idx]).flatten().tolist())
                assert got == expect
            for p, path in enumerate(paths[b].tolist()):
                for d, t in enumerate(path):
                    want = nodes[tuple(path[: d + 1])] if t >= 0 else -1
                    assert int(tree.path_node[b, p, d]) == want
            assert int(tree.num_entries[b]) == int((paths[b] >= 0).sum())


def test_tokens_after_a_pad_are_ignored():
    paths = torch.tensor([[[4, -1, 5], [4, 6, -1]]])
    tree = build_tree(paths)
    assert tree.tokens[0, :3].tolist() == [-1, 4, 6]
    assert int(tree.num_nodes[0]) == 3


def test_prune_keeps_top_values_and_stays_prefix_closed():
    paths = torch.tensor([[[1, 2, 3], [1, 2, 4], [5, 6, -1]]])
    values = torch.tensor([[[0.9, 0.8, 0.1], [0.9, 0.8, 0.5], [0.7, 0.2, 0.0]]])
    kept = prune_paths(paths, values, 4)  # nodes 1(.9) 1-2(.8) 5(.7) 1-2-4(.5)
    assert kept.tolist() == [[[1, 2, -1], [1, 2, 4], [5, -1, -1]]]
    assert int(build_tree(kept).num_nodes[0]) == 5
    # per-row budgets
    kept = prune_paths(paths.expand(2, -1, -1), values.expand(2, -1, -1), torch.tensor([1, 0]))
    assert kept[0].tolist() == [[1, -1, -1], [1, -1, -1], [-1, -1, -1]]
    assert (kept[1] < 0).all()
