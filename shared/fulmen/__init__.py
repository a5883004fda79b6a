"""Fulmen: train any AI agent with RL, prompt optimisation and SFT, over Redis Streams.

`fulmen.store` holds the store; `fulmen.records` every message record; `fulmen.keys` every Redis key.
"""

__version__ = "0.1.0"
