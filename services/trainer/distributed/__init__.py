"""Data-parallel trainer ranks: over Redis (`rank_group`, `exchange`, `membership`) or torch.distributed
(`torch_ranks`), when gradients go compressed (`sync_policy`), and the codecs they travel through.
"""
