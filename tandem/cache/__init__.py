"""The prefix cache (DESIGN.md, "Caches"): snapshots of sequences found by their token ids and restored exactly.

index.py: the block trie (bookkeeping, compiled with mypyc); store.py: tiers, budgets, eviction, restore;
disk.py: the disk tier's files; signature.py: what a disk file must match; sequence.py: one request's chunked
prefill through the cache; arrays.py: host/device copies; build.py: the engine's cache from its options.
"""
