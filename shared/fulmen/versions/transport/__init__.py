"""How a model version's bytes travel. A publish writes them through a `base.Transport`, one per way:
chunks on a Redis stream (`redis`; read back by `stream`, or on a socket of its own: `socket`) or a
file in a shared folder (`folder`, hashing while it writes: `file_write`; `file_follow`, `file_spares`).
"""
