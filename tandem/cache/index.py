"""The prefix index: a trie over token blocks, each block a cached piece of a sequence (plain typed Python, mypyc).

A sequence under a salt is cut at absolute multiples of ``chunk`` tokens. Each trie node (``Block``) holds the
tokens [start, end) of one piece, keyed in its parent by that exact tuple of ids: a dict's hash is only the hint,
its key comparison checks every id. A block stores the view rows of its own positions (``has_rows``) and, where a
snapshot was taken at its end, the state's sections there (``has_sections``: a restore point). Full blocks
(end - start == chunk) start on the grid; a partial block (fewer tokens, a session snapshot ending between grid
points) is always a leaf. The arrays themselves live in ``Block.data`` and are owned by tandem/cache/store.py.
"""

from __future__ import annotations

from typing import Any

RESIDENT = "resident"
HOST = "host"
DISK = "disk"
TIERS = (RESIDENT, HOST, DISK)


class Block:
    """Tokens [start, end) of one cached sequence, with what was copied of its state.

    Attributes:
        key: the ids of positions start..end-1. parent: the block ending at ``start`` (the salt's root at 0).
        children: full blocks after this one, by key. partials: partial leaves after this one (a prompt's or a
            session's end), by key.
        tier: where ``data`` lives: "resident", "host", or "disk" (data None, read from ``file`` on use).
        data: name -> array: view rows [end-start, ...] and, for a restore point, sections; "logits" [V] (the
            last position's logits) and "hidden" [end-start, E] (post-final-norm hidden rows) when present.
        nbytes: bytes of ``data`` (estimated before copying; the same on every tier). last_used: LRU clock.
        file: the disk tier's file name ("" when not on disk); file_bytes: its size.
        pending: a host-tier block whose device-to-host copies may still be in flight: the CUDA event to wait on
            before ``data`` is read (tandem/cache/arrays.py ``download``); None once they have landed.
    """

    def __init__(self, key: tuple[int, ...], parent: "Block | None", start: int, salt: str) -> None:
        self.key = key
        self.parent = parent
        self.start = start
        self.end = start + len(key)
        self.salt = salt
        self.children: dict[tuple[int, ...], Block] = {}
        self.partials: dict[tuple[int, ...], Block] = {}
        self.tier = ""
        self.data: Any = None
        self.nbytes = 0
        self.last_used = 0
        self.has_sections = False
        self.has_logits = False
        self.has_hidden = False
        self.file = ""
        self.file_bytes = 0
        self.pending: Any = None

    def chain(self) -> list["Block"]:
        """This block and its ancestors below the root, in position order."""
        out: list[Block] = []
        node: Block | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def subtree(self) -> list["Block"]:
        """This block and every block below it."""
        out: list[Block] = [self]
        i = 0
        while i < len(out):
            node = out[i]
            out.extend(node.children.values())
            out.extend(node.partials.values())
            i += 1
        return out


class PrefixIndex:
    """Blocks of every cached sequence, per salt.

    Args: chunk: the grid in tokens (``--prefix-chunk``), > 0.
    Raises: ValueError for chunk < 1.
    """

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"the prefix chunk must be >= 1 token, got {chunk}")
        self.chunk = chunk
        self.roots: dict[str, Block] = {}
        self.blocks: list[Block] = []  # every block below the roots (unordered)

    def root(self, salt: str) -> Block:
        """The salt's root (position 0), made on first use."""
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = Block((), None, 0, salt)
        return node

    def walk(self, salt: str, ids: list[int]) -> list[Block]:
        """The blocks whose tokens match ``ids`` from position 0, in order: full blocks while the next ``chunk``
        ids match one, then the longest matching partial leaf. Compared id by id; blocks holding no data end it."""
        out: list[Block] = []
        node = self.roots.get(salt)
        if node is None:
            return out
        n, c = len(ids), self.chunk
        while True:
            nxt: Block | None = None
            if node.end + c <= n:
                nxt = node.children.get(tuple(ids[node.end:node.end + c]))
            if nxt is None or nxt.tier == "":
                best: Block | None = None
                for key, leaf in node.partials.items():
                    m = len(key)
                    if leaf.tier != "" and node.end + m <= n and (best is None or m > len(best.key)) \
                            and key == tuple(ids[node.end:node.end + m]):
                        best = leaf
                if best is not None:
                    out.append(best)
                return out
            out.append(nxt)
            node = nxt

    def find(self, salt: str, ids: list[int], end: int) -> Block | None:
        """The block of ``ids[:end]`` ending exactly at ``end`` (the root for end 0), or None."""
        if end == 0:
            return self.root(salt)
        for block in self.walk(salt, ids[:end]):
            if block.end == end:
                return block
        return None

    def add(self, parent: Block, key: tuple[int, ...]) -> Block:
        """A new empty block after ``parent`` (not yet findable: its tier is "" until ``publish``), replacing
        none: the caller checks ``child`` first.

        Raises: ValueError: the key is empty or longer than the chunk, or a partial block would start off the grid.
        """
        if not key or len(key) > self.chunk or parent.end % self.chunk:
            raise ValueError(f"a block of {len(key)} tokens cannot follow position {parent.end}")
        if parent.parent is None:  # a root pruned by `remove` while its request ran: findable again
            self.roots.setdefault(parent.salt, parent)
        block = Block(key, parent, parent.end, parent.salt)
        (parent.children if len(key) == self.chunk else parent.partials)[key] = block
        self.blocks.append(block)
        return block

    @staticmethod
    def child(parent: Block, key: tuple[int, ...], chunk: int) -> Block | None:
        """The existing block after ``parent`` with exactly ``key`` (full or partial), or None."""
        return (parent.children if len(key) == chunk else parent.partials).get(key)

    def remove(self, block: Block) -> list[Block]:
        """Unlink ``block`` and its subtree from the index; returns the removed blocks (their data is the caller's
        to free)."""
        gone = block.subtree()
        parent = block.parent
        if parent is not None:
            table = parent.children if len(block.key) == self.chunk else parent.partials
            if table.get(block.key) is block:
                del table[block.key]
        if parent is not None and parent.parent is None and not parent.children and not parent.partials \
                and self.roots.get(parent.salt) is parent:
            del self.roots[parent.salt]  # a salt with nothing cached keeps no root (distinct salts do not pile up)
        ids = {id(b) for b in gone}
        self.blocks = [b for b in self.blocks if id(b) not in ids]
        for b in gone:
            b.tier = ""
        return gone

    def clear(self) -> list[Block]:
        """Remove every block; returns them."""
        gone = list(self.blocks)
        self.roots = {}
        self.blocks = []
        for b in gone:
            b.tier = ""
        return gone
