"""The adapter service: spans become training samples (`fulmen adapter`)."""
