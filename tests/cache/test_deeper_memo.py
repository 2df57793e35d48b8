"""``RadixTree.deeper_checkpoint`` is memoised: the memo must equal a fresh walk after any
sequence of inserts, removals and checkpoints coming and going in either tier."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.cache.radix_tree import UNKNOWN, Node, RadixTree

OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "remove", "attach", "detach", "host", "unhost", "ask"]),
        st.integers(0, 10**6),
    ),
    max_size=300,
)


def _fresh(node: Node) -> Node | None:
    below = node
    while len(below.children) == 1:
        below = next(iter(below.children.values()))
        if below.checkpoint_slot is not None or below.host_slot is not None:
            return below
    return None


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_memo_equals_a_fresh_walk(ops: list[tuple[str, int]]) -> None:
    tree = RadixTree()
    nodes: list[Node] = []
    next_key = 1
    for op, pick in ops:
        live = [n for n in nodes if n.parent is not None]
        if op == "insert" or not live:
            # mostly extend a chain (a leaf), sometimes fork
            parent = tree.root if not live else live[pick % len(live)]
            nodes.append(tree.insert(parent, next_key, -1))
            next_key += 1
            continue
        node = live[pick % len(live)]
        if op == "remove" and not node.children:
            if node.checkpoint_slot is not None:
                tree.detach_checkpoint(node)
            tree.remove_leaf(node)
        elif op == "attach" and node.checkpoint_slot is None:
            tree.attach_checkpoint(node, 0)
        elif op == "detach" and node.checkpoint_slot is not None:
            tree.detach_checkpoint(node)
        elif op == "host" and node.host_slot is None:
            node.host_slot = 0
            tree.checkpoint_changed(node)
        elif op == "unhost" and node.host_slot is not None:
            node.host_slot = None
            tree.checkpoint_changed(node)
        elif op == "ask":
            assert tree.deeper_checkpoint(node) is _fresh(node)
        for n in [n for n in nodes if n.parent is not None]:
            if n.deeper is not UNKNOWN:
                assert n.deeper is _fresh(n), f"stale memo after {op}"
        tree.check_deeper([n for n in nodes if n.parent is not None])


def test_a_checkpoint_below_a_chain_and_a_fork_change_the_answer() -> None:
    tree = RadixTree()
    a = tree.insert(tree.root, 1, -1)
    b = tree.insert(a, 2, -1)
    c = tree.insert(b, 3, -1)
    assert tree.deeper_checkpoint(a) is None
    tree.attach_checkpoint(c, 0)
    assert tree.deeper_checkpoint(a) is c
    tree.attach_checkpoint(b, 1)
    assert tree.deeper_checkpoint(a) is b
    assert tree.deeper_checkpoint(b) is c
    d = tree.insert(b, 4, -1)  # a fork below b: b's path forks, a's still ends at b
    assert tree.deeper_checkpoint(b) is None
    assert tree.deeper_checkpoint(a) is b
    tree.detach_checkpoint(b)
    assert tree.deeper_checkpoint(a) is None  # the fork at b now stops a's walk
    tree.remove_leaf(d)
    assert tree.deeper_checkpoint(a) is c
