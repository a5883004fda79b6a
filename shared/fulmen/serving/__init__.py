"""Which model version serves: rollback, A/B tests, the serving lag, and reward per version.
"""
