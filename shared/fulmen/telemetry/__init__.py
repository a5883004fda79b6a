"""Observability: OpenTelemetry tracing and its semantic conventions, health and Prometheus endpoints,
the trainer's step metrics, and the live pipeline view.
"""
