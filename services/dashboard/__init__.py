"""`fulmen dashboard`: a web view of experiments, runs, rollouts and their spans, the live pipeline and
the curves, read from Redis (read-only unless admin actions are enabled)."""
