"""The archive: an experiment's finished rollouts, spans and samples written to files, read back by
`fulmen replay` and `fulmen export`.
"""
