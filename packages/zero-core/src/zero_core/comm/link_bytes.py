"""How many bytes of one collective cross node boundaries: the comms logger's link model.

[Note: bytes by link class]
The comms logger (see [Note: what the comms logger counts]) splits every op's traffic into two
link classes, ``intra_node`` and ``inter_node``, using the node topology of [Note: node
topology] (ranks per node from the launcher, ``ZERO_RANKS_PER_NODE`` to pretend). The model is
*the bytes this rank sends, as a direct exchange*: each piece of data goes straight from the
rank that has it to each rank that needs it, and a piece whose destination runs on another
node counts as ``inter_node``, else ``intra_node``. For a group of ``n`` ranks, ``B`` the
logical size the logger records for the op (see its Note) and ``c = B / n`` one rank's chunk:

* ``all_gather_into_tensor``, ``all_gather``: this rank sends its chunk ``c`` to each other
  member;
* ``reduce_scatter_tensor``: this rank sends chunk ``j`` of its input (``c`` bytes) to member
  ``j``, for each other member;
* ``all_reduce``, ``compressed_all_reduce``: a reduce-scatter then an all-gather: ``2c`` to each
  other member;
* ``reduce``: a reduce-scatter, then each member sends its reduced chunk to the root: ``c``
  to each other member plus ``c`` to the root (nothing more for the root itself);
* ``broadcast``: the root sends ``B`` to each other member; the others send nothing;
* ``all_to_all_single``: input split ``j`` to member ``j`` (equal splits when none are given);
* ``send``/``isend``: the tensor to the peer; ``recv``/``irecv``: nothing (the sender counts
  it); ``batch_isend_irecv``: its send ops;
* object collectives and barriers: nothing.

So for a group inside one node everything is ``intra_node``; for the whole world of ``N``
ranks over nodes of ``L`` ranks, an all-gather of ``B`` bytes sends ``B (N - L) / N`` across
nodes from each rank (``B/2`` for 2 nodes x 2), and a group holding one rank per node (the
inter-node group of MiCS's hierarchical gather) sends everything across.

This is the load of a *flat* collective, where every piece crosses to every destination rank on
another node on its own. A hierarchical algorithm that sends each piece across once per node
and fans it out inside the node moves less across; zero makes such algorithms explicit as
separate collectives (MiCS's two-hop gather is an all-gather over one rank per node, then one
inside the node), so the model credits them exactly. It is an accounting model of the ops'
logical sizes, not a capture of wire bytes: NCCL's rings and trees forward pieces through
intermediate ranks, and their per-link load differs.
"""

from __future__ import annotations

from collections.abc import Sequence

#: ops that send no tensor payload of their own (``batch_isend_irecv``'s sends are added per op
#: by ``p2p_sends``)
_NO_PAYLOAD = frozenset(
    {
        "broadcast_object_list",
        "all_gather_object",
        "barrier",
        "monitored_barrier",
        "recv",
        "irecv",
        "batch_isend_irecv",
    }
)


def split_by_link(
    op: str,
    group_ranks: Sequence[int],
    me: int,
    ranks_per_node: int,
    nbytes: int,
    *,
    root: int | None = None,
    peer: int | None = None,
    send_splits: Sequence[int] | None = None,
) -> tuple[int, int]:
    """``(intra_node, inter_node)`` bytes this rank (global rank ``me``) sends for one ``op``.

    ``group_ranks`` are the group's global ranks, ``nbytes`` the size the logger records;
    ``root`` is the global root of ``broadcast``/``reduce``, ``peer`` the global peer of a
    send, ``send_splits`` the bytes sent to each member by ``all_to_all_single``.
    See [Note: bytes by link class].
    """
    if ranks_per_node < 1:
        raise ValueError(f"split_by_link: ranks_per_node must be >= 1, got {ranks_per_node}")
    node = me // ranks_per_node
    if op in _NO_PAYLOAD or nbytes <= 0:
        return 0, 0
    if op in ("send", "isend"):
        if peer is None:
            raise ValueError(f"split_by_link: {op} needs its peer")
        return (nbytes, 0) if peer // ranks_per_node == node else (0, nbytes)
    ranks = list(group_ranks)
    n = len(ranks)
    if n <= 1:
        return 0, 0
    others_same = sum(1 for r in ranks if r != me and r // ranks_per_node == node)
    others_far = n - 1 - others_same
    if op == "all_to_all_single":
        splits = list(send_splits) if send_splits is not None else [nbytes // n] * n
        intra = sum(s for r, s in zip(ranks, splits) if r != me and r // ranks_per_node == node)
        inter = sum(s for r, s in zip(ranks, splits) if r // ranks_per_node != node)
        return intra, inter
    if op == "broadcast":
        if root is None:
            raise ValueError("split_by_link: broadcast needs its root")
        return (nbytes * others_same, nbytes * others_far) if root == me else (0, 0)
    chunk = nbytes / n
    per_member = {
        "all_gather_into_tensor": 1,
        "all_gather": 1,
        "reduce_scatter_tensor": 1,
        "all_reduce": 2,
        "compressed_all_reduce": 2,
        "reduce": 1,
    }.get(op)
    if per_member is None:
        raise ValueError(f"split_by_link: no link model for op {op!r}")
    intra = chunk * per_member * others_same
    inter = chunk * per_member * others_far
    if op == "reduce" and root is not None and root != me:
        if root // ranks_per_node == node:
            intra += chunk
        else:
            inter += chunk
    return round(intra), round(inter)


def p2p_sends(ops: Sequence[tuple[str, int, int]], me: int, ranks_per_node: int) -> tuple[int, int]:
    """``(intra_node, inter_node)`` bytes of the send ops of a batch: ``(op_name, peer, nbytes)``."""
    intra = inter = 0
    for name, peer, size in ops:
        if name in ("send", "isend"):
            a, b = split_by_link("send", (), me, ranks_per_node, size, peer=peer)
            intra, inter = intra + a, inter + b
    return intra, inter
