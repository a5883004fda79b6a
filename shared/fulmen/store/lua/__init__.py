"""The Lua scripts behind every store transition that touches several keys, so each is atomic.
"""
