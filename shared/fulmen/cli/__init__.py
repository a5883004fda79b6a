"""The `fulmen` command line: `main` is the entry point, one module per family of commands, and the
plumbing every command shares (`service`, `standalone`, `dev`).
"""
