"""A tool-use loop with the official ``anthropic`` SDK on the proxy's ``/v1/messages``."""
