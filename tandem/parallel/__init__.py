"""Tensor parallelism: a model split over N ranks, Megatron-style, with reductions in a fixed order.

plan.py: which slice of every weight and state a rank holds (heads, MLP columns / rows, vocabulary rows);
checkpoint.py: a checkpoint view that reads only one rank's slices; numpy_mesh.py: the NumPy model over N
simulated ranks (the reference of the reduction order). Sources: Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism" (column- then row-parallel pairs, one all-reduce
after each pair); spec/qwen3_5.md §2-§3 for the tensors split.
"""
