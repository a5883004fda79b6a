"""How a model version's bytes travel: chunks on a Redis stream (`stream`, or a socket of its own:
`socket`) or a file in a shared folder (`file_write`, `file_follow`, `file_spares`).
"""
