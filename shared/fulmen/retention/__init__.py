"""Retention: what may go from an experiment's streams and when (`fulmen trim`, the watchdog's
schedule). `trim` is the entry point; `cuts`, `rollouts` and `weights` the parts.
"""
