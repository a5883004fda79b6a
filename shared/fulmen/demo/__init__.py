"""The demo's parts: arithmetic and calculator tasks, the tiny model, the SFT warm start. Nothing in
the core imports them; the CLI's zero-set-up paths and the demo driver do.
"""
