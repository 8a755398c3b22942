"""Sets of all-gathers as bits, for ``fast-free``: packing, unions, byte totals, each node's ancestors.

Bit ``b`` stands for one all-gather; bits go by the position of the all-gather's
last use, so a set's highest pending bit is usually the all-gather of it that runs
last. A plain Python int holds a set in full up to its highest bit; the sets
``fast-free`` keeps for every node it asks about are stored packed
(:func:`pack`) so that they take memory linear in the graph.
"""

from __future__ import annotations

from dcsched.graph.form import GraphForm


def union(masks) -> int:
    total = 0
    for mask in masks:
        total |= mask
    return total


def total_size(mask: int, size_of_bit: list) -> int:
    """Total size of the all-gathers in a bitset."""
    total = 0
    while mask:
        low = mask & -mask
        total += size_of_bit[low.bit_length() - 1]
        mask ^= low
    return total


#: A packed bitset (see pack), and the empty one.
Packed = tuple  # (k, z, rest, outliers): int, int, int, tuple[int, ...]
EMPTY = (0, 0, 0, ())
#: Sets of up to this many bits stay as they are; a gap at least this wide under a set's top bit makes
#: that bit an outlier (at most MAX_OUTLIERS of them).
SMALL_SET = 1024
MAX_OUTLIERS = 4


def pack(bits: int) -> Packed:
    """A bitset as ``(k, z, rest, outliers)``: bits 0 to k-1 all set, ``rest`` shifted up by ``z`` (its
    lowest bit set, z >= k; 0 for none), and a few lone high bits.

    Bits go by the position of their all-gather's last use, so a node's ancestor
    all-gathers are mostly every all-gather used up before it (a run of ones from
    bit 0), an all-gather's own set is one high bit, and a tied embedding, used
    last at the very end, is one high bit in almost every set: a plain int
    stores each of these in full, all the way up to its highest bit. Kept for
    every target, plain ints take O(targets x all-gathers) bits (96 MiB on a
    10^5-node layered stack); packed, each takes about the span of its
    irregular part.

    >>> pack(0b1011), pack(0b10000), pack(0), unpack(pack(0b1101101))
    ((2, 3, 1, ()), (0, 4, 1, ()), (0, 0, 0, ()), 109)
    >>> pack((1 << 5000) | (0b101 << 10) | 0b111)  # a tied embedding's bit far above the rest
    (3, 10, 5, (5000,))
    """
    # the trailing ones (none, often: an all-gather's own bit, a node before any all-gather)
    k = (~bits & (bits + 1)).bit_length() - 1 if bits & 1 else 0
    rest = bits >> k if k else bits
    if not rest:
        return k, 0, 0, ()
    z = (rest & -rest).bit_length() - 1  # then the zeros up to the next one
    rest >>= z
    outliers: tuple[int, ...] = ()
    while rest.bit_length() > SMALL_SET and len(outliers) < MAX_OUTLIERS:
        top = rest.bit_length() - 1
        below = rest ^ (1 << top)
        if top - below.bit_length() < SMALL_SET:
            break
        outliers += (k + z + top,)
        rest = below
    return k, k + z, rest, outliers


def unpack(packed: Packed) -> int:
    k, z, rest, outliers = packed
    bits = ((1 << k) - 1) | (rest << z) if k else rest << z
    for bit in outliers:
        bits |= 1 << bit
    return bits


def packed_count(packed: Packed) -> int:
    return packed[0] + packed[2].bit_count() + len(packed[3])


#: A node whose last reader comes more than this many positions later keeps its set packed meanwhile,
#: unless the plain int is no larger than a packed one would be (up to SMALL_SET bits).
NEAR_READERS = 64


def allgather_ancestors(g: GraphForm, bit_of: dict[int, int], targets: set[int]) -> dict[int, Packed]:
    """For each target node, the bitset of all-gathers among it and its ancestors, packed (:func:`pack`).

    A node's set lives only until its last reader has read it, as a plain int
    while that reader is near and packed while it is far (a forward graph's
    saved activations are all read by its output, at the very end); a node
    that passes its one input's set on unchanged (a wait, a view) shares that
    input's packed form.
    """
    n = len(g)
    preds, succs = g.preds, g.succs
    remaining = [len(s) for s in succs]
    bits: list = [0] * n  # the plain set while a near reader is left; None where only packed is kept
    packed: list = [None] * n  # the packed set, where a target or a far reader needed it
    found: dict[int, Packed] = {}
    for i in range(n):
        ins = preds[i]
        own = bit_of.get(i)
        if not remaining[i] and i not in targets:
            pass  # nobody asks for this set (the graph's output)
        elif len(ins) == 1 and own is None:
            p = ins[0]
            b, pk = bits[p], packed[p]
            if b is None:
                b = unpack(pk)
        else:
            b, pk = 0, None
            for p in ins:
                bp = bits[p]
                b |= bp if bp is not None else unpack(packed[p])
            if own is not None:
                b |= 1 << own
        if i in targets:
            if pk is None:
                pk = pack(b)
            found[i] = pk
        if remaining[i]:
            if b.bit_length() > SMALL_SET and max(succs[i]) - i > NEAR_READERS:
                bits[i], packed[i] = None, (pk if pk is not None else pack(b))
            else:
                bits[i], packed[i] = b, pk
        for p in ins:
            remaining[p] -= 1
            if not remaining[p]:
                bits[p] = packed[p] = None  # no reader left: let the set go
    return found
